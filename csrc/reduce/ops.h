// The reduction operators, one element at a time, shared by the CPU kernels
// (reduce/kernel_loops.h) and the CUDA kernels (cuda/reduce_kernels.cu).
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/hd.h"
#include "reduce/half.h"

namespace clawcomm {
namespace ops {

struct Sum {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return a + b;
  }
};
struct Prod {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return a * b;
  }
};
// NaN: `b < a` is false, so a NaN already in `a` stays and a NaN in `b` is
// dropped, on every device alike.
struct Min {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return b < a ? b : a;
  }
};
struct Max {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return a < b ? b : a;
  }
};
struct Band {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return a & b;
  }
};
struct Bor {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return a | b;
  }
};
struct Bxor {
  template <typename T>
  static CLAWCOMM_HD T apply(T a, T b) {
    return a ^ b;
  }
};

// float16 and bfloat16 reduce in float32 and round once.
template <typename Op, bool kHalf>
CLAWCOMM_HD uint16_t apply16(uint16_t a, uint16_t b) {
  return round16<kHalf>(Op::template apply<float>(widen16<kHalf>(a), widen16<kHalf>(b)));
}

// The operator a bool reduction really is: sum and max are "any", product
// and min "all".
inline ReduceOp boolOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax: return ReduceOp::kBor;
    case ReduceOp::kProduct:
    case ReduceOp::kMin: return ReduceOp::kBand;
    default: return op;
  }
}

// The 16-bit wire (algorithms/ring_all_reduce_16bit.cc), one element:
// encode x * scale; decode-and-add dst * dstScale + widen(h).
template <bool kHalf>
CLAWCOMM_HD uint16_t encode16(float x, float scale) {
  return round16<kHalf>(x * scale);
}
template <bool kHalf>
CLAWCOMM_HD float decodeAdd16(float dst, uint16_t h, float dstScale) {
  return dst * dstScale + widen16<kHalf>(h);
}

// Error feedback with a 16-bit payload, one element: the value to send is
// acc = grad + residual; the payload is round16(acc * scale), and the new
// residual is what the payload misses, acc - widen(payload) / scale, so that
// sent + kept equals acc up to one float32 rounding.
template <bool kHalf>
struct Feedback16 {
  uint16_t payload;
  float residual;
};
template <bool kHalf>
CLAWCOMM_HD Feedback16<kHalf> feedback16(float grad, float residual, float scale,
                                         float inverseScale) {
  const float acc = grad + residual;
  const uint16_t q = round16<kHalf>(acc * scale);
  return {q, acc - widen16<kHalf>(q) * inverseScale};
}

}  // namespace ops
}  // namespace clawcomm
