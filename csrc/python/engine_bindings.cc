#include "python/engine_bindings.h"

#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>

#include "algorithms/algorithms.h"
#include "comm/communicator.h"
#include "common/errors.h"
#include "python/buffers.h"
#include "python/gil.h"
#include "reduce/reduce_kernels.h"

namespace py = pybind11;

namespace clawcomm {
SimdLevel parseLevel(const py::object& level) {
  if (level.is_none()) return activeSimdLevel();
  const std::string name = py::cast<std::string>(level);
  for (SimdLevel l : {SimdLevel::kPortable, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (name == simdLevelName(l)) return l;
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm.kernels: unknown SIMD level '", name,
                                        "' (portable, avx2, avx512)"));
}

void bindEngine(py::module_& m) {
  // Bad arguments are ValueError, timeouts TimeoutError; peer failures and
  // mismatches stay RuntimeError.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  using Op = const std::string&;
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Engine",
      "A communicator's collectives on buffer-protocol objects, below torch's dispatch. "
      "Every call blocks until the operation is complete on this rank.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def("transport_of", &Communicator::transportOf, py::arg("peer"))
      .def(
          "single_copy_from",
          [](const Communicator& c, int peer) -> std::optional<size_t> {
            const size_t n = c.singleCopyFrom(peer);
            if (n == SIZE_MAX) return std::nullopt;
            return n;
          },
          py::arg("peer"),
          "The smallest payload in bytes this rank sends to `peer` by single copy, or None")
      .def(
          "abort",
          [](Communicator& c, const std::string& reason) {
            py::gil_scoped_release release;
            c.abort(reason);
          },
          py::arg("reason") = "abort() was called",
          "From any thread: fails the operation in flight and every later one with "
          "'rank R aborted: reason', wakes every waiter and tells the peers; the process goes on.")
      .def(
          "split",
          [](Communicator& c, int color, py::object key, double timeoutSeconds) {
            Communicator::SplitOptions options;
            options.timeout = std::chrono::milliseconds(int64_t(timeoutSeconds * 1000));
            const int k = key.is_none() ? c.rank() : py::cast<int>(key);
            std::shared_ptr<Communicator> child;
            {
              py::gil_scoped_release release;
              child = c.split(color, k, options);
            }
            return child ? py::cast(heldWithoutGil(child)) : py::none();
          },
          py::arg("color"), py::arg("key") = py::none(), py::arg("timeout") = 0.0,
          "A new engine of the ranks that pass the same color (>= 0), ordered by key (default: "
          "this rank), set up over this engine's connections: every rank of this engine calls "
          "it, in the same order among its collectives; color=-1 joins none and returns None. "
          "timeout: seconds for the setup and the new engine's operations (0: this one's).")
      .def("start_estimate", &Communicator::startEstimate,
           "Until end_estimate(), this engine's operations move nothing and touch no buffer: "
           "each completes at once and the cost model prices it (torch's _time_estimator).")
      .def("end_estimate", &Communicator::endEstimate,
           "The cost model's time, in seconds, for the operations since start_estimate().")
      .def(
          "shrink",
          [](Communicator& c, std::vector<int> excluded, bool abortFirst, double timeoutSeconds) {
            Communicator::ShrinkOptions options;
            options.abortFirst = abortFirst;
            options.timeout = std::chrono::milliseconds(int64_t(timeoutSeconds * 1000));
            std::shared_ptr<Communicator> child;
            {
              py::gil_scoped_release release;
              child = c.shrink(excluded, options);
            }
            return heldWithoutGil(child);
          },
          py::arg("excluded"), py::arg("abort") = false, py::arg("timeout") = 0.0,
          "A new engine of this one's ranks but `excluded` (which may be dead or stuck in a "
          "collective), in this one's order, connected afresh through the store: only the ranks "
          "that stay call it, each with the same list. abort=True aborts this engine first, "
          "failing what it has in flight. timeout: seconds for the setup and the new engine's "
          "operations (0: this one's).")
      .def(
          "flight_record", [](const Communicator& c) { return c.flightRecord(); },
          "The last operations of this communicator, oldest first, as JSON (the flight "
          "recorder; CLAWCOMM_RECORDER_ENTRIES sizes it).")
      .def_property_readonly("flight_record_path", &Communicator::flightRecordPath,
                             "Where this communicator writes its flight record if it fails.")
      .def(
          "comm_stats",
          [](const Communicator& c) {
            py::dict out;
            for (int t = 0; t < kNumOpTypes; ++t) {
              const OpTraffic& o = c.traffic().ops[t];
              auto get = [](const std::atomic<uint64_t>& v) {
                return v.load(std::memory_order_relaxed);
              };
              py::dict d;
              d["calls"] = get(o.calls);
              d["frames_sent"] = get(o.framesSent);
              d["bytes_sent"] = get(o.bytesSent);
              d["payload_bytes_sent"] = get(o.payloadSent);
              d["frames_received"] = get(o.framesReceived);
              d["bytes_received"] = get(o.bytesReceived);
              d["payload_bytes_received"] = get(o.payloadReceived);
              d["frames_sent_single_copy"] = get(o.framesSentByReference);
              d["frames_received_single_copy"] = get(o.framesReceivedByReference);
              d["busy_us"] = get(o.busyUs);
              out[opTypeName(OpType(t))] = d;
            }
            return out;
          },
          "Calls and bytes on the wire so far, per operation: whole frames (bytes_*) and "
          "payload only (payload_bytes_*); frames_*_single_copy: those whose payload the "
          "receiver read straight from the sender's memory (CLAWCOMM_SINGLE_COPY); busy_us: "
          "microseconds the collectives of that kind ran, start to end.")
      .def(
          "memory_stats",
          [](const Communicator& c) {
            const Communicator::MemoryStats m = c.memoryStats();
            py::dict out;
            out["shm_ring_bytes"] = m.ringBytes;
            out["shm_ring_resident_bytes"] = m.ringResidentBytes;
            out["scratch_bytes"] = m.scratchBytes;
            out["device_ipc_bytes"] = m.deviceIpcBytes;
            out["suspended"] = m.suspended;
            return out;
          },
          "Memory this communicator holds outside torch's allocators: shm_ring_bytes, the "
          "shared-memory rings this rank reads, and shm_ring_resident_bytes of them in memory "
          "now; scratch_bytes, the collectives' working memory; device_ipc_bytes, the device "
          "memory of its CUDA IPC buffers on this rank (each device's, from its first call "
          "through CUDA IPC; CLAWCOMM_CUDA_IPC_BYTES, CLAWCOMM_CUDA_GRAPH_BYTES and "
          "CLAWCOMM_CUDA_P2P_BYTES size them); suspended (suspend()).")
      .def("suspend", &Communicator::suspend, py::call_guard<py::gil_scoped_release>(),
           "Frees the shared-memory rings' pages and the working memory between phases of a "
           "job, keeping the connections: every rank calls it, with no operation in flight. "
           "Operations are refused until resume().")
      .def("resume", &Communicator::resume, "Ends suspend(): operations run again.")
      .def(
          "all_reduce",
          [](Communicator& c, py::buffer buf, Op op, py::object dtype) {
            Buffer b = takeBuffer("all_reduce", "buffer", buf, true, dtype);
            const ReduceOp r = parseReduceOp("all_reduce", op);
            run([&] { return c.allReduce(b.data, b.count, b.dtype, r); });
          },
          py::arg("buf"), py::arg("op") = "sum", py::arg("dtype") = py::none(),
          "In place, over every rank.")
      .def(
          "all_reduce_16bit_wire",
          [](Communicator& c, py::buffer buf, const std::string& wire, float prescale,
             float postscale) {
            Buffer b = takeBuffer("all_reduce", "buffer", buf, true, py::none());
            CLAWCOMM_ARG_CHECK(b.dtype == DataType::kFloat32, "clawcomm::all_reduce: a 16-bit ",
                               "wire needs a float32 buffer, not ", dataTypeName(b.dtype));
            const DataType w = parseDataType("all_reduce", wire);
            run([&] {
              return c.allReduce16BitWire(static_cast<float*>(b.data), b.count, w, prescale,
                                          postscale);
            });
          },
          py::arg("buf"), py::arg("wire") = "float16", py::arg("prescale") = 1.0f,
          py::arg("postscale") = 1.0f,
          "Sum of a float32 buffer with float16 or bfloat16 on the wire and float32 "
          "accumulation at every step; values are multiplied by `prescale` first and "
          "the result by `postscale`, inside the conversion kernels.")
      .def(
          "reduce_scatter_16bit_wire",
          [](Communicator& c, py::buffer buf, py::buffer out, const std::string& wire,
             float prescale, float postscale) {
            Buffer b = takeBuffer("reduce_scatter", "buffer", buf, true, py::none());
            Buffer o = takeBuffer("reduce_scatter", "output", out, true, py::none());
            CLAWCOMM_ARG_CHECK(b.dtype == DataType::kFloat32 && o.dtype == DataType::kFloat32,
                               "clawcomm::reduce_scatter: a 16-bit wire needs float32 buffers, "
                               "not ",
                               dataTypeName(b.dtype), " and ", dataTypeName(o.dtype));
            // (A count the ranks do not divide is the communicator's error.)
            CLAWCOMM_ARG_CHECK(
                b.count % size_t(c.size()) != 0 || o.count * size_t(c.size()) == b.count,
                "clawcomm::reduce_scatter: the output holds ", o.count,
                " values; this rank's part of ", b.count, " over ", c.size(), " ranks is ",
                b.count / size_t(c.size()));
            const DataType w = parseDataType("reduce_scatter", wire);
            run([&] {
              return c.reduceScatter16BitWire(static_cast<float*>(b.data),
                                              static_cast<float*>(o.data), b.count, w, prescale,
                                              postscale);
            });
          },
          py::arg("buf"), py::arg("out"), py::arg("wire") = "float16", py::arg("prescale") = 1.0f,
          py::arg("postscale") = 1.0f,
          "Reduce-scatter of a float32 buffer (its length a multiple of the group's size) "
          "with float16 or bfloat16 on the wire and float32 accumulation: rank r's part "
          "into `out`. `buf` is overwritten with partial sums. `prescale` multiplies the "
          "values first, `postscale` the result.")
      .def(
          "reduce_scatter",
          [](Communicator& c, py::buffer in, py::buffer out, Op op, py::object dtype) {
            Buffer i = takeBuffer("reduce_scatter", "input", in, false, dtype);
            Buffer o = takeBuffer("reduce_scatter", "output", out, true, dtype);
            checkSameType("reduce_scatter", i, o);
            CLAWCOMM_ARG_CHECK(i.count == o.count * size_t(c.size()),
                               "clawcomm::reduce_scatter: input has ", i.count,
                               " elements, output ", o.count, " (input must be size x output)");
            const ReduceOp r = parseReduceOp("reduce_scatter", op);
            std::vector<size_t> counts(size_t(c.size()), o.count);
            run([&] { return c.reduceScatter(i.data, o.data, counts, i.dtype, r); });
          },
          py::arg("input"), py::arg("output"), py::arg("op") = "sum", py::arg("dtype") = py::none())
      .def(
          "all_gather",
          [](Communicator& c, py::buffer in, py::buffer out, py::object dtype) {
            Buffer i = takeBuffer("all_gather", "input", in, false, dtype);
            Buffer o = takeBuffer("all_gather", "output", out, true, dtype);
            checkSameType("all_gather", i, o);
            CLAWCOMM_ARG_CHECK(o.count == i.count * size_t(c.size()),
                               "clawcomm::all_gather: input has ", i.count, " elements, output ",
                               o.count, " (output must be size x input)");
            std::vector<size_t> counts(size_t(c.size()), i.count);
            run([&] { return c.allGather(i.data, o.data, counts, i.dtype); });
          },
          py::arg("input"), py::arg("output"), py::arg("dtype") = py::none())
      .def(
          "broadcast",
          [](Communicator& c, py::buffer buf, int root, py::object dtype) {
            Buffer b = takeBuffer("broadcast", "buffer", buf, true, dtype);
            run([&] { return c.broadcast(b.data, b.count, b.dtype, root); });
          },
          py::arg("buf"), py::arg("root") = 0, py::arg("dtype") = py::none())
      .def(
          "reduce",
          [](Communicator& c, py::buffer buf, int root, Op op, py::object dtype) {
            Buffer b = takeBuffer("reduce", "buffer", buf, true, dtype);
            const ReduceOp r = parseReduceOp("reduce", op);
            run([&] { return c.reduce(b.data, b.count, b.dtype, r, root); });
          },
          py::arg("buf"), py::arg("root") = 0, py::arg("op") = "sum", py::arg("dtype") = py::none())
      .def(
          "all_to_all",
          [](Communicator& c, py::buffer in, py::buffer out, py::object dtype,
             std::optional<std::vector<size_t>> sendCounts,
             std::optional<std::vector<size_t>> recvCounts) {
            Buffer i = takeBuffer("all_to_all", "input", in, false, dtype);
            Buffer o = takeBuffer("all_to_all", "output", out, true, dtype);
            checkSameType("all_to_all", i, o);
            const size_t n = size_t(c.size());
            if (!sendCounts && !recvCounts) {
              CLAWCOMM_ARG_CHECK(i.count == o.count && i.count % n == 0,
                                 "clawcomm::all_to_all: input has ", i.count, " elements, output ",
                                 o.count, " (both must be the same multiple of ", n, ")");
              std::vector<size_t> counts(n, i.count / n);
              run([&] { return c.allToAll(i.data, counts, o.data, counts, i.dtype); });
              return;
            }
            // Uneven: each list's sum must be its buffer's length.
            CLAWCOMM_ARG_CHECK(sendCounts && recvCounts,
                               "clawcomm::all_to_all: give both send_counts and recv_counts, "
                               "or neither (an even split)");
            auto total = [](const std::vector<size_t>& v) {
              return std::accumulate(v.begin(), v.end(), size_t(0));
            };
            const size_t sent = total(*sendCounts), received = total(*recvCounts);
            CLAWCOMM_ARG_CHECK(sent == i.count, "clawcomm::all_to_all: send_counts add up to ",
                               sent, " elements, the input has ", i.count);
            CLAWCOMM_ARG_CHECK(received == o.count, "clawcomm::all_to_all: recv_counts add up to ",
                               received, " elements, the output has ", o.count);
            run([&] { return c.allToAll(i.data, *sendCounts, o.data, *recvCounts, i.dtype); });
          },
          py::arg("input"), py::arg("output"), py::arg("dtype") = py::none(),
          py::arg("send_counts") = py::none(), py::arg("recv_counts") = py::none(),
          "send_counts[p] elements of input go to rank p, recv_counts[p] from rank p land in "
          "output, each in rank order; neither: an even split")
      .def("barrier", [](Communicator& c) { run([&] { return c.barrier(); }); })
      .def(
          "send",
          [](Communicator& c, py::buffer buf, int dst, uint64_t tag) {
            Buffer b = takeBytes("send", "buffer", buf, false);
            run([&] {
              RequestPtr sent = c.send(b.data, b.count, dst, tag);
              c.drive(*sent);  // on this thread, which waits for it anyway
              return sent;
            });
          },
          py::arg("buf"), py::arg("dst"), py::arg("tag") = 0)
      .def(
          "recv",
          [](Communicator& c, py::buffer buf, int src, uint64_t tag) {
            Buffer b = takeBytes("recv", "buffer", buf, true);
            return run([&] {
              RequestPtr received = c.recv(b.data, b.count, src, tag);
              c.drive(*received);
              return received;
            });
          },
          py::arg("buf"), py::arg("src") = -1, py::arg("tag") = 0,
          "Returns the rank the message came from (src=-1: any rank).")
      .def(
          "sendrecv",
          [](Communicator& c, py::buffer sendBuf, int dst, py::buffer recvBuf, int src,
             uint64_t tag) {
            Buffer s = takeBytes("sendrecv", "send buffer", sendBuf, false);
            Buffer r = takeBytes("sendrecv", "receive buffer", recvBuf, true);
            RequestPtr sent, received;
            {
              py::gil_scoped_release release;
              // The send first: its reference (single copy) or first bytes
              // reach the peer while this rank's receive is being posted.
              sent = c.send(s.data, s.count, dst, tag);
              received = c.recv(r.data, r.count, src, tag);
              c.drive(*received);  // on this thread, which waits anyway
              c.drive(*sent);
            }
            finish(sent);
            finish(received);
          },
          py::arg("send_buf"), py::arg("dst"), py::arg("recv_buf"), py::arg("src"),
          py::arg("tag") = 0, "Sends to `dst` while receiving from `src`.");
  bindKernels(m);
  bindCompress(m);
  bindCostModel(m);
}

}  // namespace clawcomm
