// CLAWCOMM_HD marks per-element functions that the CPU kernels and the CUDA
// kernels share (__host__ __device__ under nvcc): one definition of the
// arithmetic, so both give the same bits and the CPU test suite covers the
// math the GPU runs. On the host they are always inlined, so the SIMD loops
// that call them still vectorise.
#pragma once

#if defined(__CUDACC__)
#define CLAWCOMM_HD __host__ __device__ __forceinline__
#else
#define CLAWCOMM_HD inline __attribute__((always_inline))
#endif

// The device collectives' bodies over an executor (device/protocol.h,
// device/ipc_algorithms.h): device code under nvcc, where a call to a
// host-only function is a compile error (a host/device template with the exec
// check disabled compiled such calls to nothing: kernels that moved no data),
// and inline functions for the host runtime.
#if defined(__CUDACC__)
#define CLAWCOMM_DEVICE __device__ __forceinline__
#else
#define CLAWCOMM_DEVICE inline
#endif
