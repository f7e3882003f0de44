// The torch.distributed adapter's extension, clawcomm._C_torch: the
// backend class (backend.h, collectives.cc) and its Python bindings.
//
// csrc/torch/ is the only code that includes torch. It builds its own
// extension, linked against the torch-free engine in clawcomm._C.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "torch/backend.h"

PYBIND11_MODULE(_C_torch, m) {
  namespace py = pybind11;
  using clawcomm::adapter::ClawcommBackend;
  m.doc() = "clawcomm's torch.distributed adapter: the c10d backend over clawcomm._C's engine.";
  py::module::import("torch.distributed");
  using clawcomm::adapter::ClawcommOptions;
  py::class_<ClawcommOptions, c10d::Backend::Options, c10::intrusive_ptr<ClawcommOptions>>(
      m, "ClawcommOptions",
      "The clawcomm backend's options (torch's Backend.Options), which split_group may copy.")
      .def(py::init<std::chrono::milliseconds, int>(), py::arg("timeout"),
           py::arg("progress_nice") = -1)
      .def_readwrite("progress_nice", &ClawcommOptions::progressNice,
                     "The nice value of the group's progress thread (0-19); -1: "
                     "CLAWCOMM_PROGRESS_NICE's.")
      .def("__copy__",
           [](const ClawcommOptions& o) { return c10::make_intrusive<ClawcommOptions>(o); })
      .def(
          "__deepcopy__",
          [](const ClawcommOptions& o, py::dict) {
            return c10::make_intrusive<ClawcommOptions>(o);
          },
          py::arg("memo"));
  py::class_<ClawcommBackend, c10d::Backend, c10::intrusive_ptr<ClawcommBackend>>(m,
                                                                                  "ClawcommBackend")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds,
                    int>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("progress_nice") = -1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("options", &ClawcommBackend::getBackendOptions,
                             "The backend's options (torch's split_group copies them).")
      .def("_set_global_ranks", &ClawcommBackend::setGlobalRanks, py::arg("ranks"),
           "The job's rank of each rank of this group: errors and flight records name them.")
      .def(
          "transport_of",
          [](ClawcommBackend& b, int peer) { return b.communicator().transportOf(peer); },
          py::arg("peer"), "How this rank reaches `peer`: 'shm', 'tcp' or 'self'.")
      .def(
          "all_reduce_algorithm",
          [](ClawcommBackend& b, size_t bytes) {
            return b.communicator().allReduceAlgorithm(bytes);
          },
          py::arg("nbytes"),
          "The algorithm all_reduce of `nbytes` bytes uses ('oneshot', 'twoshot', 'ring', "
          "'tree', 'hierarchical'; 'deterministic' under CLAWCOMM_DETERMINISTIC=1).")
      .def("_start_time_estimate", &ClawcommBackend::startTimeEstimate,
           "torch's _time_estimator: the collectives issued until _end_time_estimate() move "
           "nothing; the cost model prices them.")
      .def("_end_time_estimate", &ClawcommBackend::endTimeEstimate,
           "The cost model's time for the collectives since _start_time_estimate(), in "
           "microseconds.")
      .def("cuda_ipc_status", &ClawcommBackend::cudaIpcStatus,
           "Per CUDA device index used so far: 'ok' where collectives go through CUDA IPC, "
           "else why they are staged through host memory.")
      .def(
          "_engine_handle",
          [](ClawcommBackend& b) {
            // A capsule, not a pybind11 type: the two extensions may be built
            // with different pybind11 copies, which need not share types.
            auto* p = new std::shared_ptr<clawcomm::Communicator>(b.sharedCommunicator());
            return py::capsule(p, "clawcomm.Engine", [](void* q) {
              // Maybe the last reference: dropped without the GIL.
              std::unique_ptr<std::shared_ptr<clawcomm::Communicator>> owned(
                  static_cast<std::shared_ptr<clawcomm::Communicator>*>(q));
              clawcomm::releaseWithoutGil(owned);
            });
          },
          "A handle for clawcomm._C._engine_from_handle (use clawcomm.engine_of()).");
}
