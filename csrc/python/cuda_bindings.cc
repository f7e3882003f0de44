// `clawcomm._C.cuda` (CUDA builds only): the CUDA kernels on raw device
// pointers, for tests and micro-benchmarks. Pointers and streams are plain
// integers (torch: tensor.data_ptr(), torch.cuda.current_stream().cuda_stream;
// cupy: array.data.ptr, cupy.cuda.get_current_stream().ptr). Calls are
// asynchronous on the stream and release the GIL.
//
// With the other bindings here, not in csrc/cuda/ (which holds CUDA code
// only); setup.py compiles every csrc/python/ file, so a build without CUDA
// compiles this one to nothing (the guard below), and module.cc calls
// bindCuda only where it exists. tests/test_cuda_build.py compiles it with
// CLAWCOMM_WITH_CUDA=1 against the CUDA headers.
#if defined(CLAWCOMM_WITH_CUDA)

#include <pybind11/pybind11.h>

#include <string>

#include "common/errors.h"
#include "cuda/kernels.h"
#include "python/engine_bindings.h"

namespace py = pybind11;

namespace clawcomm {
namespace {

DataType dtypeNamed(const char* op, const std::string& name) {
  static const std::pair<const char*, DataType> kNames[] = {
      {"float32", DataType::kFloat32}, {"float64", DataType::kFloat64},
      {"float16", DataType::kFloat16}, {"bfloat16", DataType::kBFloat16},
      {"int8", DataType::kInt8},       {"uint8", DataType::kUInt8},
      {"int32", DataType::kInt32},     {"int64", DataType::kInt64},
      {"bool", DataType::kBool}};
  for (const auto& [n, t] : kNames) {
    if (name == n) return t;
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm::cuda::", op, ": unknown dtype '", name, "'"));
}

ReduceOp opNamed(const std::string& name) {
  static const std::pair<const char*, ReduceOp> kNames[] = {
      {"sum", ReduceOp::kSum}, {"avg", ReduceOp::kAvg},  {"product", ReduceOp::kProduct},
      {"min", ReduceOp::kMin}, {"max", ReduceOp::kMax},  {"band", ReduceOp::kBand},
      {"bor", ReduceOp::kBor}, {"bxor", ReduceOp::kBxor}};
  for (const auto& [n, o] : kNames) {
    if (name == n) return o;
  }
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm::cuda::reduce: unknown op '", name, "'"));
}

template <typename T = void>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

cuda::Stream stream(uintptr_t s) {
  return reinterpret_cast<cuda::Stream>(s);
}

}  // namespace

void bindCuda(py::module_& m) {
  py::module_ c = m.def_submodule(
      "cuda", "The CUDA kernels on device pointers (integers), asynchronous on `stream`.");
  using P = uintptr_t;
  const auto release = py::call_guard<py::gil_scoped_release>();
  c.def(
      "reduce",
      [](P dst, P src, size_t count, const std::string& dtype, const std::string& op, P s) {
        cuda::reduceInto(dtypeNamed("reduce", dtype), opNamed(op), ptr(dst), ptr(src), count,
                         stream(s));
      },
      py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("dtype") = "float32",
      py::arg("op") = "sum", py::arg("stream") = 0, release, "dst[i] = dst[i] op src[i].");
  c.def(
      "to_float32",
      [](P src, P dst, size_t count, const std::string& dtype, float scale, P s) {
        cuda::toFloat32(dtypeNamed("to_float32", dtype), ptr(src), ptr<float>(dst), count, scale,
                        stream(s));
      },
      py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("dtype") = "float16",
      py::arg("scale") = 1.0f, py::arg("stream") = 0, release);
  c.def(
      "from_float32",
      [](P src, P dst, size_t count, const std::string& dtype, float scale, P s) {
        cuda::fromFloat32(dtypeNamed("from_float32", dtype), ptr<const float>(src), ptr(dst), count,
                          scale, stream(s));
      },
      py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("dtype") = "float16",
      py::arg("scale") = 1.0f, py::arg("stream") = 0, release);
  c.def(
      "add_from16",
      [](P dst, P src, size_t count, const std::string& dtype, float dstScale, P s) {
        cuda::addFrom16(dtypeNamed("add_from16", dtype), ptr<float>(dst), ptr(src), count, dstScale,
                        stream(s));
      },
      py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("dtype") = "float16",
      py::arg("dst_scale") = 1.0f, py::arg("stream") = 0, release);
  c.def(
      "add_from16_and_round",
      [](P dst, P src, P out, size_t count, const std::string& dtype, float dstScale,
         float outScale, P s) {
        cuda::addFrom16AndRound(dtypeNamed("add_from16_and_round", dtype), ptr<float>(dst),
                                ptr(src), ptr(out), count, dstScale, outScale, stream(s));
      },
      py::arg("dst"), py::arg("src"), py::arg("out"), py::arg("count"),
      py::arg("dtype") = "float16", py::arg("dst_scale") = 1.0f, py::arg("out_scale") = 1.0f,
      py::arg("stream") = 0, release);
  c.def(
      "encode16_feedback",
      [](P grad, P residual, P payload, size_t count, const std::string& dtype, float scale, P s) {
        cuda::encode16WithFeedback(dtypeNamed("encode16_feedback", dtype), ptr<const float>(grad),
                                   ptr<float>(residual), ptr<uint16_t>(payload), count, scale,
                                   stream(s));
      },
      py::arg("grad"), py::arg("residual"), py::arg("payload"), py::arg("count"),
      py::arg("dtype") = "float16", py::arg("scale") = 1.0f, py::arg("stream") = 0, release);
  c.def("topk_workspace_bytes", &cuda::topkWorkspaceBytes, py::arg("n"));
  c.def(
      "topk_feedback",
      [](P grad, P residual, size_t n, size_t k, P idx, P val, P count, P workspace,
         const std::string& method, uint64_t seed, P s) {
        CLAWCOMM_ARG_CHECK(method == "exact" || method == "sampled",
                           "clawcomm::cuda::topk_feedback: method '", method,
                           "' is not 'exact' or 'sampled'");
        cuda::topkWithFeedback(
            ptr<float>(grad), ptr<float>(residual), n, k,
            method == "exact" ? cuda::TopkMethod::kExact : cuda::TopkMethod::kSampled, seed,
            ptr<int32_t>(idx), ptr<float>(val), ptr<uint32_t>(count), ptr(workspace), stream(s));
      },
      py::arg("grad"), py::arg("residual"), py::arg("n"), py::arg("k"), py::arg("idx"),
      py::arg("val"), py::arg("count"), py::arg("workspace"), py::arg("method") = "sampled",
      py::arg("seed") = 0, py::arg("stream") = 0, release,
      "Top-k with error feedback (grad may be 0: select from residual alone); the number "
      "selected lands in `count` (a device uint32).");
  c.def(
      "quantize",
      [](P x, P codes, P scales, size_t n, int bits, size_t block, const std::string& scale,
         bool stochastic, uint64_t seed, P residual, P s) {
        cuda::quantizeBlocks(quantizeSpec(bits, block, scale, stochastic, "cuda::quantize"),
                             ptr<const float>(x), ptr<float>(residual), n, seed,
                             ptr<uint8_t>(codes), ptr<float>(scales), stream(s));
      },
      py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("bits"),
      py::arg("block"), py::arg("scale") = "max", py::arg("stochastic") = true, py::arg("seed") = 0,
      py::arg("residual") = 0, py::arg("stream") = 0, release,
      "Block quantisation (compress/quantize.h) of n floats into n * bits / 8 bytes of codes "
      "and n / block scales; residual 0: no error feedback. The CPU's bits for the same seed.");
  c.def(
      "dequantize",
      [](P codes, P scales, P out, size_t n, int bits, size_t block, const std::string& scale,
         float alpha, bool accumulate, P s) {
        cuda::dequantizeBlocks(quantizeSpec(bits, block, scale, false, "cuda::dequantize"),
                               ptr<const uint8_t>(codes), ptr<const float>(scales), n, alpha,
                               accumulate, ptr<float>(out), stream(s));
      },
      py::arg("codes"), py::arg("scales"), py::arg("out"), py::arg("n"), py::arg("bits"),
      py::arg("block"), py::arg("scale") = "max", py::arg("alpha") = 1.0f,
      py::arg("accumulate") = false, py::arg("stream") = 0, release,
      "out = alpha * decoded, or out += alpha * decoded (accumulate).");
  c.def("scatter_add_workspace_bytes", &cuda::scatterAddWorkspaceBytes, py::arg("m"));
  c.def(
      "scatter_add",
      [](P dense, size_t n, P idx, P val, size_t m, float scale, bool deterministic, P workspace,
         P s) {
        if (deterministic) {
          cuda::scatterAddDeterministic(ptr<float>(dense), n, ptr<const int32_t>(idx),
                                        ptr<const float>(val), m, scale, ptr(workspace), stream(s));
        } else {
          cuda::scatterAddAtomic(ptr<float>(dense), n, ptr<const int32_t>(idx),
                                 ptr<const float>(val), m, scale, stream(s));
        }
      },
      py::arg("dense"), py::arg("n"), py::arg("idx"), py::arg("val"), py::arg("m"),
      py::arg("scale") = 1.0f, py::arg("deterministic") = false, py::arg("workspace") = 0,
      py::arg("stream") = 0, release,
      "dense[idx[i]] += val[i] * scale; deterministic=True sorts by index first (needs "
      "scatter_add_workspace_bytes(m) of workspace) and gives the CPU's bits.");
}

}  // namespace clawcomm

#endif  // CLAWCOMM_WITH_CUDA
