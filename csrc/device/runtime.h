// The device runtime seam: every call the device collectives make to a
// device (allocation, IPC handles, copies, events, stream waits, graph
// capture, the kernel launch), behind one small interface with two
// implementations:
//   - CUDA (cuda/device_runtime.cc): cudaMalloc'd memory shared through
//     cudaIpc handles, host-mapped pinned words, streams and events, and the
//     kernels of cuda/ipc_kernels.cu;
//   - host (device/host_runtime.h): "device memory" is POSIX shared memory
//     between the rank processes, a stream runs each call at once on the
//     calling thread (or records it while a graph is captured), and a
//     "kernel" is the same algorithm body (device/ipc_algorithms.h) run by
//     one host thread per block over the same flags.
// So everything above this file (device/ipc_group.cc, device/device_comm.cc:
// setup, verdicts, routing, sequence numbers, abort, failure reports) is
// one code path, tested on the CPU in CI and run on the GPU as it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "device/protocol.h"

namespace clawcomm {
namespace device {

// A cudaStream_t, or a host runtime's stream (null: run at once).
using Stream = void*;

class DeviceRuntime {
 public:
  using Event = void*;

  virtual ~DeviceRuntime() = default;

  // "cuda" or "host": ranks of one group must use the same kind.
  virtual const char* kind() const = 0;
  // The device index this runtime drives (each call makes it current).
  virtual int device() const = 0;
  // The most blocks one launch may use (at most kIpcMaxBlocks).
  virtual int maxBlocks() const = 0;

  // Device memory another process can map. Failures (out of memory, IPC
  // unsupported) throw clawcomm::Error naming the call.
  virtual void* allocShared(size_t bytes) = 0;
  virtual void freeShared(void* p) noexcept = 0;
  virtual std::vector<uint8_t> exportHandle(void* p) = 0;
  virtual void* openHandle(const std::vector<uint8_t>& handle) = 0;
  virtual void closeHandle(void* p) noexcept = 0;
  // Once every peer has opened (or given up on) this rank's buffer: nothing
  // needs its name any more (the host runtime unlinks it).
  virtual void setupDone(void* p) noexcept { (void)p; }

  // Host memory the device reads and writes while kernels run (the abort
  // flag, the status): returns the host pointer, `*onDevice` the device's.
  virtual void* allocMapped(size_t bytes, void** onDevice) = 0;
  virtual void freeMapped(void* host) noexcept = 0;

  // Synchronous.
  virtual void fill(void* dst, int byte, size_t bytes) = 0;
  virtual void toHost(void* dst, const void* src, size_t bytes) = 0;
  virtual void toDevice(void* dst, const void* src, size_t bytes) = 0;
  // Stores `value` at `dst` (device memory) without waiting for the work in
  // flight, some of which may be spinning on it (abort).
  virtual void writeWordNow(uint32_t* dst, uint32_t value) = 0;

  // Asynchronous on `s`.
  virtual void copy(void* dst, const void* src, size_t bytes, Stream s) = 0;
  virtual void launch(const IpcLaunch& launch, Stream s) = 0;
  // buf /= divisor (AVG's last step), floating-point types.
  virtual void divide(DataType type, void* buf, size_t count, double divisor, Stream s) = 0;

  // Ordering and completion. Events come from a pool: release each one.
  virtual void streamWaitStream(Stream waiter, Stream producer) = 0;
  virtual Event record(Stream s) = 0;
  virtual bool done(Event e) = 0;
  virtual void streamWait(Stream s, Event e) = 0;
  virtual void waitHost(Event e) = 0;
  virtual void release(Event e) noexcept = 0;
  virtual void synchronize() = 0;  // the whole device

  // Whether `s` is being captured into a graph, and how the graph keeps
  // what its launches point at alive until the graph is destroyed.
  virtual bool capturing(Stream s) = 0;
  virtual void keepWithGraph(Stream s, std::shared_ptr<void> keep) = 0;
};

// The CUDA runtime for device `index` (cuda/device_runtime.cc); in a build
// without CUDA it throws, saying so.
std::unique_ptr<DeviceRuntime> makeCudaRuntime(int index);

}  // namespace device
}  // namespace clawcomm
