// `clawcomm._C.HostDeviceComm`: the device collectives (device/device_comm.h)
// over the host runtime (device/host_runtime.h), on numpy buffers, so the CPU
// suite drives the code the CUDA path runs: setup and verdicts, routing,
// the kernels' protocol, abort, failure reports and graph capture. Calls
// that DeviceComm routes away from IPC are staged through the engine, as the
// torch adapter stages CUDA tensors. Each rank may claim any device index.
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/errors.h"
#include "device/device_comm.h"
#include "device/host_runtime.h"
#include "python/buffers.h"
#include "python/engine_bindings.h"
#include "python/gil.h"

namespace py = pybind11;

namespace clawcomm {
namespace {

using device::DeviceComm;
using device::HostRuntime;

// A receive that returns before its message arrives (HostDeviceComm.irecv):
// the bytes land in a buffer of its own, copied into the caller's at wait(),
// so a handle dropped unwaited leaves nothing pointing at freed memory.
class HostReceive {
 public:
  HostReceive(py::buffer target, void* data, size_t bytes)
      : target_(std::move(target)),
        data_(data),
        scratch_(std::make_shared<std::vector<char>>(bytes)) {}

  // Waits for the message, copies it into the buffer; the route it took.
  std::string wait() {
    {
      py::gil_scoped_release release;
      if (ticket_) {
        ticket_->waitHost();
        if (auto e = ticket_->error()) std::rethrow_exception(e);
      } else {
        request_->waitFor(std::chrono::milliseconds(-1));
        if (auto e = request_->exception()) std::rethrow_exception(e);
      }
      if (!scratch_->empty()) std::memcpy(data_, scratch_->data(), scratch_->size());
    }
    return route_;
  }

  py::buffer target_;
  void* data_;
  std::shared_ptr<std::vector<char>> scratch_;
  device::TicketPtr ticket_;
  RequestPtr request_;
  std::string route_;
};

// A call issued with async_op set (HostDeviceComm's collectives): waited
// for by wait(), as torch's Work is. Keeps the caller's buffers until then.
class HostWork {
 public:
  ~HostWork() {
    // Dropped unwaited: its launches may still read the buffers it holds.
    py::gil_scoped_release release;
    try {
      if (ticket_) ticket_->waitHost();
      if (request_) request_->waitFor(std::chrono::milliseconds(-1));
    } catch (...) {  // a destructor reports nothing
    }
  }

  // Waits (at most `timeout` seconds, if given) and returns the route the
  // call took; raises its error, or TimeoutError as the torch adapter's
  // Work::wait words it.
  std::string wait(std::optional<double> timeout) {
    py::gil_scoped_release release;
    const auto limit = std::chrono::milliseconds(timeout ? int64_t(*timeout * 1000) : -1);
    bool done;
    if (ticket_) {
      ticket_->start();
      done = timeout ? ticket_->waitHostFor(limit) : (ticket_->waitHost(), true);
      if (auto e = ticket_->error()) std::rethrow_exception(e);
    } else {
      done = request_->waitFor(limit);
      if (done) {
        if (auto e = request_->exception()) std::rethrow_exception(e);
      }
    }
    if (!done) {
      throw TimeoutError(CLAWCOMM_CONCAT("clawcomm: Work::wait timed out after ", limit.count(),
                                         " ms; the operation is still running"));
    }
    return route_;
  }
  bool isCompleted() {
    py::gil_scoped_release release;
    return ticket_ ? ticket_->done() : request_->isCompleted();
  }

  std::string route_;
  device::TicketPtr ticket_;
  RequestPtr request_;
  std::vector<py::object> keep_;
};

class HostDeviceComm {
 public:
  HostDeviceComm(std::shared_ptr<Communicator> comm, int device, const std::string& fault)
      : comm_(std::move(comm)),
        runtime_(std::make_shared<HostRuntime>(device, device::hostFaultNamed(fault))),
        dev_(std::make_unique<DeviceComm>(comm_, runtime_)) {}
  // Python may drop the last reference while holding the GIL: the device
  // calls in flight and the communicator go without it (python/gil.h).
  ~HostDeviceComm() {
    releaseWithoutGil(dev_);
    releaseWithoutGil(comm_);
  }

  // "one-shot", "two-shot", "ipc" or "staged": how a call of `op` moving
  // `bytes` per rank goes (sets the IPC group up at the first call).
  std::string route(const std::string& op, size_t bytes) {
    const OpType type = opNamed(op);
    if (!live().ipc(type, bytes, streams())) return "staged";
    if (type != OpType::kAllReduce) return "ipc";
    return live().allReduceAlgorithm(bytes) == Algorithm::kIpcOneShot ? "one-shot" : "two-shot";
  }

  py::object allReduce(const py::buffer& b, const std::string& opName, const py::object& dtype,
                       std::optional<bool> async) {
    Buffer buf = takeBuffer("all_reduce", "buf", b, true, dtype);
    const ReduceOp op = parseReduceOp("all_reduce", opName);
    return collective(
        async, {b}, OpType::kAllReduce, buf.count * elementSize(buf.dtype),
        [&](DeviceComm::Streams s) {
          return live().allReduce(buf.data, buf.count, buf.dtype, op, s);
        },
        [&] { return comm_->allReduce(buf.data, buf.count, buf.dtype, op); });
  }
  py::object allGather(const py::buffer& i, const py::buffer& o, const py::object& dtype,
                       std::optional<bool> async) {
    Buffer in = takeBuffer("all_gather", "input", i, false, dtype);
    Buffer out = takeBuffer("all_gather", "output", o, true, dtype);
    checkSameType("all_gather", in, out);
    checkCount("all_gather", out.count, in.count * size_t(comm_->size()));
    return collective(
        async, {i, o}, OpType::kAllGather, in.count * elementSize(in.dtype),
        [&](DeviceComm::Streams s) {
          return live().allGather(in.data, out.data, in.count, in.dtype, s);
        },
        [&] {
          return comm_->allGather(in.data, out.data,
                                  std::vector<size_t>(size_t(comm_->size()), in.count), in.dtype);
        });
  }
  py::object reduceScatter(const py::buffer& i, const py::buffer& o, const std::string& opName,
                           const py::object& dtype, std::optional<bool> async) {
    Buffer in = takeBuffer("reduce_scatter", "input", i, false, dtype);
    Buffer out = takeBuffer("reduce_scatter", "output", o, true, dtype);
    checkSameType("reduce_scatter", in, out);
    checkCount("reduce_scatter", in.count, out.count * size_t(comm_->size()));
    const ReduceOp op = parseReduceOp("reduce_scatter", opName);
    return collective(
        async, {i, o}, OpType::kReduceScatter, out.count * elementSize(out.dtype),
        [&](DeviceComm::Streams s) {
          return live().reduceScatter(in.data, out.data, out.count, out.dtype, op, s);
        },
        [&] {
          return comm_->reduceScatter(in.data, out.data,
                                      std::vector<size_t>(size_t(comm_->size()), out.count),
                                      out.dtype, op);
        });
  }
  py::object broadcast(const py::buffer& b, int root, const py::object& dtype,
                       std::optional<bool> async) {
    Buffer buf = takeBuffer("broadcast", "buf", b, true, dtype);
    return collective(
        async, {b}, OpType::kBroadcast, buf.count * elementSize(buf.dtype),
        [&](DeviceComm::Streams s) {
          return live().broadcast(buf.data, buf.count, buf.dtype, root, s);
        },
        [&] { return comm_->broadcast(buf.data, buf.count, buf.dtype, root); });
  }
  py::object allToAll(const py::buffer& i, const py::buffer& o, const py::object& dtype,
                      std::optional<bool> async) {
    Buffer in = takeBuffer("all_to_all", "input", i, false, dtype);
    Buffer out = takeBuffer("all_to_all", "output", o, true, dtype);
    checkSameType("all_to_all", in, out);
    checkCount("all_to_all", out.count, in.count);
    const size_t n = size_t(comm_->size());
    CLAWCOMM_ARG_CHECK(in.count % n == 0, "clawcomm::all_to_all: ", in.count,
                       " elements do not split evenly among ", n, " ranks");
    const size_t per = in.count / n;
    return collective(
        async, {i, o}, OpType::kAllToAll, per * elementSize(in.dtype),
        [&](DeviceComm::Streams s) { return live().allToAll(in.data, out.data, per, in.dtype, s); },
        [&] {
          const std::vector<size_t> counts(n, per);
          return comm_->allToAll(in.data, counts, out.data, counts, in.dtype);
        });
  }

  // Point-to-point: through the IPC rings with CLAWCOMM_CUDA_P2P_BYTES set,
  // else staged through the engine (matched by tag).
  std::string send(const py::buffer& b, int peer, uint64_t tag, const py::object& dtype) {
    Buffer buf = takeBuffer("send", "buf", b, false, dtype);
    const size_t bytes = buf.count * elementSize(buf.dtype);
    return call(
        OpType::kSend, bytes,
        [&](DeviceComm::Streams s) { return live().send(buf.data, bytes, peer, tag, s); },
        [&] { return comm_->send(buf.data, bytes, peer, tag); });
  }
  std::string recv(const py::buffer& b, int peer, uint64_t tag, const py::object& dtype) {
    Buffer buf = takeBuffer("recv", "buf", b, true, dtype);
    const size_t bytes = buf.count * elementSize(buf.dtype);
    return call(
        OpType::kRecv, bytes,
        [&](DeviceComm::Streams s) { return live().recv(buf.data, bytes, peer, tag, s); },
        [&] { return comm_->recv(buf.data, bytes, peer, tag); });
  }

  // Returns at once; the message arrives by the handle's wait(). Through the
  // rings the receive takes its place in the pair's order now and is
  // launched when waited for (DeviceComm::recv).
  std::unique_ptr<HostReceive> irecv(const py::buffer& b, int peer, uint64_t tag,
                                     const py::object& dtype) {
    Buffer buf = takeBuffer("recv", "buf", b, true, dtype);
    const size_t bytes = buf.count * elementSize(buf.dtype);
    auto handle = std::make_unique<HostReceive>(b, buf.data, bytes);
    py::gil_scoped_release release;
    if (live().ipc(OpType::kRecv, bytes, streams())) {
      DeviceComm::Streams s = streams();
      s.keep = handle->scratch_;
      handle->ticket_ = live().recv(handle->scratch_->data(), bytes, peer, tag, s);
      handle->route_ = "ipc";
    } else {
      CLAWCOMM_ARG_CHECK(!capturing_,
                         "clawcomm::recv: a staged call cannot be captured into a graph");
      handle->request_ = comm_->recv(handle->scratch_->data(), bytes, peer, tag);
      handle->route_ = "staged";
    }
    return handle;
  }

  std::string status() { return dev_ ? dev_->status() : "closed"; }
  std::vector<int> devices() { return live().devices(); }
  void abort() { live().abort(); }

  // Until endCapture, IPC calls are recorded into a graph (on their own
  // flags), not run; staged calls cannot be captured.
  void beginCapture() {
    runtime_->beginCapture(captureStream());
    capturing_ = true;
  }
  std::shared_ptr<device::HostGraph> endCapture() {
    capturing_ = false;
    return runtime_->endCapture(captureStream());
  }

  // Waits for the calls in flight and frees the IPC group (a captured graph
  // keeps what it points at).
  void close() {
    py::gil_scoped_release release;
    dev_.reset();
  }

 private:
  DeviceComm& live() {
    CLAWCOMM_ARG_CHECK(dev_ != nullptr, "clawcomm: this HostDeviceComm is closed");
    return *dev_;
  }
  device::Stream captureStream() { return this; }
  // The host runtime's streams: the communicator's, and the caller's 1 to 4
  // (0, the default, is the null stream, which runs every call at once).
  device::Stream commStream() { return &streamIds_[0]; }
  device::Stream streamNamed(const std::string& name) {
    if (name == "comm") return commStream();
    CLAWCOMM_ARG_CHECK(name == "caller" && caller_ != nullptr, "clawcomm: stream '", name,
                       "' is not 'comm', nor 'caller' with a caller's stream other than 0");
    return caller_;
  }
  // Captured calls are recorded. Eager ones run on the caller's stream, or
  // (`async`) on the communicator's after the caller's.
  DeviceComm::Streams streams(bool async = false) {
    if (capturing_) return {captureStream(), captureStream(), true};
    return {caller_, async ? commStream() : caller_, false};
  }

  static OpType opNamed(const std::string& name) {
    for (OpType t : {OpType::kAllReduce, OpType::kAllGather, OpType::kReduceScatter,
                     OpType::kBroadcast, OpType::kAllToAll, OpType::kSend, OpType::kRecv}) {
      if (name == opTypeName(t)) return t;
    }
    throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: '", name,
                                          "' is not a device operation (all_reduce, "
                                          "all_gather, reduce_scatter, broadcast, all_to_all, "
                                          "send, recv)"));
  }
  static void checkCount(const char* op, size_t got, size_t want) {
    CLAWCOMM_ARG_CHECK(got == want, "clawcomm::", op, ": ", got, " elements where ", want,
                       " were expected");
  }

  // With `async` unset, call(); else issues the call as the torch adapter
  // does, on the caller's stream (false: its wait() then orders nothing
  // more on the host runtime) or on the communicator's (true), and returns
  // a HostWork holding `keep` (the caller's buffers) until it is waited for.
  template <typename Ipc, typename Staged>
  py::object collective(std::optional<bool> async, std::vector<py::object> keep, OpType type,
                        size_t bytesPerRank, Ipc ipc, Staged staged) {
    if (!async) return py::cast(call(type, bytesPerRank, ipc, staged));
    device::TicketPtr ticket;
    RequestPtr request;
    {
      py::gil_scoped_release release;
      const DeviceComm::Streams s = streams(*async);
      if (live().ipc(type, bytesPerRank, s)) {
        ticket = ipc(s);
      } else {
        CLAWCOMM_ARG_CHECK(!capturing_, "clawcomm::", opTypeName(type),
                           ": a staged call cannot be captured into a graph");
        request = staged();
      }
    }
    auto work = std::make_unique<HostWork>();
    work->route_ = ticket ? "ipc" : "staged";
    work->ticket_ = std::move(ticket);
    work->request_ = std::move(request);
    work->keep_ = std::move(keep);
    return py::cast(std::move(work));
  }

  // Runs the call through IPC or the engine, without the GIL; returns the
  // route it took.
  template <typename Ipc, typename Staged>
  std::string call(OpType type, size_t bytesPerRank, Ipc ipc, Staged staged) {
    std::string route;
    RequestPtr request;
    {
      py::gil_scoped_release release;
      if (live().ipc(type, bytesPerRank, streams())) {
        const device::TicketPtr ticket = ipc(streams());
        ticket->waitHost();
        if (auto e = ticket->error()) std::rethrow_exception(e);
        route = "ipc";
      } else {
        CLAWCOMM_ARG_CHECK(!capturing_, "clawcomm::", opTypeName(type),
                           ": a staged call cannot be captured into a graph");
        request = staged();
        request->waitFor(std::chrono::milliseconds(-1));
        route = "staged";
      }
    }
    if (request) {
      if (auto e = request->exception()) std::rethrow_exception(e);
    }
    return route;
  }
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<HostRuntime> runtime_;
  std::unique_ptr<DeviceComm> dev_;
  bool capturing_ = false;
  char streamIds_[5] = {};  // their addresses name the host runtime's streams
  device::Stream caller_ = nullptr;

 public:
  void setStream(int id) {
    CLAWCOMM_ARG_CHECK(id >= 0 && id <= 4, "clawcomm: caller's stream ", id, " is not 0 to 4");
    caller_ = id == 0 ? nullptr : &streamIds_[id];
  }
  int stream() const { return caller_ ? int(static_cast<const char*>(caller_) - streamIds_) : 0; }
  void hold(const std::string& which, int ms) { runtime_->hold(streamNamed(which), ms); }
  int64_t deviceBytes() { return live().deviceBytes(); }
};

}  // namespace

void bindDevice(py::module_& m) {
  py::class_<device::HostGraph, std::shared_ptr<device::HostGraph>>(
      m, "HostGraph", "Calls captured by HostDeviceComm.begin_capture(), replayed in order.")
      .def("replay", &device::HostGraph::replay, py::call_guard<py::gil_scoped_release>());
  py::class_<HostWork>(m, "HostWork",
                       "A collective HostDeviceComm issued with async_op set, as torch's Work.")
      .def("wait", &HostWork::wait, py::arg("timeout") = py::none(),
           "Waits (at most `timeout` seconds) and returns the route it took; TimeoutError "
           "if it is still running then.")
      .def("is_completed", &HostWork::isCompleted)
      .def_property_readonly("route", [](const HostWork& w) { return w.route_; });
  py::class_<HostReceive>(m, "HostReceive", "A receive HostDeviceComm.irecv() posted.")
      .def("wait", &HostReceive::wait,
           "Waits for the message and copies it into the buffer; returns the route it took.");
  py::class_<HostDeviceComm>(
      m, "HostDeviceComm",
      "The device collectives of an Engine over the host runtime: the CUDA IPC path's setup, "
      "routing, kernels' protocol, abort and failure reports, run on the CPU. `device` is the "
      "device index this rank claims; `fault` ('none', 'alloc', 'open', 'probe') fails this "
      "rank's IPC setup on purpose. Each call returns the route it took ('ipc' or 'staged'); "
      "with async_op=True (on the communicator's stream) or False (on the caller's, not waited "
      "for) a collective returns a HostWork instead, as torch's adapter issues them.")
      .def(py::init<std::shared_ptr<Communicator>, int, const std::string&>(), py::arg("engine"),
           py::arg("device") = 0, py::arg("fault") = "none")
      .def("route", &HostDeviceComm::route, py::arg("op"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(),
           "'one-shot', 'two-shot', 'ipc' or 'staged' for `op` moving `nbytes` per rank.")
      .def("all_reduce", &HostDeviceComm::allReduce, py::arg("buf"), py::arg("op") = "sum",
           py::arg("dtype") = py::none(), py::arg("async_op") = py::none())
      .def("all_gather", &HostDeviceComm::allGather, py::arg("input"), py::arg("output"),
           py::arg("dtype") = py::none(), py::arg("async_op") = py::none())
      .def("reduce_scatter", &HostDeviceComm::reduceScatter, py::arg("input"), py::arg("output"),
           py::arg("op") = "sum", py::arg("dtype") = py::none(), py::arg("async_op") = py::none())
      .def("broadcast", &HostDeviceComm::broadcast, py::arg("buf"), py::arg("root") = 0,
           py::arg("dtype") = py::none(), py::arg("async_op") = py::none())
      .def("all_to_all", &HostDeviceComm::allToAll, py::arg("input"), py::arg("output"),
           py::arg("dtype") = py::none(), py::arg("async_op") = py::none())
      .def("send", &HostDeviceComm::send, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0,
           py::arg("dtype") = py::none())
      .def("recv", &HostDeviceComm::recv, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0,
           py::arg("dtype") = py::none())
      .def("irecv", &HostDeviceComm::irecv, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0,
           py::arg("dtype") = py::none(),
           "Posts a receive and returns at once: a HostReceive whose wait() delivers it.")
      .def_property("stream", &HostDeviceComm::stream, &HostDeviceComm::setStream,
                    "The caller's current stream: 0 (the null stream: calls run at once, "
                    "the default) or a host stream 1 to 4.")
      .def("hold", &HostDeviceComm::hold, py::arg("stream"), py::arg("ms"),
           "For `ms` milliseconds, calls on `stream` ('comm', or 'caller': the current one) "
           "queue instead of running, as on a busy GPU; then they run.")
      .def_property_readonly("device_bytes", &HostDeviceComm::deviceBytes,
                             "The bytes of this rank's IPC buffer (0 before setup, or staged).")
      .def_property_readonly("status", &HostDeviceComm::status)
      .def_property_readonly("devices", &HostDeviceComm::devices,
                             "Each rank's device index, as the IPC setup exchanged them.")
      .def("abort", &HostDeviceComm::abort, py::call_guard<py::gil_scoped_release>(),
           "From any thread: stops this rank's spinning blocks and tells its peers' blocks.")
      .def("begin_capture", &HostDeviceComm::beginCapture)
      .def("end_capture", &HostDeviceComm::endCapture)
      .def("close", &HostDeviceComm::close);
}

}  // namespace clawcomm
