// The loops behind reduce_kernels.cc, written once as always-inline templates
// so that each SIMD variant (a function compiled with its own target
// attribute) inlines and vectorises them for its instruction set.
//
// `Cvt` supplies the 16-bit <-> float32 block conversions for one level:
// plain integer code (which vectorises anywhere) or F16C / AVX-512 intrinsics.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/dtype.h"
#include "common/errors.h"
#include "reduce/half.h"
#include "reduce/ops.h"

#define CLAWCOMM_INLINE inline __attribute__((always_inline))

namespace clawcomm {
namespace kernels {

using ops::Band;
using ops::Bor;
using ops::Bxor;
using ops::Max;
using ops::Min;
using ops::Prod;
using ops::Sum;

// Portable conversions: integer bit tricks, vectorised by the compiler.
struct PortableCvt {
  static CLAWCOMM_INLINE void halfToFloat(const uint16_t* __restrict s, float* __restrict d,
                                          size_t n) {
    for (size_t i = 0; i < n; ++i) d[i] = clawcomm::halfToFloat(s[i]);
  }
  static CLAWCOMM_INLINE void floatToHalf(const float* __restrict s, uint16_t* __restrict d,
                                          size_t n) {
    for (size_t i = 0; i < n; ++i) d[i] = clawcomm::floatToHalf(s[i]);
  }
};

CLAWCOMM_INLINE void bf16ToFloatBlock(const uint16_t* __restrict s, float* __restrict d, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = bf16ToFloat(s[i]);
}
CLAWCOMM_INLINE void floatToBf16Block(const float* __restrict s, uint16_t* __restrict d, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = floatToBf16(s[i]);
}

template <typename T, typename Op>
CLAWCOMM_INLINE void loop(void* dstv, const void* srcv, size_t n) {
  T* __restrict dst = static_cast<T*>(dstv);
  const T* __restrict src = static_cast<const T*>(srcv);
  for (size_t i = 0; i < n; ++i) dst[i] = Op::template apply<T>(dst[i], src[i]);
}

// 16-bit floats: widen a block to float32, combine, round back. Blocks keep
// the temporaries in L1.
template <typename Op, typename Cvt, bool kHalf>
CLAWCOMM_INLINE void loop16(void* dstv, const void* srcv, size_t n) {
  uint16_t* dst = static_cast<uint16_t*>(dstv);
  const uint16_t* src = static_cast<const uint16_t*>(srcv);
  constexpr size_t kBlock = 512;
  alignas(64) float a[kBlock];
  alignas(64) float b[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    if (kHalf) {
      Cvt::halfToFloat(dst + base, a, m);
      Cvt::halfToFloat(src + base, b, m);
    } else {
      bf16ToFloatBlock(dst + base, a, m);
      bf16ToFloatBlock(src + base, b, m);
    }
    for (size_t i = 0; i < m; ++i) a[i] = Op::template apply<float>(a[i], b[i]);
    if (kHalf) {
      Cvt::floatToHalf(a, dst + base, m);
    } else {
      floatToBf16Block(a, dst + base, m);
    }
  }
}

template <typename Op, typename Cvt>
CLAWCOMM_INLINE void arith(DataType type, void* dst, const void* src, size_t n) {
  switch (type) {
    case DataType::kFloat32: return loop<float, Op>(dst, src, n);
    case DataType::kFloat64: return loop<double, Op>(dst, src, n);
    case DataType::kInt8: return loop<int8_t, Op>(dst, src, n);
    case DataType::kUInt8: return loop<uint8_t, Op>(dst, src, n);
    case DataType::kInt32: return loop<int32_t, Op>(dst, src, n);
    case DataType::kInt64: return loop<int64_t, Op>(dst, src, n);
    case DataType::kFloat16: return loop16<Op, Cvt, true>(dst, src, n);
    case DataType::kBFloat16: return loop16<Op, Cvt, false>(dst, src, n);
    default: CLAWCOMM_CHECK(false, "unexpected dtype ", dataTypeName(type));
  }
}

template <typename Op>
CLAWCOMM_INLINE void bitwise(DataType type, void* dst, const void* src, size_t n) {
  switch (type) {
    case DataType::kInt8: return loop<int8_t, Op>(dst, src, n);
    case DataType::kUInt8:
    case DataType::kBool: return loop<uint8_t, Op>(dst, src, n);
    case DataType::kInt32: return loop<int32_t, Op>(dst, src, n);
    case DataType::kInt64: return loop<int64_t, Op>(dst, src, n);
    default: CLAWCOMM_CHECK(false, "bitwise op on ", dataTypeName(type));
  }
}

// Bool is stored as one byte holding 0 or 1: SUM and MAX are OR, PRODUCT and
// MIN are AND, which keeps results 0 or 1 as torch does.
template <typename Cvt>
CLAWCOMM_INLINE void reduce(DataType type, ReduceOp op, void* dst, const void* src, size_t n) {
  if (type == DataType::kBool) {
    switch (ops::boolOp(op)) {
      case ReduceOp::kBor: return loop<uint8_t, Bor>(dst, src, n);
      case ReduceOp::kBand: return loop<uint8_t, Band>(dst, src, n);
      case ReduceOp::kBxor: return loop<uint8_t, Bxor>(dst, src, n);
      default: CLAWCOMM_CHECK(false, "op ", reduceOpName(op), " on bool");
    }
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return arith<Sum, Cvt>(type, dst, src, n);
    case ReduceOp::kProduct: return arith<Prod, Cvt>(type, dst, src, n);
    case ReduceOp::kMin: return arith<Min, Cvt>(type, dst, src, n);
    case ReduceOp::kMax: return arith<Max, Cvt>(type, dst, src, n);
    case ReduceOp::kBand: return bitwise<Band>(type, dst, src, n);
    case ReduceOp::kBor: return bitwise<Bor>(type, dst, src, n);
    case ReduceOp::kBxor: return bitwise<Bxor>(type, dst, src, n);
    default: CLAWCOMM_CHECK(false, "unexpected reduce op ", int(op));
  }
}

template <typename Cvt>
CLAWCOMM_INLINE void toFloat(DataType type, const void* src, float* dst, size_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (type == DataType::kFloat16) return Cvt::halfToFloat(s, dst, n);
  CLAWCOMM_CHECK(type == DataType::kBFloat16, "toFloat32 of ", dataTypeName(type));
  bf16ToFloatBlock(s, dst, n);
}

template <typename Cvt>
CLAWCOMM_INLINE void fromFloat(DataType type, const float* src, void* dst, size_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (type == DataType::kFloat16) return Cvt::floatToHalf(src, d, n);
  CLAWCOMM_CHECK(type == DataType::kBFloat16, "fromFloat32 to ", dataTypeName(type));
  floatToBf16Block(src, d, n);
}

// The scaled conversions work through an L1-sized block, so scaling costs no
// pass over memory of its own. Products and sums are rounded one at a time
// (the extension builds with -ffp-contract=off: no fused multiply-add), so
// every SIMD level gives the same bits.
constexpr size_t kBlock = 512;

// dst[i] = widen(src[i]) * scale.
template <typename Cvt>
CLAWCOMM_INLINE void toFloatScaled(DataType type, const void* src, float* dst, size_t n,
                                   float scale) {
  if (scale == 1.0f) return toFloat<Cvt>(type, src, dst, n);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    float* __restrict d = dst + base;
    toFloat<Cvt>(type, s + base, d, m);
    for (size_t i = 0; i < m; ++i) d[i] *= scale;
  }
}

// dst[i] = round16(src[i] * scale).
template <typename Cvt>
CLAWCOMM_INLINE void fromFloatScaled(DataType type, const float* src, void* dst, size_t n,
                                     float scale) {
  if (scale == 1.0f) return fromFloat<Cvt>(type, src, dst, n);
  uint16_t* d = static_cast<uint16_t*>(dst);
  alignas(64) float b[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    const float* __restrict s = src + base;
    for (size_t i = 0; i < m; ++i) b[i] = s[i] * scale;
    fromFloat<Cvt>(type, b, d + base, m);
  }
}

// dst[i] = dst[i] * dstScale + widen(src[i]) for 16-bit src, through an
// L1-sized float block: decoding, scaling and accumulating are one pass
// over memory.
template <typename Cvt>
CLAWCOMM_INLINE void addFrom16(DataType type, float* dst, const void* src, size_t n,
                               float dstScale) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  alignas(64) float b[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    toFloat<Cvt>(type, s + base, b, m);
    float* __restrict d = dst + base;
    if (dstScale == 1.0f) {
      for (size_t i = 0; i < m; ++i) d[i] += b[i];
    } else {
      for (size_t i = 0; i < m; ++i) d[i] = d[i] * dstScale + b[i];
    }
  }
}

// The last reduce-scatter step of the 16-bit ring, in one pass:
// dst[i] = dst[i] * dstScale + widen(src[i]); out[i] = round16(dst[i]);
// dst[i] = widen(out[i]) * outScale. `out` is what this rank will send of
// its finished chunk, and dst keeps exactly the values the others decode.
template <typename Cvt>
CLAWCOMM_INLINE void addFrom16AndRound(DataType type, float* dst, const void* src, void* out,
                                       size_t n, float dstScale, float outScale) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* o = static_cast<uint16_t*>(out);
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    addFrom16<Cvt>(type, dst + base, s + base, m, dstScale);
    fromFloat<Cvt>(type, dst + base, o + base, m);
    toFloatScaled<Cvt>(type, o + base, dst + base, m, outScale);
  }
}

}  // namespace kernels
}  // namespace clawcomm
