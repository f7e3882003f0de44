// The CUDA API (cuda/kernels.h, device/runtime.h's makeCudaRuntime) in a
// build without CUDA: the torch adapter links against these names either
// way, asks built() first, and never reaches the others; a direct call says
// why it cannot run.
#if !defined(CLAWCOMM_WITH_CUDA)

#include "common/errors.h"
#include "cuda/kernels.h"
#include "device/runtime.h"

namespace clawcomm {
namespace cuda {

bool built() {
  return false;
}

namespace {

[[noreturn]] void unavailable() {
  throw Error(
      "clawcomm was built without CUDA (rebuild with nvcc and a CUDA build of torch, or "
      "CLAWCOMM_CUDA=1)");
}

}  // namespace

void divideInPlace(DataType, void*, size_t, double, Stream) {
  unavailable();
}

}  // namespace cuda

namespace device {

std::unique_ptr<DeviceRuntime> makeCudaRuntime(int) {
  cuda::divideInPlace(DataType::kFloat32, nullptr, 0, 1.0, nullptr);  // throws: no CUDA here
  return nullptr;
}

}  // namespace device
}  // namespace clawcomm

#endif
