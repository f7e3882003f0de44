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

// Before a CLAWCOMM_HD template whose executor argument may be device-only
// (device/protocol.h): nvcc would otherwise warn that the template's host
// instantiation calls __device__ functions, though only device code uses it.
#if defined(__CUDACC__)
#define CLAWCOMM_HD_TEMPLATE _Pragma("nv_exec_check_disable")
#else
#define CLAWCOMM_HD_TEMPLATE
#endif
