#include "compress/quantize.h"

#include <cstring>
#include <vector>

#include "common/errors.h"
#include "compress/quantize_math.h"
#include "compress/quantize_simd.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {
namespace {

using quant::kScaleLanes;

// The encoder's scalar definition is the portable level; the AVX2 and
// AVX-512 levels run the vector encoder (compress/quantize_avx2.cc), held
// to its bits. The decoder is written once and compiled three times, chosen
// at run time like the reduction kernels (reduce/reduce_kernels.h). The
// per-value math is compress/quantize_math.h's, which the CUDA kernels share.
#define CLAWCOMM_INLINE [[gnu::always_inline]] inline
#define CLAWCOMM_TARGET_AVX2 __attribute__((target("avx2")))
#define CLAWCOMM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))

// The block's scale, in kScaleLanes partial results so the loop vectorises
// without reassociating anything the compiler may not (the kind a template
// argument: a choice inside the loop would keep it scalar).
template <BlockScale kKind, bool kResidual>
CLAWCOMM_INLINE float blockScaleOf(int bits, const float* x, const float* r, size_t block) {
  float part[kScaleLanes] = {};
  for (size_t i0 = 0; i0 < block; i0 += kScaleLanes) {
    for (int l = 0; l < kScaleLanes; ++l) {
      const size_t i = i0 + size_t(l);
      part[l] = quant::addToScale(kKind, part[l], kResidual ? x[i] + r[i] : x[i]);
    }
  }
  float total = 0.0f;
  for (int l = 0; l < kScaleLanes; ++l) total = quant::combineScale(kKind, total, part[l]);
  return quant::finishScale(kKind, bits, total, block);
}

template <bool kResidual>
CLAWCOMM_INLINE float blockScale(BlockScale kind, int bits, const float* x, const float* r,
                                 size_t block) {
  switch (kind) {
    case BlockScale::kMax: return blockScaleOf<BlockScale::kMax, kResidual>(bits, x, r, block);
    case BlockScale::kL2: return blockScaleOf<BlockScale::kL2, kResidual>(bits, x, r, block);
    default: return blockScaleOf<BlockScale::kMeanAbs, kResidual>(bits, x, r, block);
  }
}

// One flat loop over the block writes a byte per value (it vectorises); a
// second packs them.
template <int kBits, bool kStochastic, bool kResidual>
CLAWCOMM_INLINE void quantizeBlock(const float* x, float* r, size_t block, float scale,
                                   uint32_t base, uint8_t* level, uint8_t* codes) {
  const float inverse = quant::inverseOf(scale);
  uint8_t* lv = kBits == 8 ? codes : level;
  for (size_t i = 0; i < block; ++i) {
    const float a = kResidual ? x[i] + r[i] : x[i];
    const float u = kBits > 1 && kStochastic ? quant::uniformAt(base, uint32_t(i)) : 0.5f;
    float decoded;
    lv[i] = quant::encodeValue<kBits>(a, scale, inverse, u, &decoded);
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
  constexpr int kLanes = 8;  // one byte of 1-bit codes, 8 bytes of 8-bit ones
  const float s = scale * alpha;
  float v[kLanes];
  for (size_t i0 = 0; i0 < block; i0 += kLanes) {
    uint64_t packed = 0;
    for (int b = 0; b < kBits; ++b) packed |= uint64_t(codes[i0 / kPerByte + size_t(b)]) << (8 * b);
    for (int l = 0; l < kLanes; ++l) {
      const int c = int((packed >> (kBits * l)) & mask);
      v[l] = quant::decodeValue<kBits>(c, s);
    }
    float* o = out + i0;
    if (accumulate) {
      for (int l = 0; l < kLanes; ++l) o[l] += v[l];
    } else {
      for (int l = 0; l < kLanes; ++l) o[l] = v[l];
    }
  }
}

// The scalar definition over every block (the portable level).
template <int kBits>
CLAWCOMM_INLINE void quantizeAll(const QuantizeSpec& spec, const float* x, float* r, size_t n,
                                 uint64_t seed, uint8_t* codes, float* scales) {
  const size_t block = spec.block;
  const size_t bytes = block * kBits / 8;
  std::vector<uint8_t> level(block);
  for (size_t b = 0; b * block < n; ++b) {
    const float* xb = x + b * block;
    float* rb = r ? r + b * block : nullptr;
    const uint32_t base = quant::blockBase(seed, b);
    uint8_t* cb = codes + b * bytes;
    uint8_t* lv = level.data();
    scales[b] = r ? blockScale<true>(spec.scale, kBits, xb, rb, block)
                  : blockScale<false>(spec.scale, kBits, xb, rb, block);
    if (spec.stochastic) {
      rb ? quantizeBlock<kBits, true, true>(xb, rb, block, scales[b], base, lv, cb)
         : quantizeBlock<kBits, true, false>(xb, rb, block, scales[b], base, lv, cb);
    } else {
      rb ? quantizeBlock<kBits, false, true>(xb, rb, block, scales[b], base, lv, cb)
         : quantizeBlock<kBits, false, false>(xb, rb, block, scales[b], base, lv, cb);
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

void quantizePortable(const QuantizeSpec& spec, const float* x, float* r, size_t n, uint64_t seed,
                      uint8_t* codes, float* scales) {
  switch (spec.bits) {
    case 1: return quantizeAll<1>(spec, x, r, n, seed, codes, scales);
    case 2: return quantizeAll<2>(spec, x, r, n, seed, codes, scales);
    case 4: return quantizeAll<4>(spec, x, r, n, seed, codes, scales);
    default: return quantizeAll<8>(spec, x, r, n, seed, codes, scales);
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

void dequantizePortable(const QuantizeSpec& spec, const uint8_t* codes, const float* scales,
                        size_t n, float alpha, bool accumulate, float* out) {
  dequantizeAny(spec.bits, spec, codes, scales, n, alpha, accumulate, out);
}

CLAWCOMM_TARGET_AVX2 void dequantizeAvx2(const QuantizeSpec& spec, const uint8_t* codes,
                                         const float* scales, size_t n, float alpha,
                                         bool accumulate, float* out) {
  dequantizeAny(spec.bits, spec, codes, scales, n, alpha, accumulate, out);
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
    case SimdLevel::kAvx512:  // 8-lane work throughout: the AVX2 encoder
    case SimdLevel::kAvx2: return quantizeBlocksAvx2(spec, x, residual, n, seed, codes, scales);
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
