// The one pass behind top-k selection: find every entry whose magnitude
// reaches a threshold, append it to a candidate list, and leave a zero in
// its place. Built for three SIMD levels (portable, AVX2, AVX-512, chosen
// like the reduction kernels: reduce/reduce_kernels.h); the pass is
// memory-bound, and the vector builds keep it at the speed of memory where a
// scalar loop over the hits does not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reduce/reduce_kernels.h"

namespace clawcomm {

// Entries in ascending index order.
struct Candidates {
  std::vector<int32_t> idx;
  std::vector<float> val;
};

// `threshold` must not be negative. Both scans run at the active SIMD level
// unless told otherwise (tests compare the levels); an explicit level this
// CPU lacks throws InvalidArgument.

// In place: every entry of `acc` with |acc[i]| >= threshold is appended to
// `out` and set to zero. Entries below it are only read.
void scanInPlace(float* acc, size_t n, float threshold, Candidates& out,
                 SimdLevel level = activeSimdLevel());

// Error feedback folded into the scan: acc = grad + residual; entries with
// |acc| >= threshold are appended to `out` and leave a zero residual, the
// others are stored as the new residual; `grad` is zeroed. Reads both arrays
// once and writes each once. `grad` and `residual` must not overlap.
void scanFold(float* grad, float* residual, size_t n, float threshold, Candidates& out,
              SimdLevel level = activeSimdLevel());

}  // namespace clawcomm
