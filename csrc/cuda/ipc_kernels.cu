// The device collectives on the GPU: the bodies of device/ipc_algorithms.h
// (the same code the host runtime runs in the CPU tests), each run by a
// thread block through the executor below. The protocol (epoch flags, slot
// reuse, timeouts, abort, the failure report) is device/protocol.h's.
#include <cuda_runtime.h>

#include <cuda/atomic>

#include "cuda/check.h"
#include "cuda/ipc_kernels.h"
#include "device/ipc_algorithms.h"

namespace clawcomm {
namespace cuda {
namespace {

using device::Pack;

constexpr int kThreads = 512;

__device__ __forceinline__ uint4 asVector(Pack p) {
  return make_uint4(p.w[0], p.w[1], p.w[2], p.w[3]);
}
__device__ __forceinline__ Pack asPack(uint4 v) {
  Pack p;
  p.w[0] = v.x;
  p.w[1] = v.y;
  p.w[2] = v.z;
  p.w[3] = v.w;
  return p;
}

// A thread block as device/protocol.h's executor.
struct CudaBlock {
  uint32_t* words;  // two words in the block's shared memory

  __device__ int thread() const { return int(threadIdx.x); }
  __device__ int threads() const { return int(blockDim.x); }
  __device__ int block() const { return int(blockIdx.x); }
  __device__ void sync() const { __syncthreads(); }
  __device__ uint32_t* shared() const { return words; }
  __device__ uint64_t nowNs() const {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ void pause(uint32_t) const {}

  static __device__ void storeRelease(uint32_t* p, uint32_t v) {
    ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*p).store(
        v, ::cuda::memory_order_release);
  }
  static __device__ uint32_t loadAcquire(const uint32_t* p) {
    return ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*const_cast<uint32_t*>(p))
        .load(::cuda::memory_order_acquire);
  }
  static __device__ void fenceSystem() { __threadfence_system(); }
  static __device__ bool claim(uint32_t* p) { return atomicCAS_system(p, 0u, 1u) == 0u; }
  static __device__ Pack load(const Pack* p) { return asPack(*reinterpret_cast<const uint4*>(p)); }
  // Peers' memory bypasses L1 (__ldcg): another GPU, or another process's
  // kernel, wrote it.
  static __device__ Pack loadPeer(const Pack* p) {
    return asPack(__ldcg(reinterpret_cast<const uint4*>(p)));
  }
  static __device__ void store(Pack* p, Pack v) { *reinterpret_cast<uint4*>(p) = asVector(v); }
};

template <int K, typename E, typename Op>
__global__ void __launch_bounds__(kThreads) ipcKernel(device::IpcLaunch L) {
  __shared__ uint32_t words[2];
  device::runBody<K, E, Op>(CudaBlock{words}, L);
}

}  // namespace

void launchIpc(const device::IpcLaunch& L, cudaStream_t stream) {
  device::dispatchKernel(L, [&](auto body, auto element, auto op) {
    constexpr int K = decltype(body)::value;
    using E = typename decltype(element)::type;
    using Op = decltype(op);
    ipcKernel<K, E, Op><<<L.blocks, kThreads, 0, stream>>>(L);
  });
  CLAWCOMM_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace clawcomm
