// The CUDA implementation of the device runtime seam (device/runtime.h):
// cudaMalloc'd buffers shared through cudaIpc handles, pinned host-mapped
// words, pooled events, graph user objects, and the kernels of
// cuda/ipc_kernels.cu. Every call makes the runtime's device current for its
// duration and restores the caller's.
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "cuda/check.h"
#include "cuda/ipc_kernels.h"
#include "cuda/kernels.h"
#include "device/runtime.h"

namespace clawcomm {
namespace cuda {
namespace {

using device::DeviceRuntime;
using device::Stream;

class OnDevice {
 public:
  explicit OnDevice(int device) {
    CLAWCOMM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) CLAWCOMM_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~OnDevice() {
    if (changed_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// A failure the setup reports (and every rank learns), not a bug: the
// runtime's own words, with the call that failed.
[[noreturn]] void failed(const char* what, cudaError_t e) {
  cudaGetLastError();  // clear it, so the next call does not report it again
  throw Error(CLAWCOMM_CONCAT(what, " failed: ", cudaGetErrorString(e)));
}

class CudaRuntime final : public DeviceRuntime {
 public:
  explicit CudaRuntime(int device) : device_(device) {
    int count = 0;
    CLAWCOMM_CUDA_CHECK(cudaGetDeviceCount(&count));
    CLAWCOMM_ARG_CHECK(device >= 0 && device < count, "clawcomm: CUDA device ", device,
                       " does not exist (this machine has ", count, ")");
  }

  ~CudaRuntime() override {
    OnDevice on(device_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (abortStream_) cudaStreamDestroy(abortStream_);
    if (word_) cudaFreeHost(word_);
  }

  const char* kind() const override { return "cuda"; }
  int device() const override { return device_; }
  int maxBlocks() const override { return device::kIpcMaxBlocks; }

  void* allocShared(size_t bytes) override {
    OnDevice on(device_);
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, bytes)) {
      failed(CLAWCOMM_CONCAT("cudaMalloc of ", bytes >> 20, " MiB on cuda:", device_).c_str(), e);
    }
    return p;
  }
  void freeShared(void* p) noexcept override {
    OnDevice on(device_);
    cudaFree(p);
  }
  std::vector<uint8_t> exportHandle(void* p) override {
    OnDevice on(device_);
    cudaIpcMemHandle_t h;
    if (cudaError_t e = cudaIpcGetMemHandle(&h, p)) failed("cudaIpcGetMemHandle", e);
    const auto* b = reinterpret_cast<const uint8_t*>(&h);
    return std::vector<uint8_t>(b, b + sizeof(h));
  }
  void* openHandle(const std::vector<uint8_t>& handle) override {
    CLAWCOMM_ARG_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t),
                       "clawcomm: a CUDA IPC handle of ", handle.size(), " bytes, not ",
                       sizeof(cudaIpcMemHandle_t));
    OnDevice on(device_);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess)) {
      failed("cudaIpcOpenMemHandle", e);
    }
    return p;
  }
  void closeHandle(void* p) noexcept override {
    OnDevice on(device_);
    cudaIpcCloseMemHandle(p);
  }

  void* allocMapped(size_t bytes, void** onDevice) override {
    OnDevice on(device_);
    void* host = nullptr;
    if (cudaError_t e = cudaHostAlloc(&host, bytes, cudaHostAllocMapped)) {
      failed("cudaHostAlloc (mapped)", e);
    }
    std::memset(host, 0, bytes);
    CLAWCOMM_CUDA_CHECK(cudaHostGetDevicePointer(onDevice, host, 0));
    return host;
  }
  void freeMapped(void* host) noexcept override { cudaFreeHost(host); }

  void fill(void* dst, int byte, size_t bytes) override {
    OnDevice on(device_);
    CLAWCOMM_CUDA_CHECK(cudaMemset(dst, byte, bytes));
    CLAWCOMM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void toHost(void* dst, const void* src, size_t bytes) override {
    OnDevice on(device_);
    CLAWCOMM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  void toDevice(void* dst, const void* src, size_t bytes) override {
    OnDevice on(device_);
    CLAWCOMM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  // On a stream of its own that waits for nothing, from pinned memory, and
  // without waiting: the copy engine writes the word while the kernels that
  // poll it still spin.
  void writeWordNow(uint32_t* dst, uint32_t value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    OnDevice on(device_);
    if (!abortStream_) {
      CLAWCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&abortStream_, cudaStreamNonBlocking));
      CLAWCOMM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&word_), 64, 0));
    }
    *word_ = value;
    CLAWCOMM_CUDA_CHECK(
        cudaMemcpyAsync(dst, word_, sizeof(uint32_t), cudaMemcpyHostToDevice, abortStream_));
  }

  void copy(void* dst, const void* src, size_t bytes, Stream s) override {
    OnDevice on(device_);
    CLAWCOMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, asStream(s)));
  }
  void launch(const device::IpcLaunch& L, Stream s) override {
    OnDevice on(device_);
    launchIpc(L, asStream(s));
  }
  void divide(DataType type, void* buf, size_t count, double divisor, Stream s) override {
    OnDevice on(device_);
    divideInPlace(type, buf, count, divisor, s);
  }

  void streamWaitStream(Stream waiter, Stream producer) override {
    if (waiter == producer) return;
    OnDevice on(device_);
    Event e = record(producer);
    const cudaError_t err = cudaStreamWaitEvent(asStream(waiter), static_cast<cudaEvent_t>(e), 0);
    release(e);  // the wait took the event's state when it was called
    CLAWCOMM_CUDA_CHECK(err);
  }
  Event record(Stream s) override {
    OnDevice on(device_);
    cudaEvent_t e = take();
    CLAWCOMM_CUDA_CHECK(cudaEventRecord(e, asStream(s)));
    return e;
  }
  bool done(Event e) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    CLAWCOMM_CUDA_CHECK(err);
    return true;
  }
  void streamWait(Stream s, Event e) override {
    OnDevice on(device_);
    CLAWCOMM_CUDA_CHECK(cudaStreamWaitEvent(asStream(s), static_cast<cudaEvent_t>(e), 0));
  }
  void waitHost(Event e) override {
    CLAWCOMM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e)));
  }
  void release(Event e) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(static_cast<cudaEvent_t>(e));
  }
  void synchronize() override {
    OnDevice on(device_);
    CLAWCOMM_CUDA_CHECK(cudaDeviceSynchronize());
  }

  bool capturing(Stream s) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(asStream(s), &status) != cudaSuccess) {
      cudaGetLastError();  // the legacy stream while another captures: not capturing itself
      return false;
    }
    return status == cudaStreamCaptureStatusActive;
  }

  // A user object owned by the graph holds `keep`; CUDA calls its destructor
  // (where no CUDA call is allowed) when the graph is destroyed, so the last
  // reference, which frees device memory, is dropped on a thread of its own.
  void keepWithGraph(Stream s, std::shared_ptr<void> keep) override {
    cudaStreamCaptureStatus status;
    unsigned long long id = 0;
    cudaGraph_t graph = nullptr;
    CLAWCOMM_CUDA_CHECK(cudaStreamGetCaptureInfo(asStream(s), &status, &id, &graph));
    auto* held = new std::shared_ptr<void>(std::move(keep));
    cudaUserObject_t object;
    const cudaError_t err = cudaUserObjectCreate(
        &object, held,
        [](void* p) {
          auto* h = static_cast<std::shared_ptr<void>*>(p);
          std::thread([h] { delete h; }).detach();
        },
        1, cudaUserObjectNoDestructorSync);
    if (err != cudaSuccess) {
      delete held;
      CLAWCOMM_CUDA_CHECK(err);
    }
    CLAWCOMM_CUDA_CHECK(cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove));
  }

 private:
  cudaEvent_t take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!events_.empty()) {
      cudaEvent_t e = events_.back();
      events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    CLAWCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> events_;  // the pool; guarded by mutex_
  cudaStream_t abortStream_ = nullptr;
  uint32_t* word_ = nullptr;  // pinned source of writeWordNow
};

}  // namespace

bool built() {
  return true;
}

}  // namespace cuda

namespace device {

std::unique_ptr<DeviceRuntime> makeCudaRuntime(int index) {
  return std::make_unique<cuda::CudaRuntime>(index);
}

}  // namespace device
}  // namespace clawcomm
