// 16-bit compression with error feedback, in one pass over the data.
//
// For each element: acc = grad + residual; the payload is acc * scale
// rounded to float16 or bfloat16 (nearest even); the new residual is what
// the payload misses, acc - widen(payload) / scale. Reads grad and residual
// once, writes residual and the payload once: the least traffic error
// feedback allows. The per-element math is reduce/ops.h's feedback16, which
// the CUDA kernel (cuda/compress_kernels.cu) shares, so both give the same
// bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace clawcomm {

// `wire` is kFloat16 or kBFloat16; `scale` must be finite and non-zero.
// `grad` may alias `residual` (then the residual is fed back into itself).
void encode16WithFeedback(DataType wire, const float* grad, float* residual, uint16_t* payload,
                          size_t n, float scale);

}  // namespace clawcomm
