#include "device/device_comm.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include "common/errors.h"

namespace clawcomm {
namespace device {
namespace {

// The kernels' phases, as an error names them.
const char* phaseName(int phase) {
  switch (phase) {
    case kIpcStart: return "start";
    case kIpcMiddle: return "middle";
    case kIpcEnd: return "end";
    case kIpcPhaseSpace: return "send, waiting for room in its ring";
    case kIpcPhaseData: return "receive, waiting for its message";
  }
  return "?";
}

// "rank 0's CUDA IPC kernel gave up after 5000 ms waiting for rank 1 (block 3,
// phase start, epoch 12, eager launch): ..."
std::string describe(const IpcStatus& s, int rank) {
  if (s.state == kIpcMismatch) {
    return CLAWCOMM_CONCAT(
        "rank ", rank, "'s CUDA IPC receive of message ", s.epoch, " from rank ", s.waitedFor,
        " expected tag ", s.expected.tag, " (", s.expected.bytes, " bytes) and found tag ",
        s.found.tag, " (", s.found.bytes,
        " bytes): through CUDA IPC (CLAWCOMM_CUDA_P2P_BYTES), the sends and receives between two "
        "ranks match in the order they are issued, with the same tag and size; set "
        "CLAWCOMM_CUDA_P2P_BYTES=0 to stage them, matched by tag");
  }
  const std::string where = CLAWCOMM_CONCAT(
      "rank ", rank, "'s CUDA IPC kernel ", "%s", " rank ", s.waitedFor, " (block ", s.block,
      ", phase ", phaseName(s.phase), ", epoch ", s.epoch, ", ",
      s.channel == kIpcGraph ? "graph" : "eager", " launch, after ", s.waitedNs / 1000000, " ms)");
  auto with = [&](const char* verb, const char* why) {
    std::string out = where;
    out.replace(out.find("%s"), 2, verb);
    return out + why;
  };
  switch (s.state) {
    case kIpcTimedOut:
      return with("gave up waiting for",
                  ": the group's timeout passed; the peer died, hangs, or stopped calling "
                  "collectives");
    case kIpcAborted: return with("was stopped by abort() while waiting for", "");
    case kIpcPeerFailed:
      return with("stopped waiting for", ": a rank of the group gave up first (see its error)");
  }
  return CLAWCOMM_CONCAT("rank ", rank, "'s CUDA IPC kernel reported state ", s.state);
}

IpcKernel kernelOf(Algorithm a) {
  return a == Algorithm::kIpcOneShot ? IpcKernel::kOneShot : IpcKernel::kTwoShot;
}

}  // namespace

struct DeviceFlight {
  DeviceFlight(std::shared_ptr<DeviceRuntime> rt, DeviceRuntime::Event e, Stream s,
               std::weak_ptr<Communicator> c, uint64_t r, std::shared_ptr<IpcMapping> m)
      : runtime(std::move(rt)),
        event(e),
        stream(s),
        comm(std::move(c)),
        record(r),
        mapping(std::move(m)) {}
  ~DeviceFlight() { runtime->release(event); }

  // The flight record's entry ends once, ok unless a launch gave up.
  void end() {
    if (ended.exchange(true)) return;
    if (auto c = comm.lock()) c->endExternal(record, mapping->status()->state == kIpcOk);
  }
  bool done() {
    if (!runtime->done(event)) return false;
    end();
    return true;
  }

  std::shared_ptr<DeviceRuntime> runtime;
  DeviceRuntime::Event event;
  Stream stream;  // the call ran on it
  std::weak_ptr<Communicator> comm;
  uint64_t record;
  std::shared_ptr<IpcMapping> mapping;
  std::atomic<bool> ended{false};
};

// ---------------------------------------------------------------------------
// DeviceTicket

DeviceTicket::DeviceTicket(std::shared_ptr<DeviceRuntime> runtime,
                           std::shared_ptr<IpcMapping> mapping,
                           std::shared_ptr<DeviceFlight> flight, OpType type,
                           std::weak_ptr<Communicator> comm)
    : runtime_(std::move(runtime)),
      mapping_(std::move(mapping)),
      flight_(std::move(flight)),
      type_(type),
      comm_(std::move(comm)) {}

bool DeviceTicket::done() {
  return !flight_ || flight_->done();
}

void DeviceTicket::waitOn(Stream s) {
  if (flight_) runtime_->streamWait(s, flight_->event);
}

void DeviceTicket::waitHost() {
  if (!flight_) return;
  runtime_->waitHost(flight_->event);
  flight_->end();
}

std::exception_ptr DeviceTicket::error() const {
  const IpcStatus* live = mapping_->status();
  if (live->state == kIpcOk) return nullptr;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const std::string why = describe(*live, mapping_->peers[kIpcEager].rank);
  if (auto comm = comm_.lock()) comm->abort(why);  // so that every rank learns
  return std::make_exception_ptr(PeerError(opPrefix(type_) + why));
}

// ---------------------------------------------------------------------------
// DeviceComm

DeviceComm::DeviceComm(std::shared_ptr<Communicator> comm, std::shared_ptr<DeviceRuntime> runtime)
    : comm_(std::move(comm)), runtime_(std::move(runtime)) {
  listener_ = comm_->addFailureListener([this](const std::string&) { abort(); });
}

DeviceComm::~DeviceComm() {
  comm_->removeFailureListener(listener_);
  if (!comm_->failure().empty()) abort();
  try {
    reap(/*wait=*/true);
  } catch (...) {  // a destructor reports nothing; the calls' Works report their errors
  }
}

bool DeviceComm::ipc(OpType op, size_t bytesPerRank, const Streams& s) {
  bool needSetup;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    needSetup = !group_ && why_.empty();
  }
  if (needSetup) {
    const std::string failed = comm_->failure();
    if (!failed.empty()) {
      throw PeerError(opPrefix(op) + "the communicator was aborted by an earlier error: " + failed);
    }
    const Settings& settings = comm_->settings();
    if ((op == OpType::kSend || op == OpType::kRecv) && settings.cudaP2pBytes == 0) return false;
    std::string why;
    if (!settings.cudaIpc) {
      why = "CLAWCOMM_CUDA_IPC=0";
    } else if (comm_->topology().hosts() > 1) {
      why = CLAWCOMM_CONCAT("the group spans ", comm_->topology().hosts(),
                            " hosts (CUDA IPC joins ranks of one host)");
    }
    std::shared_ptr<IpcGroup> group;
    if (why.empty()) {
      group = std::make_shared<IpcGroup>(runtime_, comm_->store(), comm_->setupNamespace("ipc"),
                                         comm_->rank(), comm_->size(), settings.cudaIpcBytes,
                                         settings.cudaGraphBytes, settings.cudaP2pBytes,
                                         Clock::now() + comm_->timeout());
      if (!group->usable()) why = group->whyNot();
    }
    bool abortNow;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      group_ = group;
      why_ = why.empty() ? "" : why + "; CUDA tensors are staged through host memory";
      abortNow = aborted_;
    }
    if (abortNow && group) group->abort();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!why_.empty()) return false;
  }
  const bool captured = s.captured;
  const size_t capacity = group_->capacity(captured ? kIpcGraph : kIpcEager);
  bool fits = true;
  switch (op) {
    case OpType::kAllReduce: break;  // in pieces
    case OpType::kBroadcast: fits = bytesPerRank <= capacity; break;
    case OpType::kAllGather:
    case OpType::kReduceScatter:
    case OpType::kAllToAll:
      fits = IpcGroup::areaBytes(bytesPerRank, comm_->size()) <= capacity;
      break;
    case OpType::kSend:
    case OpType::kRecv:
      // Staged, like any send under capture (a graph would replay one
      // message's place in the ring).
      return !captured && P2pRing::footprint(bytesPerRank) <= group_->ringBytes();
    default: fits = false;
  }
  // Staging waits on the host, which a CUDA graph cannot capture.
  CLAWCOMM_ARG_CHECK(
      fits || !captured, opPrefix(op), "a CUDA graph captures calls through CUDA IPC ",
      "whose areas fit CLAWCOMM_CUDA_GRAPH_BYTES (", capacity, " bytes); this one needs ",
      op == OpType::kBroadcast ? bytesPerRank : IpcGroup::areaBytes(bytesPerRank, comm_->size()));
  return fits;
}

Algorithm DeviceComm::allReduceAlgorithm(size_t bytes) const {
  // vLLM's crossovers: one-shot reads n inputs per rank, two-shot two, and
  // costs one more barrier.
  const int n = comm_->size();
  size_t limit = comm_->settings().cudaOneShotMaxBytes;
  if (limit == Settings::kAutoBytes) {
    limit = n <= 2 ? std::numeric_limits<size_t>::max() : n <= 4 ? (512 << 10) : (256 << 10);
  }
  return bytes <= limit ? Algorithm::kIpcOneShot : Algorithm::kIpcTwoShot;
}

void DeviceComm::checkHealthy(OpType op) {
  if (comm_->failed()) {
    throw PeerError(opPrefix(op) +
                    "the communicator was aborted by an earlier error: " + comm_->failure());
  }
  std::shared_ptr<IpcGroup> group;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) throw PeerError(opPrefix(op) + "the device collectives were aborted");
    group = group_;
  }
  CLAWCOMM_CHECK(group && group->usable(), opPrefix(op), "called without an IPC group");
  const IpcStatus status = group->status();
  if (status.state != kIpcOk) {
    const std::string why = describe(status, comm_->rank());
    comm_->abort(why);  // every rank learns; our listener stops our blocks
    throw PeerError(opPrefix(op) + why);
  }
}

void DeviceComm::reap(bool wait) {
  if (inFlight_.empty()) return;
  if (wait) {
    for (auto& f : inFlight_) runtime_->waitHost(f->event);
  } else if (inFlight_.size() < kReapEvery) {
    return;
  } else {
    const Stream newest = inFlight_.back()->stream;
    const bool oneStream = std::all_of(inFlight_.begin(), inFlight_.end(),
                                       [&](const auto& f) { return f->stream == newest; });
    if (!oneStream || !inFlight_.back()->done()) {
      // Behind, or calls on several streams (sends and receives run on
      // their own): settle those that are done.
      inFlight_.erase(std::remove_if(inFlight_.begin(), inFlight_.end(),
                                     [](const auto& f) { return f->done(); }),
                      inFlight_.end());
      return;
    }
  }
  // Waited for, or on one stream whose newest is done: every one is done.
  for (auto& f : inFlight_) f->end();
  inFlight_.clear();
}

template <typename Run>
TicketPtr DeviceComm::issue(OpSignature sig, uint64_t bytes, uint64_t sent, uint64_t received,
                            Streams s, Run run, int peer) {
  checkHealthy(sig.type);
  const bool captured = s.captured;
  // Querying an event is not allowed while a stream captures (torch's
  // default capture mode invalidates the graph): reap on eager calls only.
  if (!captured) reap(/*wait=*/false);
  const IpcGroup::Launch how{captured ? s.caller : s.run, captured ? kIpcGraph : kIpcEager,
                             uint64_t(comm_->timeout().count()) * 1000000};
  const uint64_t record = comm_->beginExternal(sig, bytes, peer);
  try {
    if (s.run != s.caller) runtime_->streamWaitStream(s.run, s.caller);
    run(how);
    if (s.then) s.then();
  } catch (...) {
    comm_->endExternal(record, false);
    throw;
  }
  comm_->countExternal(sig.type, sent, received);
  std::shared_ptr<IpcMapping> mapping = group_->mapping();
  if (captured) {
    // The graph's launches point into the mapping: it lives as long as the
    // graph. Replays are the graph's; the record ends here.
    runtime_->keepWithGraph(s.caller, mapping);
    comm_->endExternal(record, true);
    return std::make_shared<DeviceTicket>(runtime_, mapping, nullptr, sig.type, comm_);
  }
  auto flight = std::make_shared<DeviceFlight>(runtime_, runtime_->record(s.run), s.run, comm_,
                                               record, mapping);
  inFlight_.push_back(flight);
  return std::make_shared<DeviceTicket>(runtime_, mapping, flight, sig.type, comm_);
}

TicketPtr DeviceComm::allReduce(void* buf, size_t count, DataType type, ReduceOp op, Streams s) {
  checkReduceOp(OpType::kAllReduce, type, op);
  const uint64_t bytes = count * elementSize(type), n = uint64_t(comm_->size());
  OpSignature sig{OpType::kAllReduce, type, op, -1, count};
  sig.algo = allReduceAlgorithm(bytes);
  const uint64_t moved =
      sig.algo == Algorithm::kIpcOneShot ? (n - 1) * bytes : 2 * (n - 1) * bytes / n;
  return issue(sig, bytes, moved, moved, s, [&](const IpcGroup::Launch& how) {
    group_->allReduce(buf, buf, count, type, op, kernelOf(sig.algo), how);
    if (op == ReduceOp::kAvg) runtime_->divide(type, buf, count, double(n), how.stream);
  });
}

TicketPtr DeviceComm::allGather(const void* in, void* out, size_t countPerRank, DataType type,
                                Streams s) {
  checkDataType(OpType::kAllGather, type);
  const uint64_t bytes = countPerRank * elementSize(type), n = uint64_t(comm_->size());
  OpSignature sig{OpType::kAllGather, type, ReduceOp::kSum, -1, countPerRank * n};
  sig.algo = Algorithm::kIpc;
  const uint64_t moved = bytes * (n - 1);
  return issue(sig, bytes, moved, moved, s,
               [&](const IpcGroup::Launch& how) { group_->allGather(in, out, bytes, how); });
}

TicketPtr DeviceComm::reduceScatter(const void* in, void* out, size_t countPerRank, DataType type,
                                    ReduceOp op, Streams s) {
  checkReduceOp(OpType::kReduceScatter, type, op);
  const uint64_t bytes = countPerRank * elementSize(type), n = uint64_t(comm_->size());
  OpSignature sig{OpType::kReduceScatter, type, op, -1, countPerRank * n};
  sig.algo = Algorithm::kIpc;
  const uint64_t moved = bytes * (n - 1);
  return issue(sig, bytes * n, moved, moved, s, [&](const IpcGroup::Launch& how) {
    group_->reduceScatter(in, out, countPerRank, type, op, how);
    if (op == ReduceOp::kAvg) runtime_->divide(type, out, countPerRank, double(n), how.stream);
  });
}

TicketPtr DeviceComm::broadcast(void* buf, size_t count, DataType type, int root, Streams s) {
  checkDataType(OpType::kBroadcast, type);
  const int n = comm_->size();
  CLAWCOMM_ARG_CHECK(root >= 0 && root < n, opPrefix(OpType::kBroadcast), "root ", root,
                     " is out of range for a group of ", n, " ranks");
  const uint64_t bytes = count * elementSize(type);
  const bool isRoot = comm_->rank() == root;
  OpSignature sig{OpType::kBroadcast, type, ReduceOp::kSum, root, count};
  sig.algo = Algorithm::kIpc;
  return issue(sig, bytes, isRoot ? bytes * uint64_t(n - 1) : 0, isRoot ? 0 : bytes, s,
               [&](const IpcGroup::Launch& how) { group_->broadcast(buf, bytes, root, how); });
}

TicketPtr DeviceComm::allToAll(const void* in, void* out, size_t countPerRank, DataType type,
                               Streams s) {
  checkDataType(OpType::kAllToAll, type);
  const uint64_t bytes = countPerRank * elementSize(type), n = uint64_t(comm_->size());
  OpSignature sig{OpType::kAllToAll, type, ReduceOp::kSum, -1, 0};
  sig.algo = Algorithm::kIpc;
  const uint64_t moved = bytes * (n - 1);
  return issue(sig, bytes * n, moved, moved, s,
               [&](const IpcGroup::Launch& how) { group_->allToAll(in, out, bytes, how); });
}

void DeviceComm::checkPeer(OpType op, int peer) const {
  CLAWCOMM_ARG_CHECK(peer >= 0 && peer < comm_->size(), opPrefix(op), "rank ", peer,
                     " is out of range for a group of ", comm_->size(), " ranks");
  CLAWCOMM_ARG_CHECK(peer != comm_->rank(), opPrefix(op), "rank ", peer,
                     " cannot send to or receive from itself");
}

TicketPtr DeviceComm::send(const void* buf, size_t bytes, int peer, uint64_t tag, Streams s) {
  checkPeer(OpType::kSend, peer);
  OpSignature sig{OpType::kSend, DataType::kUInt8, ReduceOp::kSum, -1, bytes};
  sig.algo = Algorithm::kIpc;
  return issue(
      sig, bytes, bytes, 0, s,
      [&](const IpcGroup::Launch& how) { group_->send(buf, bytes, peer, tag, how); }, peer);
}

TicketPtr DeviceComm::recv(void* buf, size_t bytes, int peer, uint64_t tag, Streams s) {
  checkPeer(OpType::kRecv, peer);
  OpSignature sig{OpType::kRecv, DataType::kUInt8, ReduceOp::kSum, -1, bytes};
  sig.algo = Algorithm::kIpc;
  return issue(
      sig, bytes, 0, bytes, s,
      [&](const IpcGroup::Launch& how) { group_->recv(buf, bytes, peer, tag, how); }, peer);
}

void DeviceComm::abort() {
  std::shared_ptr<IpcGroup> group;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    group = group_;
  }
  if (group) group->abort();
}

std::string DeviceComm::status() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!why_.empty()) return why_;
  if (!group_) return "not set up";
  const IpcStatus s = group_->status();
  if (s.state != kIpcOk) return describe(s, comm_->rank());
  if (aborted_) return "aborted";
  return "ok";
}

std::vector<int> DeviceComm::devices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return group_ ? group_->devices() : std::vector<int>();
}

}  // namespace device
}  // namespace clawcomm
