// The host implementation of the device runtime (device/runtime.h), so the
// device collectives' host logic and their kernels' protocol run on the CPU:
//   - "device memory" shared between ranks is a POSIX shared-memory segment
//     (its handle is its name; unlinked once every peer has opened it);
//   - a stream runs each call at once on the calling thread, while nothing
//     is queued on it. Calls queue instead (in order, and the host goes on,
//     as with a GPU) behind a wait for an event not done yet
//     (streamWait), and while the stream is held (hold(): a test makes a
//     stream slow, as a busy GPU's would be); whoever completes what they
//     wait for (another stream's call, the end of the hold) runs them. So
//     two streams are ordered only by the waits the code above makes, as on
//     a GPU, and a test can show a missing one. While a graph is being
//     captured on a stream, calls are recorded into the graph (with their
//     arguments frozen, as CUDA graphs freeze kernel parameters) and run by
//     HostGraph::replay();
//   - a launch runs the algorithm body of device/ipc_algorithms.h with one
//     host thread per block (at most kHostMaxBlocks), over the same flags.
// Faults can be injected at setup (HostFault) to test what the CUDA path
// does when allocation, IPC or the probe fail on one rank.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device/runtime.h"

namespace clawcomm {
namespace device {

constexpr int kHostMaxBlocks = 2;

enum class HostFault {
  kNone,
  kAlloc,  // allocShared fails, as cudaMalloc out of memory
  kOpen,   // openHandle fails, as cudaIpcOpenMemHandle in a container without IPC
  kProbe,  // peers' buffers open but stores do not reach them (a private copy)
};

// "none", "alloc", "open", "probe"; throws InvalidArgument naming the value.
HostFault hostFaultNamed(const std::string& name);

class HostGraph {
 public:
  void replay();

 private:
  friend class HostRuntime;
  std::vector<std::function<void()>> steps_;
  std::vector<std::shared_ptr<void>> keep_;
};

class HostRuntime final : public DeviceRuntime {
 public:
  HostRuntime(int device, HostFault fault);
  ~HostRuntime() override;

  const char* kind() const override { return "host"; }
  int device() const override { return device_; }
  int maxBlocks() const override { return kHostMaxBlocks; }

  void* allocShared(size_t bytes) override;
  void freeShared(void* p) noexcept override;
  std::vector<uint8_t> exportHandle(void* p) override;
  void* openHandle(const std::vector<uint8_t>& handle) override;
  void closeHandle(void* p) noexcept override;
  void setupDone(void* p) noexcept override;
  void* allocMapped(size_t bytes, void** onDevice) override;
  void freeMapped(void* host) noexcept override;

  void fill(void* dst, int byte, size_t bytes) override;
  void toHost(void* dst, const void* src, size_t bytes) override;
  void toDevice(void* dst, const void* src, size_t bytes) override;
  void writeWordNow(uint32_t* dst, uint32_t value) override;

  void copy(void* dst, const void* src, size_t bytes, Stream s) override;
  void launch(const IpcLaunch& launch, Stream s) override;
  void divide(DataType type, void* buf, size_t count, double divisor, Stream s) override;

  // Each stream's calls run in order; an event is done once its stream has
  // run every call issued on it before the event was recorded. As under
  // CUDA's global capture mode (torch's default), querying or waiting for
  // an event while any stream captures is an error.
  void streamWaitStream(Stream waiter, Stream producer) override;
  Event record(Stream s) override;
  bool done(Event e) override;
  void streamWait(Stream s, Event e) override;
  void waitHost(Event e) override;
  void release(Event e) noexcept override;
  void synchronize() override;

  // For `forMs` milliseconds calls on `s` (not null) queue instead of
  // running; then a thread of the runtime runs them, and whatever waited
  // for them.
  void hold(Stream s, int forMs);

  bool capturing(Stream s) override;
  void keepWithGraph(Stream s, std::shared_ptr<void> keep) override;

  // Calls on `s` (not null) are recorded until endCapture returns the graph.
  void beginCapture(Stream s);
  std::shared_ptr<HostGraph> endCapture(Stream s);

 private:
  struct Segment {
    std::string name;
    size_t bytes;
    bool owner;     // allocated here (else opened)
    bool unlinked;  // its name is gone
  };
  // A stream's queue, in order: calls, and waits (no call: until stream
  // `waitFor` has finished `upTo` steps).
  struct Step {
    std::function<void()> call;
    Stream waitFor = nullptr;
    uint64_t upTo = 0;
  };
  struct HostStream {
    std::deque<Step> queue;
    uint64_t issued = 0;    // steps ever issued on it, queued or run
    uint64_t finished = 0;  // of those, steps run (in order)
    bool running = false;   // a thread is running one of its steps
    int holds = 0;          // hold() calls not over yet
  };
  void run(Stream s, std::function<void()> step);
  // Under streamMutex_: whether stream `s` has finished `upTo` steps.
  bool finishedLocked(Stream s, uint64_t upTo);
  // Runs every step that can run now, on any stream, on this thread
  // (releases `lock` while a call runs).
  void drain(std::unique_lock<std::mutex>& lock);

  int device_;
  HostFault fault_;
  std::mutex mutex_;
  std::map<void*, Segment> segments_;  // guarded by mutex_
  void refuseWhileCapturing(const char* what);

  std::map<Stream, std::shared_ptr<HostGraph>> graphs_;  // being captured; guarded by mutex_

  std::mutex streamMutex_;  // guards streams_; streamsChanged_ wakes host waits
  std::condition_variable streamsChanged_;
  std::map<Stream, HostStream> streams_;  // null (run at once) is never here
  std::vector<std::thread> holders_;      // hold()'s timers, joined at destruction
};

}  // namespace device
}  // namespace clawcomm
