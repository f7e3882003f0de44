// The engine module's `kernels` submodule (the element-wise kernels on
// buffer-protocol objects) and its cost model (`_cost_model_*`): bindings
// without a communicator, apart from the Engine's (python/engine_bindings.cc).
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>

#include "algorithms/algorithms.h"
#include "common/errors.h"
#include "python/buffers.h"
#include "python/engine_bindings.h"
#include "reduce/reduce_kernels.h"

namespace py = pybind11;

namespace clawcomm {
namespace {

// A conversion kernel's float32 buffer and 16-bit buffer, checked: the same
// length, and a 16-bit dtype.
struct Conversion {
  Buffer f32, h16;
};
Conversion takeConversion(const char* op, const char* f32Name, const py::buffer& f32, bool f32Out,
                          const char* h16Name, const py::buffer& h16, bool h16Out,
                          const std::string& dtype) {
  Conversion c{takeBuffer(op, f32Name, f32, f32Out, py::str("float32")),
               takeBuffer(op, h16Name, h16, h16Out, py::str(dtype))};
  CLAWCOMM_ARG_CHECK(c.f32.count == c.h16.count, "clawcomm::", op, ": ", f32Name, " has ",
                     c.f32.count, " elements, ", h16Name, " ", c.h16.count);
  CLAWCOMM_ARG_CHECK(c.h16.dtype == DataType::kFloat16 || c.h16.dtype == DataType::kBFloat16,
                     "clawcomm::", op, ": dtype ", dtype, " is not float16 or bfloat16");
  return c;
}

}  // namespace

void bindKernels(py::module_& m) {
  py::module_ k = m.def_submodule(
      "kernels", "The engine's element-wise kernels, for tests and micro-benchmarks.");
  k.def(
      "simd_level", [] { return simdLevelName(activeSimdLevel()); },
      "The SIMD level the engine uses (CLAWCOMM_SIMD caps it).");
  k.def(
      "best_simd_level", [] { return simdLevelName(detectSimdLevel()); },
      "The best SIMD level this CPU supports.");
  k.def(
      "reduce",
      [](py::buffer dst, py::buffer src, const std::string& op, py::object level,
         py::object dtype) {
        Buffer d = takeBuffer("kernels.reduce", "dst", dst, true, dtype);
        Buffer s = takeBuffer("kernels.reduce", "src", src, false, dtype);
        checkSameType("kernels.reduce", s, d);
        CLAWCOMM_ARG_CHECK(d.count == s.count, "clawcomm::kernels.reduce: dst has ", d.count,
                           " elements, src ", s.count);
        const ReduceOp r = parseReduceOp("kernels.reduce", op);
        CLAWCOMM_ARG_CHECK(reduceOpSupported(d.dtype, r), "clawcomm::kernels.reduce: ", op,
                           " is not defined on ", dataTypeName(d.dtype));
        const SimdLevel l = parseLevel(level);
        py::gil_scoped_release release;
        reduceIntoAt(l, d.dtype, r, d.data, s.data, d.count);
      },
      py::arg("dst"), py::arg("src"), py::arg("op") = "sum", py::arg("level") = py::none(),
      py::arg("dtype") = py::none(), "dst[i] = dst[i] op src[i].");
  k.def(
      "to_float32",
      [](py::buffer src, py::buffer dst, const std::string& dtype, py::object level, float scale) {
        auto [f, h] =
            takeConversion("kernels.to_float32", "dst", dst, true, "src", src, false, dtype);
        const SimdLevel l = parseLevel(level);
        py::gil_scoped_release release;
        toFloat32At(l, h.dtype, h.data, static_cast<float*>(f.data), h.count, scale);
      },
      py::arg("src"), py::arg("dst"), py::arg("dtype") = "float16", py::arg("level") = py::none(),
      py::arg("scale") = 1.0f,
      "Widens 16-bit floats (held in a uint16 or float16 buffer) into a float32 buffer, "
      "times `scale`.");
  k.def(
      "from_float32",
      [](py::buffer src, py::buffer dst, const std::string& dtype, py::object level, float scale) {
        auto [f, h] =
            takeConversion("kernels.from_float32", "src", src, false, "dst", dst, true, dtype);
        const SimdLevel l = parseLevel(level);
        py::gil_scoped_release release;
        fromFloat32At(l, h.dtype, static_cast<const float*>(f.data), h.data, h.count, scale);
      },
      py::arg("src"), py::arg("dst"), py::arg("dtype") = "float16", py::arg("level") = py::none(),
      py::arg("scale") = 1.0f, "Rounds float32 times `scale` to 16-bit floats (nearest even).");
  k.def(
      "add_from16",
      [](py::buffer dst, py::buffer src, const std::string& dtype, py::object level,
         float dstScale) {
        auto [f, h] =
            takeConversion("kernels.add_from16", "dst", dst, true, "src", src, false, dtype);
        const SimdLevel l = parseLevel(level);
        py::gil_scoped_release release;
        addFrom16At(l, h.dtype, static_cast<float*>(f.data), h.data, h.count, dstScale);
      },
      py::arg("dst"), py::arg("src"), py::arg("dtype") = "float16", py::arg("level") = py::none(),
      py::arg("dst_scale") = 1.0f,
      "dst = dst * dst_scale + widen(src): the 16-bit ring's decode-and-accumulate step.");
  k.def(
      "add_from16_and_round",
      [](py::buffer dst, py::buffer src, py::buffer out, const std::string& dtype, py::object level,
         float dstScale, float outScale) {
        const char* what = "kernels.add_from16_and_round";
        auto [f, h] = takeConversion(what, "dst", dst, true, "src", src, false, dtype);
        const Buffer o = takeConversion(what, "dst", dst, true, "out", out, true, dtype).h16;
        const SimdLevel l = parseLevel(level);
        py::gil_scoped_release release;
        addFrom16AndRoundAt(l, h.dtype, static_cast<float*>(f.data), h.data, o.data, h.count,
                            dstScale, outScale);
      },
      py::arg("dst"), py::arg("src"), py::arg("out"), py::arg("dtype") = "float16",
      py::arg("level") = py::none(), py::arg("dst_scale") = 1.0f, py::arg("out_scale") = 1.0f,
      "add_from16, then out = round16(dst) and dst = widen(out) * out_scale: the 16-bit "
      "ring's last reduce-scatter step.");
}

// The engine's cost model, for clawcomm.cost_model's tests: the closed forms in
// Python must agree with the ones auto chooses by.
namespace {

CostModel costModelOf(const py::dict& d) {
  CostModel m;
  m.shmAlpha = d["shm_alpha"].cast<double>();
  m.shmBeta = d["shm_beta"].cast<double>();
  m.netAlpha = d["net_alpha"].cast<double>();
  m.netBeta = d["net_beta"].cast<double>();
  m.gamma = d["gamma"].cast<double>();
  return m;
}

}  // namespace

void bindCostModel(py::module_& m) {
  m.def(
      "_all_reduce_cost",
      [](const std::string& algo, double nbytes, std::vector<int> hostOf, const py::dict& model) {
        for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
          if (algo == a.name)
            return allReduceCost(a.id, nbytes, Topology(hostOf), costModelOf(model));
        }
        throw InvalidArgument("clawcomm: no all-reduce algorithm " + algo);
      },
      py::arg("algo"), py::arg("nbytes"), py::arg("host_of"), py::arg("model"),
      "The engine's predicted seconds for an all-reduce of nbytes on ranks placed on host_of[r] "
      "(model: a dict of shm_alpha, shm_beta, net_alpha, net_beta, gamma).");
  m.def(
      "_choose_all_reduce",
      [](double nbytes, std::vector<int> hostOf, const py::dict& model) {
        Settings s;
        s.costModel = costModelOf(model);
        return std::string(chooseAllReduce(size_t(nbytes), Topology(hostOf), s).name);
      },
      py::arg("nbytes"), py::arg("host_of"), py::arg("model"),
      "What CLAWCOMM_ALGO=auto picks for an all-reduce of nbytes on that layout.");
  auto opOf = [](const std::string& name) {
    for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
      if (name == opTypeName(a.op)) return a.op;
    }
    throw InvalidArgument("clawcomm: " + name + " has no choice of algorithm");
  };
  m.def(
      "_algorithm_table",
      [] {
        std::vector<std::pair<std::string, std::string>> rows;
        for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
          rows.emplace_back(opTypeName(a.op), a.name);
        }
        return rows;
      },
      "Every (op, algorithm) CLAWCOMM_ALGO can name, in the table's order.");
  m.def(
      "_choose_algorithm",
      [opOf](const std::string& op, double nbytes, std::vector<int> hostOf, const py::dict& model,
             const std::string& algo, const std::string& transport) {
        Settings s;
        s.costModel = costModelOf(model);
        s.algo = algo;
        s.transport = transport;
        checkAlgorithmSetting(algo);
        return std::string(
            algorithmName(chooseAlgorithm(opOf(op), size_t(nbytes), Topology(hostOf), s)));
      },
      py::arg("op"), py::arg("nbytes"), py::arg("host_of"), py::arg("model"),
      py::arg("algo") = "auto", py::arg("transport") = "auto",
      "The algorithm `op` (all_reduce, reduce_scatter, all_gather, broadcast, reduce) of nbytes "
      "runs on that layout under CLAWCOMM_ALGO=algo and CLAWCOMM_TRANSPORT=transport.");
  m.def(
      "_collective_cost",
      [opOf](const std::string& op, const std::string& algo, double nbytes, std::vector<int> hostOf,
             const py::dict& model) {
        for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
          if (a.op == opOf(op) && algo == a.name) {
            return collectiveCost(a.op, a.id, nbytes, Topology(hostOf), costModelOf(model));
          }
        }
        throw InvalidArgument("clawcomm: " + op + " has no algorithm " + algo);
      },
      py::arg("op"), py::arg("algo"), py::arg("nbytes"), py::arg("host_of"), py::arg("model"),
      "The cost model's seconds for `op` by `algo` (inf where the layout cannot run it).");
}

}  // namespace clawcomm
