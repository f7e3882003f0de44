#include "common/dtype.h"

namespace clawcomm {

size_t elementSize(DataType t) {
  switch (t) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool: return 1;
    default: return 0;
  }
}

const char* dataTypeName(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
    default: return "unknown-dtype";
  }
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kBand: return "band";
    case ReduceOp::kBor: return "bor";
    case ReduceOp::kBxor: return "bxor";
    default: return "unknown-op";
  }
}

bool isFloatingPoint(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

bool reduceOpSupported(DataType t, ReduceOp op) {
  if (t >= DataType::kNumTypes || op >= ReduceOp::kNumOps) return false;
  switch (op) {
    case ReduceOp::kAvg: return isFloatingPoint(t);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor: return !isFloatingPoint(t);
    default: return true;
  }
}

}  // namespace clawcomm
