#include "device/tickets.h"

#include <algorithm>
#include <thread>

#include "common/clock.h"
#include "common/errors.h"
#include "device/device_comm.h"

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

}  // namespace

IpcCall callOf(const OpSignature& sig) {
  IpcCall c{};
  c.w[0] = uint32_t(sig.count);
  c.w[1] = uint32_t(sig.count >> 32);
  c.w[2] = uint32_t(sig.seq);
  c.w[3] = uint32_t(sig.root);
  c.w[4] = uint32_t(sig.type) | uint32_t(sig.dtype) << 8 | uint32_t(sig.redop) << 16 |
           uint32_t(sig.algo) << 24;
  return c;
}

OpSignature signatureOf(const IpcCall& c) {
  OpSignature sig;
  sig.count = uint64_t(c.w[0]) | uint64_t(c.w[1]) << 32;
  sig.seq = c.w[2];
  sig.root = int32_t(c.w[3]);
  sig.type = OpType(c.w[4] & 0xff);
  sig.dtype = DataType((c.w[4] >> 8) & 0xff);
  sig.redop = ReduceOp((c.w[4] >> 16) & 0xff);
  sig.algo = Algorithm(c.w[4] >> 24);
  return sig;
}

std::exception_ptr failureOf(OpType op, const IpcStatus& s, int rank) {
  const std::string text = opPrefix(op) + describe(s, rank);
  if (s.state == kIpcMismatch || s.state == kIpcCallMismatch) {
    return std::make_exception_ptr(MismatchError(text));
  }
  return std::make_exception_ptr(PeerError(text));
}

// "rank 0's CUDA IPC kernel gave up after 5000 ms waiting for rank 1 (block 3,
// phase start, epoch 12, eager launch): ..."
std::string describe(const IpcStatus& s, int rank) {
  if (s.state == kIpcCallMismatch) {
    // As the CPU path words it (messenger.cc): "rank 1 called X, rank 0 called Y".
    return CLAWCOMM_CONCAT("rank ", s.waitedFor, " called ", signatureOf(s.theirs).describe(),
                           ", rank ", rank, " called ", signatureOf(s.ours).describe(),
                           " (through CUDA IPC: the ranks' kernels compared their calls)");
  }
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

void RecvQueue::startThrough(const std::shared_ptr<PendingRecv>& p) {
  if (p->started) return;
  auto& queue = byPeer[p->peer];
  while (!queue.empty()) {
    std::shared_ptr<PendingRecv> head = queue.front();
    queue.pop_front();
    head->started = true;
    if (launch) launch(*head);
    if (head == p) break;
  }
}

// ---------------------------------------------------------------------------
// DeviceTicket

DeviceTicket::DeviceTicket(std::shared_ptr<DeviceRuntime> runtime,
                           std::shared_ptr<IpcMapping> mapping,
                           std::shared_ptr<DeviceFlight> flight, OpType type,
                           std::weak_ptr<Communicator> comm, std::shared_ptr<PendingRecv> pending,
                           std::weak_ptr<RecvQueue> queue)
    : runtime_(std::move(runtime)),
      mapping_(std::move(mapping)),
      flight_(std::move(flight)),
      type_(type),
      comm_(std::move(comm)),
      pending_(std::move(pending)),
      queue_(std::move(queue)) {}

void DeviceTicket::start() {
  if (!pending_) return;
  if (auto queue = queue_.lock()) {
    std::lock_guard<std::mutex> lock(queue->mutex);
    queue->startThrough(pending_);
  }
}

DeviceFlight* DeviceTicket::flight() {
  if (!pending_) return flight_.get();
  start();
  // Written under the queue's lock before `started`, never after.
  return pending_->started ? pending_->flight.get() : nullptr;
}

bool DeviceTicket::done() {
  DeviceFlight* f = flight();
  return !f || f->done();
}

void DeviceTicket::waitOn(Stream s) {
  if (DeviceFlight* f = flight()) runtime_->streamWait(s, f->event);
}

void DeviceTicket::waitHost() {
  DeviceFlight* f = flight();
  if (!f) return;
  runtime_->waitHost(f->event);
  f->end();
}

bool DeviceTicket::waitHostFor(std::chrono::milliseconds timeout) {
  DeviceFlight* f = flight();
  if (!f) return true;
  // Polls the event (the runtime's host wait has no timeout): at first
  // often, as a short call ends in microseconds, then every millisecond.
  const Clock::time_point deadline = Clock::now() + timeout;
  std::chrono::microseconds nap(10);
  while (!f->done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
  return true;
}

std::exception_ptr DeviceTicket::error() const {
  if (pending_) {
    std::string notRun;
    if (auto queue = queue_.lock()) {
      std::lock_guard<std::mutex> lock(queue->mutex);
      notRun = pending_->notRun;
    } else {
      notRun = pending_->notRun;  // its DeviceComm is gone: nothing writes it any more
    }
    if (!notRun.empty()) return std::make_exception_ptr(PeerError(opPrefix(type_) + notRun));
  }
  const IpcStatus* live = mapping_->status();
  if (live->state == kIpcOk) return nullptr;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const int rank = mapping_->peers[kIpcEager].rank;
  if (auto comm = comm_.lock()) comm->abort(describe(*live, rank));  // so that every rank learns
  return failureOf(type_, *live, rank);
}

}  // namespace device
}  // namespace clawcomm
