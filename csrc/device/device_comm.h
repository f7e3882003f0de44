// The device collectives of one communicator on one device: the object that
// owns every collective on device memory.
//
// It decides, for each call, whether the bytes go through CUDA IPC (and with
// which algorithm: one-shot, two-shot, or the op's only one) or are staged
// through host memory by the caller, from what every rank of the group
// shares: the settings (checked to match at rendezvous), the group's layout,
// the IPC group's verdict, the op and its byte count. Never from anything a
// rank sees alone (its tensor's strides, its pointer's alignment), so the
// ranks always route a call alike.
//
// An IPC call belongs to the communicator's contract like any other: it
// takes the next sequence number, is recorded in the flight record (queued
// and started at issue, finished when its stream gets past it), counted in
// comm_stats, refused once the communicator has failed or aborted, and
// stopped by abort(): the communicator's failure listener sets the IPC
// group's abort flag, which every spinning block polls, and marks this rank
// failed in its shared signals, so peers' blocks waiting for it stop too.
// A launch that gives up (a timeout, an abort) reports through the group's
// status; the next call or Work query turns it into an error and aborts the
// communicator, so every rank learns.
//
// The IPC group is set up at the first call that could use it (collective:
// every rank issues the same calls in the same order).
#pragma once

#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"
#include "device/ipc_group.h"
#include "device/runtime.h"

namespace clawcomm {
namespace device {

// A call's completion (device_comm.cc): its pooled event and its flight
// record, ended by whoever sees the event done first.
struct DeviceFlight;
// A receive through the rings that is placed but not launched yet, and the
// queue of them that a DeviceComm shares with its tickets (device_comm.cc).
struct PendingRecv;
struct RecvQueue;

// One IPC call in flight: what a Work waits on.
class DeviceTicket {
 public:
  // `flight`: null for a captured call, which runs when its graph is replayed.
  DeviceTicket(std::shared_ptr<DeviceRuntime> runtime, std::shared_ptr<IpcMapping> mapping,
               std::shared_ptr<DeviceFlight> flight, OpType type, std::weak_ptr<Communicator> comm,
               std::shared_ptr<PendingRecv> pending = nullptr, std::weak_ptr<RecvQueue> queue = {});

  // A receive through the rings is launched here, or by any of the calls
  // below, or when a later receive from the same peer is (see
  // DeviceComm::recv); anything else was launched when it was issued.
  void start();
  // Whether its stream got past it.
  bool done();
  // `s` waits for it; the host does not.
  void waitOn(Stream s);
  // The host waits for it.
  void waitHost();
  // The host waits for it, at most `timeout`: whether it is done.
  bool waitHostFor(std::chrono::milliseconds timeout);
  // Once a launch of the group gave up (this call's or another's): that
  // report as an error naming this call's op, and the communicator aborted,
  // so every rank learns. Else null.
  std::exception_ptr error() const;

 private:
  // The call's completion once launched (null: a captured call, or a
  // receive that was never launched).
  DeviceFlight* flight();

  std::shared_ptr<DeviceRuntime> runtime_;
  std::shared_ptr<IpcMapping> mapping_;
  std::shared_ptr<DeviceFlight> flight_;
  OpType type_;
  std::weak_ptr<Communicator> comm_;
  std::shared_ptr<PendingRecv> pending_;
  std::weak_ptr<RecvQueue> queue_;
};
using TicketPtr = std::shared_ptr<DeviceTicket>;

class DeviceComm {
 public:
  DeviceComm(std::shared_ptr<Communicator> comm, std::shared_ptr<DeviceRuntime> runtime);
  // Waits for this device's calls in flight (promptly after an abort: the
  // blocks stop spinning), then frees the IPC group's memory (what a
  // captured graph still points at lives until the graph is destroyed).
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  // Where a call waits and where it runs: `run` (the communicator's stream
  // for this device, the same one on every call) waits for `caller` first;
  // or `run` is `caller` itself (a synchronous call), which needs no wait.
  // Either way an eager collective also waits for the previous one when
  // that ran on another stream (one stream wait on its event): they share
  // the epoch counters and the IPC areas.
  // While `caller` is being captured into a CUDA graph (`captured`:
  // runtime().capturing(caller)) the call runs on `caller`, on the graph's
  // own flags and areas. `then`, if set, is enqueued on the stream the call ran on after
  // the collective and before its completion is recorded, so waiting for the call waits for it too
  // (the adapter's copy back into a non-contiguous tensor).
  // `keep`: held until the call is launched (a receive's buffer).
  struct Streams {
    Stream caller;
    Stream run;
    bool captured;
    std::function<void()> then;
    std::shared_ptr<void> keep;
  };
  // Whether a call of `op` moving `bytesPerRank` (all-reduce and broadcast:
  // the message; send and receive: theirs) from `s.caller` goes through
  // IPC; if not, the caller stages it through the communicator. Sends and
  // receives go through IPC only with CLAWCOMM_CUDA_P2P_BYTES set, when the
  // message fits a ring and the caller's stream is not being captured. A
  // collective too large for the graph channel while `s.caller` is being
  // captured is an InvalidArgument (staging cannot be captured). Sets the
  // IPC group up at the first call that could use it.
  bool ipc(OpType op, size_t bytesPerRank, const Streams& s);
  // The all-reduce algorithm for `bytes`: one-shot up to a threshold that
  // depends on the world size (CLAWCOMM_CUDA_ONESHOT_BYTES overrides it),
  // two-shot beyond.
  Algorithm allReduceAlgorithm(size_t bytes) const;

  // Only after ipc() said yes for the same op and size. Arguments are
  // checked (an error names the op and the value) before anything moves.
  TicketPtr allReduce(void* buf, size_t count, DataType type, ReduceOp op, Streams s);
  TicketPtr allGather(const void* in, void* out, size_t countPerRank, DataType type, Streams s);
  TicketPtr reduceScatter(const void* in, void* out, size_t countPerRank, DataType type,
                          ReduceOp op, Streams s);
  TicketPtr broadcast(void* buf, size_t count, DataType type, int root, Streams s);
  TicketPtr allToAll(const void* in, void* out, size_t countPerRank, DataType type, Streams s);
  // Point-to-point (ipc() said yes for kSend / kRecv and `bytes`): matched in
  // the order each pair issues them, with the same tag and size.
  //
  // A send is launched at once. A receive takes its place in the pair's
  // order at once but is launched only when its ticket is first asked
  // about (waited for, polled), or when a later receive from the same peer
  // is launched: its launch is a kernel that waits for the peer's message,
  // and launched early (a pipeline posts a receive before the compute whose
  // results the peer needs before it sends) it sits in the device's work
  // queues ahead of this rank's later kernels and copies, which the
  // hardware may hold behind it (streams share a few queues): a cycle
  // through both ranks that hung the trainer's 1f1b schedule on an H200.
  // Launched when it is needed, everything the peer could be waiting for
  // was issued before it.
  TicketPtr send(const void* buf, size_t bytes, int peer, uint64_t tag, Streams s);
  TicketPtr recv(void* buf, size_t bytes, int peer, uint64_t tag, Streams s);

  // Stops this rank's spinning blocks and tells peers' blocks (the
  // communicator's failure listener calls it); later calls are refused.
  void abort();
  // "ok", why calls are staged, or the failure that stopped the group;
  // "not set up" before the first call.
  std::string status() const;
  // Each rank's device index as the IPC group's setup exchanged it (empty
  // before setup).
  std::vector<int> devices() const;
  // The bytes of device memory this rank's IPC buffer takes (0 before setup
  // or when calls are staged); also counted in the communicator's
  // deviceBytes().
  int64_t deviceBytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return deviceBytes_;
  }
  DeviceRuntime& runtime() { return *runtime_; }

 private:
  // Throws if the communicator has failed or a launch gave up (then aborts
  // the communicator, so every rank learns).
  void checkHealthy(OpType op);
  // Marks finished the calls in flight whose stream got past them: all of
  // them when waiting, else once eight are pending (eager collectives share
  // one stream and finish in order, so one query of the newest usually
  // settles them all; sends and receives have streams of their own).
  // Not waiting, the caller holds recvs_->mutex.
  void reap(bool wait);
  // Launches a placed receive (RecvQueue::launch; under its lock).
  void launchRecv(PendingRecv& p);
  template <typename Issue>
  TicketPtr issue(OpSignature sig, uint64_t bytes, uint64_t sent, uint64_t received, Streams s,
                  Issue run, int peer = -1);
  void checkPeer(OpType op, int peer) const;

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<DeviceRuntime> runtime_;
  int listener_ = -1;
  mutable std::mutex mutex_;         // guards group_, aborted_, why_ (abort comes from any thread)
  std::shared_ptr<IpcGroup> group_;  // null until the first call that could use IPC
  bool aborted_ = false;
  std::string why_;          // why calls are staged, when they are
  int64_t deviceBytes_ = 0;  // this rank's IPC buffer, counted in comm_->deviceBytes()
  static constexpr size_t kReapEvery = 8;
  // Receives placed and not launched yet; its lock also guards inFlight_
  // (a receive may be launched from whichever thread waits for it).
  std::shared_ptr<RecvQueue> recvs_;
  std::deque<std::shared_ptr<DeviceFlight>> inFlight_;
  // The last eager collective: the next one, on whatever stream, waits for
  // it (they share the epoch counters and the IPC areas).
  std::shared_ptr<DeviceFlight> lastCollective_;
};

}  // namespace device
}  // namespace clawcomm
