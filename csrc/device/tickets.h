// What a device call leaves behind for whoever waits for it
// (device/device_comm.h's DeviceTicket): its completion (DeviceFlight), and
// for a receive through the rings, its place until it is launched
// (PendingRecv, RecvQueue); and the text of a launch that gave up.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"
#include "device/ipc_group.h"
#include "device/p2p_ring.h"
#include "device/runtime.h"

namespace clawcomm {
namespace device {

// A launch's report as an error's text, from rank `rank`'s view.
std::string describe(const IpcStatus& s, int rank);
// The report as the error `op` raises (its text prefixed with the op's):
// MismatchError where the ranks disagreed (a call, a message's tag or
// size), as on the CPU path; else PeerError.
std::exception_ptr failureOf(OpType op, const IpcStatus& s, int rank);

// A collective's signature as its kernels compare it (device/protocol.h),
// and back, to name both sides in an error.
IpcCall callOf(const OpSignature& sig);
OpSignature signatureOf(const IpcCall& call);

// A launched call's completion: its pooled event and its flight record,
// ended by whoever sees the event done first.
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

// A receive through the rings, placed in its pair's order when it was
// issued; launched by RecvQueue::startThrough.
struct PendingRecv {
  int peer = -1;
  P2pRing::Slot slot{};
  void* out = nullptr;
  size_t bytes = 0;
  uint64_t tag = 0;
  Stream run = nullptr;
  DeviceRuntime::Event callerDone = nullptr;  // the caller's stream when it was issued
  uint64_t record = 0;
  std::function<void()> then;
  std::shared_ptr<void> keep;
  // Under the queue's lock: launched (or given up on), its completion, and
  // why it was never launched.
  bool started = false;
  std::shared_ptr<DeviceFlight> flight;
  std::string notRun;
};

// Each peer's placed receives not launched yet, oldest first: shared by a
// DeviceComm (which launches them) and the receives' tickets.
struct RecvQueue {
  std::mutex mutex;
  std::function<void(PendingRecv&)> launch;  // null once its DeviceComm is gone
  std::map<int, std::deque<std::shared_ptr<PendingRecv>>> byPeer;

  // Launches `p`, and first every receive from its peer placed before it
  // (each pair's rings are read in order). Under `mutex`.
  void startThrough(const std::shared_ptr<PendingRecv>& p);
};

}  // namespace device
}  // namespace clawcomm
