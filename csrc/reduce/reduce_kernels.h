// Element-wise kernels: reduction (dst[i] = dst[i] op src[i]) and
// float16/bfloat16 <-> float32 conversion.
//
// float16 and bfloat16 are widened to float32, combined, and rounded once per
// call, so every reduction step accumulates in float32. AVG reduces as SUM;
// the collective divides by the world size once at the end (divideInPlace).
//
// Each kernel is compiled three times (portable, AVX2+F16C, AVX-512) and the
// best one the CPU supports is picked at run time (CLAWCOMM_SIMD can force a
// lower one). Every variant computes the same element-wise operations in
// the same order, so results are bit-identical whichever runs.
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace clawcomm {

enum class SimdLevel { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

const char* simdLevelName(SimdLevel level);
// The best level this CPU supports.
SimdLevel detectSimdLevel();
// What the kernels below use: detectSimdLevel(), capped by CLAWCOMM_SIMD.
SimdLevel activeSimdLevel();

void reduceInto(DataType type, ReduceOp op, void* dst, const void* src, size_t count);

// 16-bit floats (kFloat16 or kBFloat16) to and from float32, rounding to
// nearest even, with an optional factor applied in float32 on the way:
// dst[i] = float32(src[i]) * scale, and dst[i] = round16(src[i] * scale).
void toFloat32(DataType type, const void* src, float* dst, size_t count, float scale = 1.0f);
void fromFloat32(DataType type, const float* src, void* dst, size_t count, float scale = 1.0f);

// dst[i] = dst[i] * dstScale + float32(src[i]) for 16-bit `src` (kFloat16 or
// kBFloat16): decoding, scaling and accumulating in one pass.
void addFrom16(DataType type, float* dst, const void* src, size_t count, float dstScale = 1.0f);

// addFrom16, then out[i] = round16(dst[i]) and dst[i] = float32(out[i]) *
// outScale, in the same pass: the 16-bit ring's last reduce-scatter step,
// which finishes this rank's chunk and encodes what it will send of it.
void addFrom16AndRound(DataType type, float* dst, const void* src, void* out, size_t count,
                       float dstScale, float outScale);

// The same kernels at an explicit level (for tests and micro-benchmarks);
// throws InvalidArgument if this CPU lacks it.
void reduceIntoAt(SimdLevel level, DataType type, ReduceOp op, void* dst, const void* src,
                  size_t count);
void toFloat32At(SimdLevel level, DataType type, const void* src, float* dst, size_t count,
                 float scale = 1.0f);
void fromFloat32At(SimdLevel level, DataType type, const float* src, void* dst, size_t count,
                   float scale = 1.0f);
void addFrom16At(SimdLevel level, DataType type, float* dst, const void* src, size_t count,
                 float dstScale = 1.0f);
void addFrom16AndRoundAt(SimdLevel level, DataType type, float* dst, const void* src, void* out,
                         size_t count, float dstScale, float outScale);

// dst[i] = dst[i] / divisor, for AVG. Floating point types only.
void divideInPlace(DataType type, void* dst, size_t count, double divisor);

}  // namespace clawcomm
