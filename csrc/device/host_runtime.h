// The host implementation of the device runtime (device/runtime.h), so the
// device collectives' host logic and their kernels' protocol run on the CPU:
//   - "device memory" shared between ranks is a POSIX shared-memory segment
//     (its handle is its name; unlinked once every peer has opened it);
//   - a stream runs each call at once on the calling thread, except while a
//     graph is being captured on it: then calls are recorded into the graph
//     (with their arguments frozen, as CUDA graphs freeze kernel parameters)
//     and run by HostGraph::replay();
//   - a launch runs the algorithm body of device/ipc_algorithms.h with one
//     host thread per block (at most kHostMaxBlocks), over the same flags.
// Faults can be injected at setup (HostFault) to test what the CUDA path
// does when allocation, IPC or the probe fail on one rank.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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

  // Host streams run in call order on the caller's thread: every event is
  // complete when recorded.
  void streamWaitStream(Stream, Stream) override {}
  Event record(Stream) override { return this; }
  // As under CUDA's global capture mode (torch's default), querying or
  // waiting for an event while any stream captures is an error.
  bool done(Event) override {
    refuseWhileCapturing("an event query");
    return true;
  }
  void streamWait(Stream, Event) override {}
  void waitHost(Event) override { refuseWhileCapturing("an event wait"); }
  void release(Event) noexcept override {}
  void synchronize() override {}

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
  void run(Stream s, std::function<void()> step);

  int device_;
  HostFault fault_;
  std::mutex mutex_;
  std::map<void*, Segment> segments_;  // guarded by mutex_
  void refuseWhileCapturing(const char* what);

  std::map<Stream, std::shared_ptr<HostGraph>> graphs_;  // being captured; guarded by mutex_
};

}  // namespace device
}  // namespace clawcomm
