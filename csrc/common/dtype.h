// Element types and reduction operators understood by the engine.
//
// The engine never sees torch types: the backend adapter maps at::ScalarType
// and c10d::ReduceOp onto these enums, so the core stays usable from numpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace clawcomm {

enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kBool,
  kNumTypes,
};

enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg,
  kProduct,
  kMin,
  kMax,
  kBand,
  kBor,
  kBxor,
  kNumOps,
};

size_t elementSize(DataType t);
const char* dataTypeName(DataType t);
const char* reduceOpName(ReduceOp op);
bool isFloatingPoint(DataType t);

// Whether `op` is defined on `t` (bitwise ops only on integers and bool,
// AVG only on floating point). Used to reject bad input before any byte moves.
bool reduceOpSupported(DataType t, ReduceOp op);

}  // namespace clawcomm
