// Element-wise reductions and 16-bit conversions on the GPU: the CUDA side of
// reduce/reduce_kernels.h, with the same per-element math (reduce/ops.h,
// reduce/half.h), so every result has the CPU kernels' bits.
//
// The kernels are grid-stride loops. Where both pointers are 16-byte aligned
// each thread moves one 16-byte vector per step (the widest load a thread
// can issue), else one element; the tail after the last whole vector is done
// element by element. They are memory-bound: bench/ measures them against a
// device-to-device copy of the same bytes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "reduce/ops.h"

namespace clawcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// dst[i] = f(dst[i], src[i]) with N elements per step.
template <typename T, int N, typename F>
__global__ void binaryKernel(T* __restrict__ dst, const T* __restrict__ src, size_t n, F f) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t vectors = n / N;
  auto* d = reinterpret_cast<Vec<T, N>*>(dst);
  const auto* s = reinterpret_cast<const Vec<T, N>*>(src);
  for (size_t i = first; i < vectors; i += stride) {
    Vec<T, N> a = d[i];
    const Vec<T, N> b = s[i];
#pragma unroll
    for (int j = 0; j < N; ++j) a.v[j] = f(a.v[j], b.v[j]);
    d[i] = a;
  }
  for (size_t i = vectors * N + first; i < n; i += stride) dst[i] = f(dst[i], src[i]);
}

// out[i] = f(i) for one element per step: the conversions, whose input and
// output widths differ.
template <typename F>
__global__ void indexKernel(size_t n, F f) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <typename Op>
struct Apply {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return Op::template apply<T>(a, b);
  }
};

template <typename Op, bool kHalf>
struct Apply16 {
  __device__ uint16_t operator()(uint16_t a, uint16_t b) const {
    return ops::apply16<Op, kHalf>(a, b);
  }
};

bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

template <typename T, typename F>
void launchBinary(void* dst, const void* src, size_t n, F f, Stream stream) {
  if (n == 0) return;
  constexpr int N = 16 / sizeof(T);
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  if (aligned16(dst, src)) {
    binaryKernel<T, N><<<gridFor(n / N + 1, kThreads), kThreads, 0, asStream(stream)>>>(d, s, n, f);
  } else {
    binaryKernel<T, 1><<<gridFor(n, kThreads), kThreads, 0, asStream(stream)>>>(d, s, n, f);
  }
  CLAWCOMM_CUDA_LAUNCHED();
}

template <typename Op>
void arith(DataType type, void* dst, const void* src, size_t n, Stream s) {
  switch (type) {
    case DataType::kFloat32: return launchBinary<float>(dst, src, n, Apply<Op>(), s);
    case DataType::kFloat64: return launchBinary<double>(dst, src, n, Apply<Op>(), s);
    case DataType::kInt8: return launchBinary<int8_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kUInt8: return launchBinary<uint8_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kInt32: return launchBinary<int32_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kInt64: return launchBinary<int64_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kFloat16: return launchBinary<uint16_t>(dst, src, n, Apply16<Op, true>(), s);
    case DataType::kBFloat16: return launchBinary<uint16_t>(dst, src, n, Apply16<Op, false>(), s);
    default: CLAWCOMM_CHECK(false, "unexpected dtype ", dataTypeName(type));
  }
}

template <typename Op>
void bitwise(DataType type, void* dst, const void* src, size_t n, Stream s) {
  switch (type) {
    case DataType::kInt8: return launchBinary<int8_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kUInt8:
    case DataType::kBool: return launchBinary<uint8_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kInt32: return launchBinary<int32_t>(dst, src, n, Apply<Op>(), s);
    case DataType::kInt64: return launchBinary<int64_t>(dst, src, n, Apply<Op>(), s);
    default: CLAWCOMM_CHECK(false, "bitwise op on ", dataTypeName(type));
  }
}

void checkWire(const char* op, DataType wire) {
  CLAWCOMM_ARG_CHECK(wire == DataType::kFloat16 || wire == DataType::kBFloat16,
                     "clawcomm::cuda::", op, ": the wire format must be float16 or bfloat16, not ",
                     dataTypeName(wire));
}

template <typename F>
void launchIndex(size_t n, F f, Stream stream) {
  if (n == 0) return;
  indexKernel<<<gridFor(n, kThreads), kThreads, 0, asStream(stream)>>>(n, f);
  CLAWCOMM_CUDA_LAUNCHED();
}

template <bool kHalf>
void toFloat32Of(const uint16_t* s, float* d, size_t n, float scale, Stream st) {
  launchIndex(n, [=] __device__(size_t i) { d[i] = widen16<kHalf>(s[i]) * scale; }, st);
}
template <bool kHalf>
void fromFloat32Of(const float* s, uint16_t* d, size_t n, float scale, Stream st) {
  launchIndex(n, [=] __device__(size_t i) { d[i] = ops::encode16<kHalf>(s[i], scale); }, st);
}
template <bool kHalf>
void addFrom16Of(float* d, const uint16_t* s, size_t n, float dstScale, Stream st) {
  launchIndex(
      n, [=] __device__(size_t i) { d[i] = ops::decodeAdd16<kHalf>(d[i], s[i], dstScale); }, st);
}
template <bool kHalf>
void addFrom16AndRoundOf(float* d, const uint16_t* s, uint16_t* out, size_t n, float dstScale,
                         float outScale, Stream st) {
  launchIndex(
      n,
      [=] __device__(size_t i) {
        const uint16_t h = round16<kHalf>(ops::decodeAdd16<kHalf>(d[i], s[i], dstScale));
        out[i] = h;
        d[i] = widen16<kHalf>(h) * outScale;
      },
      st);
}

}  // namespace

int gridFor(size_t work, int threads) {
  static int sms[64] = {0};
  int device = 0;
  CLAWCOMM_CUDA_CHECK(cudaGetDevice(&device));
  int& count = sms[device & 63];
  if (count == 0) {
    CLAWCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  }
  const size_t want = (work + threads - 1) / threads;
  return int(std::max<size_t>(1, std::min<size_t>(want, size_t(count) * 8)));
}

void reduceInto(DataType type, ReduceOp op, void* dst, const void* src, size_t n, Stream s) {
  CLAWCOMM_ARG_CHECK(reduceOpSupported(type, op), "clawcomm::cuda::reduce: ", reduceOpName(op),
                     " is not defined on ", dataTypeName(type));
  if (type == DataType::kBool) op = ops::boolOp(op);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return arith<ops::Sum>(type, dst, src, n, s);
    case ReduceOp::kProduct: return arith<ops::Prod>(type, dst, src, n, s);
    case ReduceOp::kMin: return arith<ops::Min>(type, dst, src, n, s);
    case ReduceOp::kMax: return arith<ops::Max>(type, dst, src, n, s);
    case ReduceOp::kBand: return bitwise<ops::Band>(type, dst, src, n, s);
    case ReduceOp::kBor: return bitwise<ops::Bor>(type, dst, src, n, s);
    case ReduceOp::kBxor: return bitwise<ops::Bxor>(type, dst, src, n, s);
    default: CLAWCOMM_CHECK(false, "unexpected reduce op ", int(op));
  }
}

void divideInPlace(DataType type, void* buf, size_t n, double divisor, Stream s) {
  switch (type) {
    case DataType::kFloat32: {
      float* b = static_cast<float*>(buf);
      const float d = float(divisor);
      return launchIndex(n, [=] __device__(size_t i) { b[i] /= d; }, s);
    }
    case DataType::kFloat64: {
      double* b = static_cast<double*>(buf);
      return launchIndex(n, [=] __device__(size_t i) { b[i] /= divisor; }, s);
    }
    case DataType::kFloat16: {
      uint16_t* b = static_cast<uint16_t*>(buf);
      const float d = float(divisor);
      return launchIndex(
          n, [=] __device__(size_t i) { b[i] = floatToHalf(halfToFloat(b[i]) / d); }, s);
    }
    case DataType::kBFloat16: {
      uint16_t* b = static_cast<uint16_t*>(buf);
      const float d = float(divisor);
      return launchIndex(
          n, [=] __device__(size_t i) { b[i] = floatToBf16(bf16ToFloat(b[i]) / d); }, s);
    }
    default:
      CLAWCOMM_ARG_CHECK(false, "clawcomm::cuda::divide: ", dataTypeName(type),
                         " is not a floating-point type");
  }
}

void toFloat32(DataType wire, const void* src, float* dst, size_t n, float scale, Stream s) {
  checkWire("to_float32", wire);
  const auto* h = static_cast<const uint16_t*>(src);
  wire == DataType::kFloat16 ? toFloat32Of<true>(h, dst, n, scale, s)
                             : toFloat32Of<false>(h, dst, n, scale, s);
}

void fromFloat32(DataType wire, const float* src, void* dst, size_t n, float scale, Stream s) {
  checkWire("from_float32", wire);
  auto* h = static_cast<uint16_t*>(dst);
  wire == DataType::kFloat16 ? fromFloat32Of<true>(src, h, n, scale, s)
                             : fromFloat32Of<false>(src, h, n, scale, s);
}

void addFrom16(DataType wire, float* dst, const void* src, size_t n, float dstScale, Stream s) {
  checkWire("add_from16", wire);
  const auto* h = static_cast<const uint16_t*>(src);
  wire == DataType::kFloat16 ? addFrom16Of<true>(dst, h, n, dstScale, s)
                             : addFrom16Of<false>(dst, h, n, dstScale, s);
}

void addFrom16AndRound(DataType wire, float* dst, const void* src, void* out, size_t n,
                       float dstScale, float outScale, Stream s) {
  checkWire("add_from16_and_round", wire);
  const auto* h = static_cast<const uint16_t*>(src);
  auto* o = static_cast<uint16_t*>(out);
  wire == DataType::kFloat16 ? addFrom16AndRoundOf<true>(dst, h, o, n, dstScale, outScale, s)
                             : addFrom16AndRoundOf<false>(dst, h, o, n, dstScale, outScale, s);
}

}  // namespace cuda
}  // namespace clawcomm
