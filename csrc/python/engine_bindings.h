// Python bindings of the engine itself, without torch: a communicator's
// collectives over any buffer-protocol object (numpy arrays, memoryviews),
// and the element-wise kernels. This file and its .cc include pybind11
// only, never torch, so the engine stays usable (and quick to build) without
// it; the torch adapter hands its communicator over (ClawcommBackend.engine()).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "compress/quantize.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {

// Adds `Engine` and the `kernels` and `compress` submodules to `m`.
void bindEngine(pybind11::module_& m);
// The `kernels` submodule and the cost model's functions
// (python/kernel_bindings.cc).
void bindKernels(pybind11::module_& m);
void bindCostModel(pybind11::module_& m);
// The `compress` submodule (python/compress_bindings.cc).
void bindCompress(pybind11::module_& m);
// The `cuda` submodule (python/cuda_bindings.cc; CUDA builds only).
void bindCuda(pybind11::module_& m);
// `HostDeviceComm` and `HostGraph` (python/device_bindings.cc).
void bindDevice(pybind11::module_& m);
// The test hooks `_feed_frames` and `_drop_last_reference_in_callback`
// (python/test_hooks.cc).
void bindTestHooks(pybind11::module_& m);

// A SIMD level from its name ("portable", "avx2", "avx512"); None means the
// active one.
SimdLevel parseLevel(const pybind11::object& level);

// A block quantiser's spec from the bindings' arguments (scale "max", "l2" or
// "mean_abs"); throws InvalidArgument naming `op` on what does not fit.
QuantizeSpec quantizeSpec(int bits, size_t block, const std::string& scale, bool stochastic,
                          const char* op);

}  // namespace clawcomm
