// The CUDA API (cuda/kernels.h, cuda/ipc.h) in a build without CUDA: the
// torch adapter links against these names either way, asks built() first,
// and never reaches the others; a direct call says why it cannot run.
#if !defined(CLAWCOMM_WITH_CUDA)

#include "common/errors.h"
#include "cuda/ipc.h"

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

std::unique_ptr<IpcGroup> IpcGroup::create(Store&, const std::string&, int, int, size_t, int64_t) {
  unavailable();
}

void divideInPlace(DataType, void*, size_t, double, Stream) {
  unavailable();
}

}  // namespace cuda
}  // namespace clawcomm

#endif
