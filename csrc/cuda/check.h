// Error checks for CUDA runtime calls and kernel launches (host side).
#pragma once

#include <cuda_runtime.h>

#include "common/errors.h"

#define CLAWCOMM_CUDA_CHECK(expr)                                                                 \
  do {                                                                                            \
    const cudaError_t clawcommErr_ = (expr);                                                      \
    if (clawcommErr_ != cudaSuccess) {                                                            \
      throw ::clawcomm::Error(CLAWCOMM_CONCAT("clawcomm: CUDA error in ", #expr, ": ",            \
                                              cudaGetErrorString(clawcommErr_), " at ", __FILE__, \
                                              ":", __LINE__));                                    \
    }                                                                                             \
  } while (0)

// After a <<<>>> launch: a bad configuration shows up here, not later.
#define CLAWCOMM_CUDA_LAUNCHED() CLAWCOMM_CUDA_CHECK(cudaGetLastError())

namespace clawcomm {
namespace cuda {

inline cudaStream_t asStream(void* s) {
  return static_cast<cudaStream_t>(s);
}

// Blocks for a grid-stride kernel over `work` items: enough to fill the
// device (a few blocks per SM), never more than the work needs.
int gridFor(size_t work, int threads);

}  // namespace cuda
}  // namespace clawcomm
