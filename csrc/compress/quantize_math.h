// The per-value arithmetic of block quantisation (compress/quantize.h),
// shared by the CPU kernels (compress/quantize.cc) and the CUDA ones
// (cuda/quantize_kernels.cu), so both give the same codes, scales and
// residuals for the same seed, and the CPU suite covers the math the GPU
// runs.
//
// The scale of a block is reduced in kScaleLanes partial results, lane l
// taking values l, l + 8, l + 16, ... in order, then lanes 0..7 in order:
// the order the CPU's vector loop adds in, which a GPU reproduces exactly.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/hd.h"
#include "compress/quantize.h"

namespace clawcomm {
namespace quant {

constexpr int kScaleLanes = 8;

CLAWCOMM_HD uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The base of block b's random stream for `seed`.
CLAWCOMM_HD uint32_t blockBase(uint64_t seed, uint64_t b) {
  return uint32_t(splitmix64(seed ^ splitmix64(b)));
}

// A uniform in [0, 1) for counter i of a block's stream: lowbias32 (Chris
// Wellons' integer hash) of base + i. A pure function of the counter, so a
// CPU loop over a block vectorises and GPU threads draw independently.
CLAWCOMM_HD float uniformAt(uint32_t base, uint32_t i) {
  uint32_t x = base + i;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return float(x >> 8) * (1.0f / 16777216.0f);
}

// std::max / std::min's exact semantics, usable on the device.
CLAWCOMM_HD float maxOf(float a, float b) {
  return a < b ? b : a;
}
CLAWCOMM_HD float minOf(float a, float b) {
  return b < a ? b : a;
}

// The largest level q: codes are v in [-q, q] (a sign, for 1 bit).
CLAWCOMM_HD int levelsOf(int bits) {
  return bits == 1 ? 1 : (1 << (bits - 1)) - 1;
}

// One value into a lane's partial: the largest magnitude, the sum of squares
// or the sum of magnitudes.
CLAWCOMM_HD float addToScale(BlockScale kind, float part, float a) {
  return kind == BlockScale::kMax  ? maxOf(part, fabsf(a))
         : kind == BlockScale::kL2 ? part + a * a
                                   : part + fabsf(a);
}

// Two lanes' partials into one (lanes combined 0..7 in order).
CLAWCOMM_HD float combineScale(BlockScale kind, float total, float part) {
  return kind == BlockScale::kMax ? maxOf(total, part) : total + part;
}

// The block's scale from the combined partials.
CLAWCOMM_HD float finishScale(BlockScale kind, int bits, float total, size_t block) {
  if (kind == BlockScale::kMeanAbs) return total / float(block);
  const float q = float(levelsOf(bits));
  return (kind == BlockScale::kL2 ? sqrtf(total) : total) / q;
}

CLAWCOMM_HD float inverseOf(float scale) {
  return scale > 0.0f ? 1.0f / scale : 0.0f;
}

// The stored code of a (v + 2^(bits-1); the sign bit for 1 bit) and the
// value it decodes to. The level of y = a / scale is floor(y + u) (u
// uniform: unbiased; 0.5: to nearest) clamped to [-q, q], computed as a
// truncation of y + u + q, which is then never negative.
template <int kBits>
CLAWCOMM_HD uint8_t encodeValue(float a, float scale, float inverse, float u, float* decoded) {
  if constexpr (kBits == 1) {
    *decoded = a >= 0.0f ? scale : -scale;
    return a >= 0.0f ? 1 : 0;
  } else {
    constexpr int q = (1 << (kBits - 1)) - 1;
    const float t = minOf(maxOf(a * inverse + u + float(q), 0.0f), float(2 * q));
    const int l = int(t);  // floor: t >= 0
    *decoded = float(l - q) * scale;
    return uint8_t(l + 1);
  }
}

// What code c (as stored) decodes to, with s = scale * alpha.
template <int kBits>
CLAWCOMM_HD float decodeValue(int c, float s) {
  constexpr int offset = kBits == 1 ? 0 : 1 << (kBits - 1);
  return kBits == 1 ? float(2 * c - 1) * s : float(c - offset) * s;
}

}  // namespace quant
}  // namespace clawcomm
