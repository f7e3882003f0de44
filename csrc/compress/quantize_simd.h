// The block quantiser's vector encoder (compress/quantize_avx2.cc), which
// quantizeBlocks (compress/quantize.cc) calls at the AVX2 and AVX-512 levels.
// Same arguments and contract as quantizeBlocks, checked by it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "compress/quantize.h"

namespace clawcomm {

void quantizeBlocksAvx2(const QuantizeSpec& spec, const float* x, float* residual, size_t n,
                        uint64_t seed, uint8_t* codes, float* scales);

}  // namespace clawcomm
