// The launcher of the device collectives' kernels (cuda/ipc_kernels.cu), for
// the CUDA runtime (cuda/device_runtime.cc). Internal to csrc/cuda/.
#pragma once

#include <cuda_runtime.h>

#include "device/protocol.h"

namespace clawcomm {
namespace cuda {

// Launches L.blocks blocks of the kernel for L's body, element type and
// operator on `stream`; a bad launch throws clawcomm::Error.
void launchIpc(const device::IpcLaunch& L, cudaStream_t stream);

}  // namespace cuda
}  // namespace clawcomm
