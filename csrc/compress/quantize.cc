#include "compress/quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/errors.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {
namespace {

constexpr int kLanes = 8;

// The loops are written once and compiled three times: inlined into a
// portable entry point, an AVX2 one (float-to-byte conversion and 32-bit
// multiplies are 3x faster there) and an AVX-512 one, chosen at run time like
// the reduction kernels (reduce/reduce_kernels.h).
#define CLAWCOMM_INLINE [[gnu::always_inline]] inline
#define CLAWCOMM_TARGET_AVX2 __attribute__((target("avx2")))
#define CLAWCOMM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A uniform in [0, 1) for counter i of a block's stream: lowbias32 (Chris
// Wellons' integer hash) of base + i. A pure function of the counter, so
// the loop over a block vectorises.
CLAWCOMM_INLINE float uniformAt(uint32_t base, uint32_t i) {
  uint32_t x = base + i;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return float(x >> 8) * (1.0f / 16777216.0f);
}

// The block's scale, with eight partial sums (maxima) so the loop vectorises
// without reassociating anything the compiler may not.
template <bool kResidual>
CLAWCOMM_INLINE float blockScale(BlockScale kind, int bits, const float* x, const float* r,
                                 size_t block) {
  float part[kLanes] = {};
  for (size_t i0 = 0; i0 < block; i0 += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const size_t i = i0 + size_t(l);
      const float a = kResidual ? x[i] + r[i] : x[i];
      part[l] = kind == BlockScale::kMax  ? std::max(part[l], std::fabs(a))
                : kind == BlockScale::kL2 ? part[l] + a * a
                                          : part[l] + std::fabs(a);
    }
  }
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l)
    total = kind == BlockScale::kMax ? std::max(total, part[l]) : total + part[l];
  if (kind == BlockScale::kMeanAbs) return total / float(block);
  const float q = float((1 << (bits - 1)) - 1);
  return (kind == BlockScale::kL2 ? std::sqrt(total) : total) / q;
}

// Level v of y = a / scale is floor(y + u) (u uniform; 0.5 rounds to
// nearest), clamped to [-q, q], computed as a truncation of y + u + q, which
// is then never negative. One flat loop over the block writes a byte per
// value (it vectorises); a second packs them.
template <int kBits, bool kStochastic, bool kResidual>
CLAWCOMM_INLINE void quantizeBlock(const float* x, float* r, size_t block, float scale,
                                   uint32_t base, uint8_t* level, uint8_t* codes) {
  constexpr int q = kBits == 1 ? 1 : (1 << (kBits - 1)) - 1;
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  uint8_t* lv = kBits == 8 ? codes : level;
  for (size_t i = 0; i < block; ++i) {
    const float a = kResidual ? x[i] + r[i] : x[i];
    float decoded;
    if constexpr (kBits == 1) {
      lv[i] = a >= 0.0f ? 1 : 0;
      decoded = a >= 0.0f ? scale : -scale;
    } else {
      const float u = kStochastic ? uniformAt(base, uint32_t(i)) : 0.5f;
      const float t = std::min(std::max(a * inverse + u + float(q), 0.0f), float(2 * q));
      const int l = int(t);    // floor: t >= 0
      lv[i] = uint8_t(l + 1);  // v + 2^(bits-1), v = l - q
      decoded = float(l - q) * scale;
    }
    if constexpr (kResidual) r[i] = a - decoded;
  }
  if constexpr (kBits < 8) {
    constexpr int kPerByte = 8 / kBits;
    for (size_t b = 0; b < block / kPerByte; ++b) {
      uint32_t byte = 0;
      for (int t = 0; t < kPerByte; ++t) byte |= uint32_t(lv[b * kPerByte + t]) << (kBits * t);
      codes[b] = uint8_t(byte);
    }
  }
}

template <int kBits>
CLAWCOMM_INLINE void decodeBlock(const uint8_t* codes, float scale, size_t block, float alpha,
                                 bool accumulate, float* out) {
  constexpr int kPerByte = 8 / kBits;
  constexpr uint64_t mask = (1u << kBits) - 1;
  constexpr int offset = kBits == 1 ? 0 : 1 << (kBits - 1);
  const float s = scale * alpha;
  float v[kLanes];
  for (size_t i0 = 0; i0 < block; i0 += kLanes) {
    uint64_t packed = 0;
    for (int b = 0; b < kBits; ++b) packed |= uint64_t(codes[i0 / kPerByte + size_t(b)]) << (8 * b);
    for (int l = 0; l < kLanes; ++l) {
      const int c = int((packed >> (kBits * l)) & mask);
      v[l] = kBits == 1 ? float(2 * c - 1) * s : float(c - offset) * s;
    }
    float* o = out + i0;
    if (accumulate) {
      for (int l = 0; l < kLanes; ++l) o[l] += v[l];
    } else {
      for (int l = 0; l < kLanes; ++l) o[l] = v[l];
    }
  }
}

template <int kBits>
CLAWCOMM_INLINE void quantizeAll(const QuantizeSpec& spec, const float* x, float* r, size_t n,
                                 uint64_t seed, uint8_t* codes, float* scales) {
  const size_t block = spec.block;
  const size_t bytes = block * kBits / 8;
  std::vector<uint8_t> level(block);
  for (size_t b = 0; b * block < n; ++b) {
    const float* xb = x + b * block;
    float* rb = r ? r + b * block : nullptr;
    const float scale = rb ? blockScale<true>(spec.scale, kBits, xb, rb, block)
                           : blockScale<false>(spec.scale, kBits, xb, rb, block);
    scales[b] = scale;
    const auto base = uint32_t(splitmix64(seed ^ splitmix64(b)));
    uint8_t* cb = codes + b * bytes;
    uint8_t* lv = level.data();
    if (spec.stochastic) {
      rb ? quantizeBlock<kBits, true, true>(xb, rb, block, scale, base, lv, cb)
         : quantizeBlock<kBits, true, false>(xb, rb, block, scale, base, lv, cb);
    } else {
      rb ? quantizeBlock<kBits, false, true>(xb, rb, block, scale, base, lv, cb)
         : quantizeBlock<kBits, false, false>(xb, rb, block, scale, base, lv, cb);
    }
  }
}

template <int kBits>
CLAWCOMM_INLINE void dequantizeAll(const QuantizeSpec& spec, const uint8_t* codes,
                                   const float* scales, size_t n, float alpha, bool accumulate,
                                   float* out) {
  const size_t block = spec.block;
  const size_t bytes = block * kBits / 8;
  for (size_t b = 0; b * block < n; ++b) {
    decodeBlock<kBits>(codes + b * bytes, scales[b], block, alpha, accumulate, out + b * block);
  }
}

}  // namespace

void checkQuantizeSpec(const QuantizeSpec& spec, const char* op) {
  CLAWCOMM_ARG_CHECK(spec.bits == 1 || spec.bits == 2 || spec.bits == 4 || spec.bits == 8,
                     "clawcomm::", op, ": bits ", spec.bits, " is not 1, 2, 4 or 8");
  CLAWCOMM_ARG_CHECK(spec.block >= 8 && spec.block % 8 == 0, "clawcomm::", op, ": block ",
                     spec.block, " is not a positive multiple of 8");
  CLAWCOMM_ARG_CHECK((spec.bits == 1) == (spec.scale == BlockScale::kMeanAbs), "clawcomm::", op,
                     ": 1-bit codes (signs) go with the mean-magnitude scale, and only they");
}

size_t packedBytes(const QuantizeSpec& spec, size_t n) {
  return n * size_t(spec.bits) / 8;
}

template <typename... Args>
CLAWCOMM_INLINE void quantizeAny(int bits, Args... args) {
  switch (bits) {
    case 1: return quantizeAll<1>(args...);
    case 2: return quantizeAll<2>(args...);
    case 4: return quantizeAll<4>(args...);
    default: return quantizeAll<8>(args...);
  }
}

template <typename... Args>
CLAWCOMM_INLINE void dequantizeAny(int bits, Args... args) {
  switch (bits) {
    case 1: return dequantizeAll<1>(args...);
    case 2: return dequantizeAll<2>(args...);
    case 4: return dequantizeAll<4>(args...);
    default: return dequantizeAll<8>(args...);
  }
}

void quantizePortable(const QuantizeSpec& spec, const float* x, float* r, size_t n, uint64_t seed,
                      uint8_t* codes, float* scales) {
  quantizeAny(spec.bits, spec, x, r, n, seed, codes, scales);
}

CLAWCOMM_TARGET_AVX2 void quantizeAvx2(const QuantizeSpec& spec, const float* x, float* r, size_t n,
                                       uint64_t seed, uint8_t* codes, float* scales) {
  quantizeAny(spec.bits, spec, x, r, n, seed, codes, scales);
}

void dequantizePortable(const QuantizeSpec& spec, const uint8_t* codes, const float* scales,
                        size_t n, float alpha, bool accumulate, float* out) {
  dequantizeAny(spec.bits, spec, codes, scales, n, alpha, accumulate, out);
}

CLAWCOMM_TARGET_AVX2 void dequantizeAvx2(const QuantizeSpec& spec, const uint8_t* codes,
                                         const float* scales, size_t n, float alpha,
                                         bool accumulate, float* out) {
  dequantizeAny(spec.bits, spec, codes, scales, n, alpha, accumulate, out);
}

CLAWCOMM_TARGET_AVX512 void quantizeAvx512(const QuantizeSpec& spec, const float* x, float* r,
                                           size_t n, uint64_t seed, uint8_t* codes, float* scales) {
  quantizeAny(spec.bits, spec, x, r, n, seed, codes, scales);
}

CLAWCOMM_TARGET_AVX512 void dequantizeAvx512(const QuantizeSpec& spec, const uint8_t* codes,
                                             const float* scales, size_t n, float alpha,
                                             bool accumulate, float* out) {
  dequantizeAny(spec.bits, spec, codes, scales, n, alpha, accumulate, out);
}

void quantizeBlocks(const QuantizeSpec& spec, const float* x, float* residual, size_t n,
                    uint64_t seed, uint8_t* codes, float* scales) {
  checkQuantizeSpec(spec, "quantize");
  CLAWCOMM_ARG_CHECK(n % spec.block == 0, "clawcomm::quantize: ", n,
                     " values are not a whole number of blocks of ", spec.block);
  switch (activeSimdLevel()) {
    case SimdLevel::kAvx512: return quantizeAvx512(spec, x, residual, n, seed, codes, scales);
    case SimdLevel::kAvx2: return quantizeAvx2(spec, x, residual, n, seed, codes, scales);
    default: return quantizePortable(spec, x, residual, n, seed, codes, scales);
  }
}

void dequantizeBlocks(const QuantizeSpec& spec, const uint8_t* codes, const float* scales, size_t n,
                      float alpha, bool accumulate, float* out) {
  checkQuantizeSpec(spec, "dequantize");
  CLAWCOMM_ARG_CHECK(n % spec.block == 0, "clawcomm::dequantize: ", n,
                     " values are not a whole number of blocks of ", spec.block);
  switch (activeSimdLevel()) {
    case SimdLevel::kAvx512:
      return dequantizeAvx512(spec, codes, scales, n, alpha, accumulate, out);
    case SimdLevel::kAvx2: return dequantizeAvx2(spec, codes, scales, n, alpha, accumulate, out);
    default: return dequantizePortable(spec, codes, scales, n, alpha, accumulate, out);
  }
}

}  // namespace clawcomm
