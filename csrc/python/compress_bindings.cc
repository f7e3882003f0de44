// `clawcomm._C.compress`: the sparsification kernels on numpy arrays (CPU
// torch tensors pass through .numpy() without a copy).
#include <pybind11/numpy.h>

#include <string>

#include "common/errors.h"
#include "compress/feedback16.h"
#include "compress/quantize.h"
#include "compress/rans.h"
#include "compress/rice.h"
#include "compress/threshold_scan.h"
#include "compress/topk.h"
#include "compress/varint.h"
#include "python/engine_bindings.h"

namespace py = pybind11;

namespace clawcomm {

using FloatArray = py::array_t<float, py::array::c_style>;
using IndexArray = py::array_t<int32_t, py::array::c_style>;
using ByteArray = py::array_t<uint8_t, py::array::c_style>;

QuantizeSpec quantizeSpec(int bits, size_t block, const std::string& scale, bool stochastic,
                          const char* op) {
  QuantizeSpec spec;
  spec.bits = bits;
  spec.block = block;
  spec.stochastic = stochastic;
  CLAWCOMM_ARG_CHECK(scale == "max" || scale == "l2" || scale == "mean_abs", "clawcomm::", op,
                     ": scale '", scale, "' is not max, l2 or mean_abs");
  spec.scale = scale == "max"  ? BlockScale::kMax
               : scale == "l2" ? BlockScale::kL2
                               : BlockScale::kMeanAbs;
  checkQuantizeSpec(spec, op);
  return spec;
}

void bindQuantize(py::module_& c) {
  c.def(
      "quantize",
      [](FloatArray x, ByteArray codes, FloatArray scales, int bits, size_t block,
         const std::string& scale, bool stochastic, uint64_t seed, py::object residual) {
        const QuantizeSpec spec = quantizeSpec(bits, block, scale, stochastic, "quantize");
        const size_t n = size_t(x.size());
        CLAWCOMM_ARG_CHECK(n % block == 0, "clawcomm::quantize: ", n,
                           " values are not a whole number of blocks of ", block);
        CLAWCOMM_ARG_CHECK(size_t(codes.size()) == packedBytes(spec, n) && codes.writeable(),
                           "clawcomm::quantize: codes must be ", packedBytes(spec, n),
                           " writable bytes, got ", codes.size());
        CLAWCOMM_ARG_CHECK(size_t(scales.size()) == n / block && scales.writeable(),
                           "clawcomm::quantize: scales must be ", n / block,
                           " writable floats, got ", scales.size());
        float* r = nullptr;
        if (!residual.is_none()) {
          auto res = py::cast<FloatArray>(residual);
          CLAWCOMM_ARG_CHECK(size_t(res.size()) == n && res.writeable(),
                             "clawcomm::quantize: the residual must be ", n,
                             " writable floats, got ", res.size());
          r = res.mutable_data();
        }
        const float* xs = x.data();
        uint8_t* out = codes.mutable_data();
        float* s = scales.mutable_data();
        py::gil_scoped_release release;
        quantizeBlocks(spec, xs, r, n, seed, out, s);
      },
      py::arg("x").noconvert(), py::arg("codes").noconvert(), py::arg("scales").noconvert(),
      py::arg("bits"), py::arg("block"), py::arg("scale") = "max", py::arg("stochastic") = true,
      py::arg("seed") = 0, py::arg("residual") = py::none(),
      "Block quantisation (compress/quantize.h): x as `bits`-bit codes and one float32 "
      "scale per block; with a residual, x + residual is quantised and the residual "
      "keeps what the codes miss.");
  c.def(
      "dequantize",
      [](ByteArray codes, FloatArray scales, FloatArray out, int bits, size_t block,
         const std::string& scale, float alpha, bool accumulate) {
        const QuantizeSpec spec = quantizeSpec(bits, block, scale, false, "dequantize");
        const size_t n = size_t(out.size());
        CLAWCOMM_ARG_CHECK(n % block == 0 && size_t(codes.size()) == packedBytes(spec, n) &&
                               size_t(scales.size()) == n / block && out.writeable(),
                           "clawcomm::dequantize: ", n, " writable outputs need ",
                           packedBytes(spec, n), " bytes of codes and ", n / block, " scales, got ",
                           codes.size(), " and ", scales.size());
        const uint8_t* in = codes.data();
        const float* s = scales.data();
        float* o = out.mutable_data();
        py::gil_scoped_release release;
        dequantizeBlocks(spec, in, s, n, alpha, accumulate, o);
      },
      py::arg("codes").noconvert(), py::arg("scales").noconvert(), py::arg("out").noconvert(),
      py::arg("bits"), py::arg("block"), py::arg("scale") = "max", py::arg("alpha") = 1.0f,
      py::arg("accumulate") = false, "out = alpha * decoded codes, or out += that (accumulate).");
}

void bindCompress(py::module_& m) {
  py::module_ c = m.def_submodule("compress", "Sparsification kernels for gradient compression.");
  bindQuantize(c);
  c.def(
      "encode16_feedback",
      [](FloatArray grad, FloatArray residual, py::array payload, const std::string& dtype,
         float scale) {
        const char* op = "encode16_feedback";
        const size_t n = size_t(grad.size());
        CLAWCOMM_ARG_CHECK(size_t(residual.size()) == n && size_t(payload.size()) == n,
                           "clawcomm::", op, ": grad has ", n, " elements, residual ",
                           residual.size(), ", payload ", payload.size());
        CLAWCOMM_ARG_CHECK(payload.itemsize() == 2 && payload.writeable() &&
                               (payload.flags() & py::array::c_style),
                           "clawcomm::", op,
                           ": payload must be a writable contiguous 16-bit array");
        CLAWCOMM_ARG_CHECK(residual.writeable(), "clawcomm::", op, ": residual must be writable");
        const DataType wire = dtype == "float16"    ? DataType::kFloat16
                              : dtype == "bfloat16" ? DataType::kBFloat16
                                                    : DataType::kFloat32;
        uint16_t* out = static_cast<uint16_t*>(payload.mutable_data());
        const float* g = grad.data();
        float* r = residual.mutable_data();
        py::gil_scoped_release release;
        encode16WithFeedback(wire, g, r, out, n, scale);
      },
      py::arg("grad").noconvert(), py::arg("residual").noconvert(), py::arg("payload"),
      py::arg("dtype") = "float16", py::arg("scale") = 1.0f,
      "Error feedback with a 16-bit payload in one pass: acc = grad + residual, "
      "payload = round16(acc * scale), residual = acc - widen(payload) / scale.");
  c.def(
      "topk",
      [](FloatArray acc, size_t k, const std::string& method, uint64_t seed) {
        CLAWCOMM_ARG_CHECK(method == "exact" || method == "sampled", "clawcomm::topk: method '",
                           method, "' is not 'exact' or 'sampled'");
        CLAWCOMM_ARG_CHECK(acc.writeable(), "clawcomm::topk: the accumulator must be writable");
        const size_t n = size_t(acc.size());
        IndexArray idx(py::ssize_t(std::min(k, n)));
        FloatArray val(py::ssize_t(std::min(k, n)));
        size_t got;
        {
          py::gil_scoped_release release;
          float* a = acc.mutable_data();
          got = method == "exact"
                    ? topkExact(a, n, k, idx.mutable_data(), val.mutable_data())
                    : topkSampled(a, n, k, seed, idx.mutable_data(), val.mutable_data());
        }
        idx.resize({py::ssize_t(got)});
        val.resize({py::ssize_t(got)});
        return py::make_tuple(idx, val);
      },
      py::arg("acc").noconvert(), py::arg("k"), py::arg("method") = "sampled", py::arg("seed") = 0,
      "Selects (at most) k entries of largest magnitude from the float32 array `acc`, "
      "returns (indices ascending as int32, values), and zeroes them in `acc`, which "
      "keeps the residual.");
  c.def(
      "topk_feedback",
      [](FloatArray grad, FloatArray residual, size_t k, const std::string& method, uint64_t seed) {
        CLAWCOMM_ARG_CHECK(method == "exact" || method == "sampled",
                           "clawcomm::topk_feedback: method '", method,
                           "' is not 'exact' or 'sampled'");
        CLAWCOMM_ARG_CHECK(grad.size() == residual.size(), "clawcomm::topk_feedback: grad has ",
                           grad.size(), " elements but residual has ", residual.size());
        CLAWCOMM_ARG_CHECK(grad.writeable() && residual.writeable(),
                           "clawcomm::topk_feedback: grad and residual must be writable");
        const size_t n = size_t(grad.size());
        const float* g = grad.data();
        const float* r = residual.data();
        CLAWCOMM_ARG_CHECK(n == 0 || g + n <= r || r + n <= g,
                           "clawcomm::topk_feedback: grad and residual overlap");
        IndexArray idx(py::ssize_t(std::min(k, n)));
        FloatArray val(py::ssize_t(std::min(k, n)));
        size_t got;
        {
          py::gil_scoped_release release;
          got =
              topkWithFeedback(grad.mutable_data(), residual.mutable_data(), n, k,
                               method == "exact" ? TopkSelection::kExact : TopkSelection::kSampled,
                               seed, idx.mutable_data(), val.mutable_data());
        }
        idx.resize({py::ssize_t(got)});
        val.resize({py::ssize_t(got)});
        return py::make_tuple(idx, val);
      },
      py::arg("grad").noconvert(), py::arg("residual").noconvert(), py::arg("k"),
      py::arg("method") = "sampled", py::arg("seed") = 0,
      "Top-k with error feedback in one pass: selects (at most) k entries of largest "
      "magnitude of grad + residual and returns (indices ascending as int32, values); "
      "`residual` becomes what was not sent and `grad` is zeroed.");
  c.def(
      "threshold_scan",
      [](FloatArray acc, float threshold, py::object grad, py::object level) {
        CLAWCOMM_ARG_CHECK(acc.writeable(), "clawcomm::threshold_scan: acc must be writable");
        const SimdLevel l = parseLevel(level);
        Candidates out;
        if (grad.is_none()) {
          py::gil_scoped_release release;
          scanInPlace(acc.mutable_data(), size_t(acc.size()), threshold, out, l);
        } else {
          // A cast would copy a strided or non-float32 array, and zero the copy.
          CLAWCOMM_ARG_CHECK(py::isinstance<FloatArray>(grad),
                             "clawcomm::threshold_scan: grad must be a C-contiguous float32 "
                             "array (it is zeroed in place), got ",
                             std::string(py::str(py::repr(grad.attr("dtype")))), " with strides ",
                             std::string(py::str(grad.attr("strides"))));
          auto g = py::cast<FloatArray>(grad);
          CLAWCOMM_ARG_CHECK(g.size() == acc.size() && g.writeable(),
                             "clawcomm::threshold_scan: grad must be writable and as long as acc");
          py::gil_scoped_release release;
          scanFold(g.mutable_data(), acc.mutable_data(), size_t(acc.size()), threshold, out, l);
        }
        return py::make_tuple(IndexArray(py::ssize_t(out.idx.size()), out.idx.data()),
                              FloatArray(py::ssize_t(out.val.size()), out.val.data()));
      },
      py::arg("acc").noconvert(), py::arg("threshold"), py::arg("grad") = py::none(),
      py::arg("level") = py::none(),
      "The pass behind top-k (compress/threshold_scan.h), for tests: entries of `acc` "
      "(or of grad + acc, folding grad into acc and zeroing grad) with magnitude >= "
      "threshold, as (indices, values); they are zeroed in `acc`.");
  c.def(
      "scatter_add",
      [](FloatArray dense, IndexArray idx, FloatArray val, float scale) {
        CLAWCOMM_ARG_CHECK(idx.size() == val.size(), "clawcomm::scatter_add: ", idx.size(),
                           " indices but ", val.size(), " values");
        CLAWCOMM_ARG_CHECK(dense.writeable(), "clawcomm::scatter_add: dense must be writable");
        py::gil_scoped_release release;
        scatterAdd(dense.mutable_data(), size_t(dense.size()), idx.data(), val.data(),
                   size_t(idx.size()), scale);
      },
      py::arg("dense").noconvert(), py::arg("idx").noconvert(), py::arg("val").noconvert(),
      py::arg("scale") = 1.0f, "dense[idx[i]] += val[i] * scale (indices are checked).");
  c.def(
      "encode_indices",
      [](IndexArray idx) {
        std::string out(maxEncodedBytes(size_t(idx.size())), '\0');
        size_t n;
        {
          py::gil_scoped_release release;
          n = encodeIndices(idx.data(), size_t(idx.size()), reinterpret_cast<uint8_t*>(&out[0]));
        }
        return py::bytes(out.data(), n);
      },
      py::arg("idx").noconvert(), "Delta + LEB128 varint bytes of ascending int32 indices.");
  c.def(
      "decode_indices",
      [](py::bytes data, size_t count) {
        const std::string s = data;
        IndexArray idx(static_cast<py::ssize_t>(count));
        {
          py::gil_scoped_release release;
          decodeIndices(reinterpret_cast<const uint8_t*>(s.data()), s.size(), idx.mutable_data(),
                        count);
        }
        return idx;
      },
      py::arg("data"), py::arg("count"), "The inverse of encode_indices.");
  c.def(
      "encode_rice",
      [](IndexArray idx) {
        const size_t count = size_t(idx.size());
        std::string out;
        size_t n;
        {
          py::gil_scoped_release release;
          const int k = riceParameter(idx.data(), count);
          out.resize(maxRiceBytes(count, k));
          n = encodeRice(idx.data(), count, k, reinterpret_cast<uint8_t*>(&out[0]));
        }
        return py::bytes(out.data(), n);
      },
      py::arg("idx").noconvert(),
      "Golomb-Rice bytes of strictly ascending int32 indices, with the parameter that makes "
      "them shortest (compress/rice.h).");
  c.def(
      "decode_rice",
      [](py::bytes data, size_t count) {
        const std::string s = data;
        IndexArray idx(static_cast<py::ssize_t>(count));
        {
          py::gil_scoped_release release;
          decodeRice(reinterpret_cast<const uint8_t*>(s.data()), s.size(), idx.mutable_data(),
                     count);
        }
        return idx;
      },
      py::arg("data"), py::arg("count"), "The inverse of encode_rice.");
  c.def(
      "encode_rans",
      [](ByteArray data) {
        const size_t n = size_t(data.size());
        std::string out(maxRansBytes(n), '\0');
        size_t len;
        {
          py::gil_scoped_release release;
          len = encodeRans(data.data(), n, reinterpret_cast<uint8_t*>(&out[0]));
        }
        return py::bytes(out.data(), len);
      },
      py::arg("data").noconvert(),
      "rANS bytes of a uint8 array, with its frequency table (compress/rans.h).");
  c.def(
      "decode_rans",
      [](ByteArray data, size_t count) {
        ByteArray out(static_cast<py::ssize_t>(count));
        {
          py::gil_scoped_release release;
          decodeRans(data.data(), size_t(data.size()), out.mutable_data(), count);
        }
        return out;
      },
      py::arg("data").noconvert(), py::arg("count"),
      "The inverse of encode_rans: `count` bytes from a uint8 array.");
}

}  // namespace clawcomm
