#include "device/device_comm.h"

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
  }
  return "?";
}

// "rank 0's CUDA IPC kernel gave up after 5000 ms waiting for rank 1 (block 3,
// phase start, epoch 12, eager launch): ..."
std::string describe(const IpcStatus& s, int rank) {
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

// A pooled event, released when the last holder (the ticket, the flight
// list) lets go.
struct PooledEvent {
  PooledEvent(std::shared_ptr<DeviceRuntime> rt, DeviceRuntime::Event e)
      : runtime(std::move(rt)), event(e) {}
  ~PooledEvent() { runtime->release(event); }
  std::shared_ptr<DeviceRuntime> runtime;
  DeviceRuntime::Event event;
};

}  // namespace

// ---------------------------------------------------------------------------
// DeviceTicket

DeviceTicket::DeviceTicket(std::shared_ptr<DeviceRuntime> runtime,
                           std::shared_ptr<IpcMapping> mapping, std::shared_ptr<void> done,
                           OpType type, std::weak_ptr<Communicator> comm)
    : runtime_(std::move(runtime)),
      mapping_(std::move(mapping)),
      done_(std::move(done)),
      type_(type),
      comm_(std::move(comm)) {}

DeviceRuntime::Event DeviceTicket::event() const {
  return done_ ? static_cast<PooledEvent*>(done_.get())->event : nullptr;
}

bool DeviceTicket::done() {
  return !done_ || runtime_->done(event());
}

void DeviceTicket::waitOn(Stream s) {
  if (done_) runtime_->streamWait(s, event());
}

void DeviceTicket::waitHost() {
  if (done_) runtime_->waitHost(event());
}

std::exception_ptr DeviceTicket::error() const {
  const IpcStatus* live = mapping_->status();
  if (live->state == kIpcOk) return nullptr;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const std::string why = describe(*live, mapping_->peers.rank);
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

bool DeviceComm::ipc(OpType op, size_t bytesPerRank) {
  bool needSetup;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    needSetup = !group_ && why_.empty();
  }
  if (needSetup) {
    const std::string failed = comm_->failure();
    if (!failed.empty()) {
      throw PeerError(
          opPrefix(op) + "the communicator was aborted by an earlier error: " + failed);
    }
    const Settings& settings = comm_->settings();
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
  std::lock_guard<std::mutex> lock(mutex_);
  if (!why_.empty()) return false;
  const size_t capacity = group_->capacity();
  switch (op) {
    case OpType::kAllReduce: return true;  // in pieces
    case OpType::kBroadcast: return bytesPerRank <= capacity;
    case OpType::kAllGather:
    case OpType::kReduceScatter:
    case OpType::kAllToAll: return IpcGroup::areaBytes(bytesPerRank, comm_->size()) <= capacity;
    default: return false;
  }
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
  const std::string failed = comm_->failure();
  if (!failed.empty()) {
    throw PeerError(opPrefix(op) + "the communicator was aborted by an earlier error: " + failed);
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
  const bool ok = group_ && group_->status().state == kIpcOk;
  while (!inFlight_.empty()) {
    Flight& f = inFlight_.front();
    auto* e = static_cast<PooledEvent*>(f.done.get());
    if (wait) {
      runtime_->waitHost(e->event);
    } else if (!runtime_->done(e->event)) {
      break;
    }
    comm_->endExternal(f.record, ok);
    inFlight_.pop_front();
  }
}

template <typename Run>
TicketPtr DeviceComm::issue(OpSignature sig, uint64_t bytes, uint64_t sent, uint64_t received,
                            Streams s, Run run) {
  checkHealthy(sig.type);
  reap(/*wait=*/false);
  const bool captured = runtime_->capturing(s.caller);
  const IpcGroup::Launch how{captured ? s.caller : s.run, captured ? kIpcGraph : kIpcEager,
                             uint64_t(comm_->timeout().count()) * 1000000};
  const uint64_t record = comm_->beginExternal(sig, bytes);
  std::shared_ptr<void> done;
  try {
    if (!captured) runtime_->streamWaitStream(s.run, s.caller);
    run(how);
    if (!captured) done = std::make_shared<PooledEvent>(runtime_, runtime_->record(s.run));
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
  } else {
    inFlight_.push_back({done, record});
  }
  return std::make_shared<DeviceTicket>(runtime_, mapping, done, sig.type, comm_);
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
  return issue(sig, bytes, moved, moved, s, [&](const IpcGroup::Launch& how) {
    group_->allGather(in, out, bytes, how);
  });
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
  return issue(sig, bytes * n, moved, moved, s, [&](const IpcGroup::Launch& how) {
    group_->allToAll(in, out, bytes, how);
  });
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
