// Sparsification kernels for gradient compression: top-k selection with
// error feedback, and the scatter-add that turns gathered (index, value)
// pairs back into a dense sum.
//
// The interface is plain pointers and counts, the same for every device; a
// CUDA build adds launchers with these signatures.
#pragma once

#include <cstddef>
#include <cstdint>

namespace clawcomm {

// Both selections write the chosen entries' indices (ascending) and values,
// and set those entries of `acc` to zero: what was sent plus what is left in
// `acc` equals what `acc` held, which is error feedback's invariant.
//
// Exactly the min(k, n) entries of largest magnitude (ties broken by lower
// index). O(n) expected time (nth_element over a copy of |acc|).
size_t topkExact(float* acc, size_t n, size_t k, int32_t* idx, float* val);

// Deep Gradient Compression's sampled threshold: the magnitude that k/n of a
// random sample of |acc| exceeds; every entry at or above it is a candidate,
// and if more than k qualify the k largest of them are kept. Returns how many
// were selected (at most k; fewer when the sample's threshold was high). One
// pass over `acc` plus work proportional to the sample and the candidates.
size_t topkSampled(float* acc, size_t n, size_t k, uint64_t seed, int32_t* idx, float* val);

enum class TopkSelection { kExact, kSampled };

// Top-k with error feedback in one pass over the data: the entries of
// acc = grad + residual are selected as above (exactly, or by a sampled
// threshold read from grad + residual at the sample positions), the rest of
// acc becomes the new `residual`, and `grad` is zeroed, ready to receive the
// sparse sum. Reads grad and residual once and writes each once, where
// adding, selecting and zeroing separately takes three passes more.
size_t topkWithFeedback(float* grad, float* residual, size_t n, size_t k, TopkSelection selection,
                        uint64_t seed, int32_t* idx, float* val);

// dense[idx[i]] += val[i] * scale. Throws InvalidArgument on an index outside
// [0, n).
void scatterAdd(float* dense, size_t n, const int32_t* idx, const float* val, size_t m,
                float scale = 1.0f);

}  // namespace clawcomm
