// Element-wise reduction kernels: dst[i] = dst[i] (op) src[i].
//
// float16 and bfloat16 are widened to float32, combined, and rounded once per
// call, so every reduction step accumulates in float32. AVG reduces as SUM;
// the collective divides by the world size once at the end (divideInPlace).
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace clawcomm {

void reduceInto(DataType type, ReduceOp op, void* dst, const void* src, size_t count);

// dst[i] = dst[i] / divisor, for AVG. Floating point types only.
void divideInPlace(DataType type, void* dst, size_t count, double divisor);

}  // namespace clawcomm
