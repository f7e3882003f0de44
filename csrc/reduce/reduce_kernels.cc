#include "reduce/reduce_kernels.h"

#include <algorithm>
#include <cstdint>

#include "common/errors.h"
#include "reduce/half.h"

namespace clawcomm {
namespace {

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    return a + b;
  }
};
struct Prod {
  template <typename T>
  static T apply(T a, T b) {
    return a * b;
  }
};
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    return b < a ? b : a;
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return a < b ? b : a;
  }
};
struct Band {
  template <typename T>
  static T apply(T a, T b) {
    return a & b;
  }
};
struct Bor {
  template <typename T>
  static T apply(T a, T b) {
    return a | b;
  }
};
struct Bxor {
  template <typename T>
  static T apply(T a, T b) {
    return a ^ b;
  }
};

// Straight loops over restrict pointers: g++ -O2/-O3 vectorises these.
template <typename T, typename Op>
void loop(void* dstv, const void* srcv, size_t n) {
  T* __restrict dst = static_cast<T*>(dstv);
  const T* __restrict src = static_cast<const T*>(srcv);
  for (size_t i = 0; i < n; ++i) dst[i] = Op::template apply<T>(dst[i], src[i]);
}

// 16-bit floats: widen a block to float32, combine, round back. Blocks keep
// the temporaries in L1.
template <typename Op, float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void loop16(void* dstv, const void* srcv, size_t n) {
  uint16_t* __restrict dst = static_cast<uint16_t*>(dstv);
  const uint16_t* __restrict src = static_cast<const uint16_t*>(srcv);
  constexpr size_t kBlock = 512;
  float a[kBlock], b[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) a[i] = ToF(dst[base + i]);
    for (size_t i = 0; i < m; ++i) b[i] = ToF(src[base + i]);
    for (size_t i = 0; i < m; ++i) a[i] = Op::template apply<float>(a[i], b[i]);
    for (size_t i = 0; i < m; ++i) dst[base + i] = FromF(a[i]);
  }
}

// Bool is stored as one byte holding 0 or 1: SUM and MAX are OR, PRODUCT and
// MIN are AND, which keeps results 0 or 1 as torch does.
template <typename Op>
void dispatchArith(DataType type, void* dst, const void* src, size_t n) {
  switch (type) {
    case DataType::kFloat32: return loop<float, Op>(dst, src, n);
    case DataType::kFloat64: return loop<double, Op>(dst, src, n);
    case DataType::kInt8: return loop<int8_t, Op>(dst, src, n);
    case DataType::kUInt8: return loop<uint8_t, Op>(dst, src, n);
    case DataType::kInt32: return loop<int32_t, Op>(dst, src, n);
    case DataType::kInt64: return loop<int64_t, Op>(dst, src, n);
    case DataType::kFloat16: return loop16<Op, halfToFloat, floatToHalf>(dst, src, n);
    case DataType::kBFloat16: return loop16<Op, bf16ToFloat, floatToBf16>(dst, src, n);
    default: CLAWCOMM_CHECK(false, "unexpected dtype ", dataTypeName(type));
  }
}

template <typename Op>
void dispatchBitwise(DataType type, void* dst, const void* src, size_t n) {
  switch (type) {
    case DataType::kInt8: return loop<int8_t, Op>(dst, src, n);
    case DataType::kUInt8:
    case DataType::kBool: return loop<uint8_t, Op>(dst, src, n);
    case DataType::kInt32: return loop<int32_t, Op>(dst, src, n);
    case DataType::kInt64: return loop<int64_t, Op>(dst, src, n);
    default: CLAWCOMM_CHECK(false, "bitwise op on ", dataTypeName(type));
  }
}

}  // namespace

void reduceInto(DataType type, ReduceOp op, void* dst, const void* src, size_t n) {
  if (n == 0) return;
  if (type == DataType::kBool) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMax:
      case ReduceOp::kBor: return loop<uint8_t, Bor>(dst, src, n);
      case ReduceOp::kProduct:
      case ReduceOp::kMin:
      case ReduceOp::kBand: return loop<uint8_t, Band>(dst, src, n);
      case ReduceOp::kBxor: return loop<uint8_t, Bxor>(dst, src, n);
      default: CLAWCOMM_CHECK(false, "op ", reduceOpName(op), " on bool");
    }
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return dispatchArith<Sum>(type, dst, src, n);
    case ReduceOp::kProduct: return dispatchArith<Prod>(type, dst, src, n);
    case ReduceOp::kMin: return dispatchArith<Min>(type, dst, src, n);
    case ReduceOp::kMax: return dispatchArith<Max>(type, dst, src, n);
    case ReduceOp::kBand: return dispatchBitwise<Band>(type, dst, src, n);
    case ReduceOp::kBor: return dispatchBitwise<Bor>(type, dst, src, n);
    case ReduceOp::kBxor: return dispatchBitwise<Bxor>(type, dst, src, n);
    default: CLAWCOMM_CHECK(false, "unexpected reduce op ", int(op));
  }
}

void divideInPlace(DataType type, void* dstv, size_t n, double divisor) {
  switch (type) {
    case DataType::kFloat32: {
      float* d = static_cast<float*>(dstv);
      const float s = float(divisor);
      for (size_t i = 0; i < n; ++i) d[i] /= s;
      return;
    }
    case DataType::kFloat64: {
      double* d = static_cast<double*>(dstv);
      for (size_t i = 0; i < n; ++i) d[i] /= divisor;
      return;
    }
    case DataType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dstv);
      for (size_t i = 0; i < n; ++i) d[i] = floatToHalf(halfToFloat(d[i]) / float(divisor));
      return;
    }
    case DataType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dstv);
      for (size_t i = 0; i < n; ++i) d[i] = floatToBf16(bf16ToFloat(d[i]) / float(divisor));
      return;
    }
    default: CLAWCOMM_CHECK(false, "AVG on ", dataTypeName(type));
  }
}

}  // namespace clawcomm
