// clawcomm._C: the engine, its kernels and their Python bindings, built
// without torch. The torch adapter (clawcomm._C_torch, csrc/torch/) is a
// separate extension that links against this one.
#include <pybind11/pybind11.h>

#include <memory>

#include "comm/communicator.h"
#include "common/settings.h"
#include "python/engine_bindings.h"
#include "python/gil.h"

namespace {

constexpr const char* kEngineHandle = "clawcomm.Engine";

}  // namespace

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "clawcomm's compiled core: the C++ engine, its kernels and codecs (no torch).";
  clawcomm::bindEngine(m);
  clawcomm::bindTestHooks(m);
  clawcomm::bindDevice(m);
#if defined(CLAWCOMM_WITH_CUDA)
  clawcomm::bindCuda(m);
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.def(
      "_engine_from_handle",
      [](py::capsule handle) {
        // The adapter hands over a heap-allocated shared_ptr; copy it, so the
        // capsule keeps its own reference until Python frees it. Python's
        // reference is dropped without the GIL (python/gil.h).
        auto* p = handle.get_pointer<std::shared_ptr<clawcomm::Communicator>>();
        if (std::string(handle.name()) != kEngineHandle || p == nullptr) {
          throw py::value_error("clawcomm._C._engine_from_handle: not an engine handle");
        }
        return clawcomm::heldWithoutGil(*p);
      },
      py::arg("handle"), "The Engine behind a handle from ClawcommBackend._engine_handle().");
  m.def(
      "_check_settings",
      [] { clawcomm::Communicator::checkSettings(clawcomm::Settings::fromEnv()); },
      "Reads every CLAWCOMM_* setting as a communicator would; raises ValueError naming the "
      "first bad one (a launcher checks them once, before it starts any rank).");
  m.def("_shutdown_all", &clawcomm::Communicator::shutdownAll,
        py::call_guard<py::gil_scoped_release>(),
        "Shuts down every live communicator (registered with atexit by clawcomm).");
}
