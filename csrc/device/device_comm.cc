#include "device/device_comm.h"

#include <algorithm>
#include <limits>

#include "common/errors.h"
#include "device/tickets.h"

namespace clawcomm {
namespace device {
namespace {

IpcKernel kernelOf(Algorithm a) {
  return a == Algorithm::kIpcOneShot ? IpcKernel::kOneShot : IpcKernel::kTwoShot;
}

bool pointToPoint(OpType t) {
  return t == OpType::kSend || t == OpType::kRecv;
}

}  // namespace

// ---------------------------------------------------------------------------
// DeviceComm

DeviceComm::DeviceComm(std::shared_ptr<Communicator> comm, std::shared_ptr<DeviceRuntime> runtime)
    : comm_(std::move(comm)), runtime_(std::move(runtime)), recvs_(std::make_shared<RecvQueue>()) {
  recvs_->launch = [this](PendingRecv& p) { launchRecv(p); };
  listener_ = comm_->addFailureListener([this](const std::string&) { abort(); });
}

DeviceComm::~DeviceComm() {
  comm_->removeFailureListener(listener_);
  if (!comm_->failure().empty()) abort();
  {
    // Receives never waited for are never launched: their messages stay
    // in the peers' rings, which go with the group.
    std::lock_guard<std::mutex> lock(recvs_->mutex);
    recvs_->launch = nullptr;
    for (auto& [peer, queue] : recvs_->byPeer) {
      for (auto& p : queue) {
        p->started = true;
        p->notRun = "the group was destroyed before this receive was waited for";
        comm_->endExternal(p->record, false);
        if (p->callerDone) runtime_->release(p->callerDone);
        p->callerDone = nullptr;
      }
    }
    recvs_->byPeer.clear();
  }
  try {
    reap(/*wait=*/true);
  } catch (...) {  // a destructor reports nothing; the calls' Works report their errors
  }
  // (A captured graph may keep the buffer a while longer: IpcMapping.)
  comm_->addDeviceBytes(-deviceBytes_);
}

bool DeviceComm::ipc(OpType op, size_t bytesPerRank, const Streams& s) {
  // CLAWCOMM_DETERMINISTIC=1: the IPC kernels add in their own orders, so
  // reductions are staged through host memory and the engine's
  // deterministic algorithms (docs/deterministic.md). Staging waits on the
  // host, which a CUDA graph cannot capture.
  if (comm_->settings().deterministic &&
      (op == OpType::kAllReduce || op == OpType::kReduceScatter || op == OpType::kReduce)) {
    CLAWCOMM_ARG_CHECK(!s.captured, opPrefix(op),
                       "a CUDA graph cannot capture a reduction with CLAWCOMM_DETERMINISTIC=1 "
                       "(it is staged through host memory, not CUDA IPC)");
    return false;
  }
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
      if (why.empty()) {
        deviceBytes_ = int64_t(group->mapping()->bufferBytes());
        comm_->addDeviceBytes(deviceBytes_);
      }
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
    comm_->abort(
        describe(status, comm_->rank()));  // every rank learns; our listener stops our blocks
    std::rethrow_exception(failureOf(op, status, comm_->rank()));
  }
}

void DeviceComm::reap(bool wait) {
  if (wait) {
    std::deque<std::shared_ptr<DeviceFlight>> all;
    {
      std::lock_guard<std::mutex> lock(recvs_->mutex);
      all.swap(inFlight_);
    }
    for (auto& f : all) runtime_->waitHost(f->event);
    for (auto& f : all) f->end();
    return;
  }
  // Not waiting: the caller holds recvs_->mutex.
  if (inFlight_.size() < kReapEvery) return;
  const Stream newest = inFlight_.back()->stream;
  const bool oneStream = std::all_of(inFlight_.begin(), inFlight_.end(),
                                     [&](const auto& f) { return f->stream == newest; });
  if (!oneStream || !inFlight_.back()->done()) {
    // Behind, or calls on several streams (sends and receives run on
    // their own): settle those that are done.
    inFlight_.erase(
        std::remove_if(inFlight_.begin(), inFlight_.end(), [](const auto& f) { return f->done(); }),
        inFlight_.end());
    return;
  }
  // On one stream whose newest is done: every one is done.
  for (auto& f : inFlight_) f->end();
  inFlight_.clear();
}

template <typename Run>
TicketPtr DeviceComm::issue(OpSignature sig, uint64_t bytes, uint64_t sent, uint64_t received,
                            Streams s, Run run, int peer) {
  checkHealthy(sig.type);
  const bool captured = s.captured;
  // The eager collectives share this rank's epoch counters and IPC areas,
  // whichever stream each runs on (a synchronous call on its caller's, an
  // asynchronous one on the communicator's): each waits for the one before.
  const bool ordered = !captured && !pointToPoint(sig.type);
  std::shared_ptr<DeviceFlight> before;
  // Querying an event is not allowed while a stream captures (torch's
  // default capture mode invalidates the graph): reap on eager calls only.
  if (!captured) {
    std::lock_guard<std::mutex> lock(recvs_->mutex);
    reap(/*wait=*/false);
    if (ordered) before = lastCollective_;
  }
  const uint64_t record = comm_->beginExternal(sig, bytes, peer);  // numbers sig
  const IpcGroup::Launch how{captured ? s.caller : s.run, captured ? kIpcGraph : kIpcEager,
                             uint64_t(comm_->timeout().count()) * 1000000,
                             pointToPoint(sig.type) ? IpcCall{} : callOf(sig)};
  try {
    if (s.run != s.caller) runtime_->streamWaitStream(s.run, s.caller);
    if (before && before->stream != s.run) runtime_->streamWait(s.run, before->event);
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
  {
    std::lock_guard<std::mutex> lock(recvs_->mutex);
    inFlight_.push_back(flight);
    if (ordered) lastCollective_ = flight;
  }
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
  checkHealthy(OpType::kRecv);
  CLAWCOMM_CHECK(!s.captured, opPrefix(OpType::kRecv), "a receive cannot be captured");
  OpSignature sig{OpType::kRecv, DataType::kUInt8, ReduceOp::kSum, -1, bytes};
  sig.algo = Algorithm::kIpc;
  auto p = std::make_shared<PendingRecv>();
  p->peer = peer;
  p->out = buf;
  p->bytes = bytes;
  p->tag = tag;
  p->run = s.run;
  p->then = std::move(s.then);
  p->keep = std::move(s.keep);
  {
    std::lock_guard<std::mutex> lock(recvs_->mutex);
    reap(/*wait=*/false);
    p->slot = group_->placeRecv(bytes, peer);
    p->record = comm_->beginExternal(sig, bytes, peer);
    // What the caller issued before it (the buffer's allocation) comes first.
    if (s.run != s.caller) p->callerDone = runtime_->record(s.caller);
    recvs_->byPeer[peer].push_back(p);
  }
  comm_->countExternal(OpType::kRecv, 0, bytes);
  return std::make_shared<DeviceTicket>(runtime_, group_->mapping(), nullptr, OpType::kRecv, comm_,
                                        p, recvs_);
}

void DeviceComm::launchRecv(PendingRecv& p) {
  std::shared_ptr<IpcGroup> group;
  bool aborted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    group = group_;
    aborted = aborted_;
  }
  const IpcStatus status = group->status();
  if (comm_->failed()) {
    p.notRun = "the communicator was aborted by an earlier error: " + comm_->failure();
  } else if (aborted) {
    p.notRun = "the device collectives were aborted before this receive was waited for";
  } else if (status.state != kIpcOk) {
    p.notRun = describe(status, comm_->rank());
  } else {
    try {
      if (p.callerDone) runtime_->streamWait(p.run, p.callerDone);
      const IpcGroup::Launch how{p.run, kIpcEager, uint64_t(comm_->timeout().count()) * 1000000};
      group->recv(p.slot, p.out, p.bytes, p.peer, p.tag, how);
      if (p.then) p.then();
      p.flight = std::make_shared<DeviceFlight>(runtime_, runtime_->record(p.run), p.run, comm_,
                                                p.record, group->mapping());
      inFlight_.push_back(p.flight);
    } catch (const std::exception& e) {
      p.notRun = e.what();
    }
  }
  if (!p.notRun.empty()) comm_->endExternal(p.record, false);
  if (p.callerDone) runtime_->release(p.callerDone);
  p.callerDone = nullptr;
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
