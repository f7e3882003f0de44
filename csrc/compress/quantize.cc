#include "compress/quantize.h"

#include <cstring>
#include <vector>

#include "common/errors.h"
#include "compress/quantize_math.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {
namespace {

using quant::kScaleLanes;

// The loops are written once and compiled three times: inlined into a
// portable entry point, an AVX2 one (float-to-byte conversion and 32-bit
// multiplies are 3x faster there) and an AVX-512 one, chosen at run time like
// the reduction kernels (reduce/reduce_kernels.h). The per-value math is
// compress/quantize_math.h's, which the CUDA kernels share.
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

// --- 8 lanes at a time (the AVX2 and AVX-512 builds) ---------------------------
//
// The same arithmetic as quantize_math.h, lane by lane, in GCC's vector
// types: the scale's eight partials are the eight lanes, the uniforms are
// lowbias32 of eight counters at once, and each lane's code goes into a
// 64-bit word of eight bytes that a few shifts pack to 8 x bits bits. The
// portable build runs the scalar definition, and the test of every SIMD
// level (tests/test_methods.py) holds the two to the same bits.

// (Every function taking or returning these is inlined: no call passes one,
// so GCC's note on the AVX calling convention does not apply.)
#pragma GCC diagnostic ignored "-Wpsabi"
using F8 = float __attribute__((vector_size(32)));
using I8 = int32_t __attribute__((vector_size(32)));
using U8 = uint32_t __attribute__((vector_size(32)));
using B8 = uint8_t __attribute__((vector_size(8)));
using B32 = uint8_t __attribute__((vector_size(32)));

CLAWCOMM_INLINE F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

CLAWCOMM_INLINE void store8(float* p, F8 v) {
  std::memcpy(p, &v, sizeof v);
}

CLAWCOMM_INLINE F8 abs8(F8 v) {
  return (F8)((U8)v & 0x7fffffffu);
}

template <BlockScale kKind, bool kResidual>
CLAWCOMM_INLINE float blockScaleVec(int bits, const float* x, const float* r, size_t block) {
  static_assert(kScaleLanes == 8, "one lane per partial");
  F8 part = {};
  for (size_t i = 0; i < block; i += 8) {
    const F8 a = kResidual ? load8(x + i) + load8(r + i) : load8(x + i);
    if constexpr (kKind == BlockScale::kMax) {
      part = part < abs8(a) ? abs8(a) : part;
    } else if constexpr (kKind == BlockScale::kL2) {
      part = part + a * a;
    } else {
      part = part + abs8(a);
    }
  }
  float total = 0.0f;
  for (int l = 0; l < kScaleLanes; ++l) total = quant::combineScale(kKind, total, part[l]);
  return quant::finishScale(kKind, bits, total, block);
}

// quant::uniformAt(base, i0 + l) for lanes l = 0..7.
CLAWCOMM_INLINE F8 uniforms8(uint32_t base, uint32_t i0) {
  const U8 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
  U8 v = base + i0 + lanes;
  v ^= v >> 16;
  v *= 0x7feb352du;
  v ^= v >> 15;
  v *= 0x846ca68bu;
  v ^= v >> 16;
  return __builtin_convertvector((I8)(v >> 8), F8) * (1.0f / 16777216.0f);  // exact: < 2^24
}

// Eight codes (bytes of `bits` significant bits, lane l in byte l) packed
// as bits-bit fields, lane l at bit bits * l.
template <int kBits>
CLAWCOMM_INLINE uint64_t pack8(uint64_t w) {
  if constexpr (kBits == 8) {
    return w;
  } else if constexpr (kBits == 4) {
    w = (w | (w >> 4)) & 0x00ff00ff00ff00ffull;
    w = (w | (w >> 8)) & 0x0000ffff0000ffffull;
    return (w | (w >> 16)) & 0xffffffffull;
  } else if constexpr (kBits == 2) {
    w = (w | (w >> 6)) & 0x00ff00ff00ff00ffull;
    w = (w | (w >> 12)) & 0x0000ffff0000ffffull;
    return (w | (w >> 24)) & 0xffffull;
  } else {
    return (w * 0x0102040810204080ull) >> 56;  // bit 0 of byte l to bit l
  }
}

template <int kBits, bool kStochastic, bool kResidual>
CLAWCOMM_INLINE void quantizeBlockVec(const float* x, float* r, size_t block, bool last,
                                      float scale, uint32_t base, uint8_t* codes) {
  const float inverse = quant::inverseOf(scale);
  for (size_t i = 0; i < block; i += 8) {
    // The next block comes from memory while this one computes (its scale
    // pass then finds it in cache instead of waiting for it): 1.7x here.
    if (i % 16 == 0 && !last) {
      __builtin_prefetch(x + block + i);
      if constexpr (kResidual) __builtin_prefetch(r + block + i, 1);
    }
    const F8 a = kResidual ? load8(x + i) + load8(r + i) : load8(x + i);
    I8 code;
    F8 decoded;
    if constexpr (kBits == 1) {
      const I8 up = a >= 0.0f;  // all ones where a >= 0
      code = up & 1;
      decoded = (F8)(((U8)up & (U8)(F8{} + scale)) | (~(U8)up & (U8)(F8{} - scale)));
    } else {
      constexpr int q = (1 << (kBits - 1)) - 1;
      const F8 u = kStochastic ? uniforms8(base, uint32_t(i)) : F8{} + 0.5f;
      F8 t = a * inverse + u + float(q);
      t = t < 0.0f ? F8{} : t;                         // maxOf(t, 0)
      t = float(2 * q) < t ? F8{} + float(2 * q) : t;  // minOf(t, 2q)
      const I8 l = __builtin_convertvector(t, I8);     // floor: t >= 0
      code = l + 1;
      decoded = __builtin_convertvector(l - q, F8) * scale;
    }
    if constexpr (kResidual) store8(r + i, a - decoded);
    uint64_t w;  // the low byte of each lane (a narrowing conversion compiles to scalar code)
    const B8 bytes = __builtin_shufflevector((B32)code, (B32)code, 0, 4, 8, 12, 16, 20, 24, 28);
    std::memcpy(&w, &bytes, sizeof w);
    const uint64_t packed = pack8<kBits>(w);
    std::memcpy(codes + i * kBits / 8, &packed, kBits);  // little-endian: the low kBits bytes
  }
}

// One block: the scalar definition (kVector false) or the 8-lane loops.
template <int kBits, bool kVector, bool kStochastic, bool kResidual>
CLAWCOMM_INLINE void encodeBlock(BlockScale kind, const float* x, float* r, size_t block, bool last,
                                 uint32_t base, uint8_t* level, uint8_t* codes, float* scale) {
  if constexpr (kVector) {
    switch (kind) {
      case BlockScale::kMax:
        *scale = blockScaleVec<BlockScale::kMax, kResidual>(kBits, x, r, block);
        break;
      case BlockScale::kL2:
        *scale = blockScaleVec<BlockScale::kL2, kResidual>(kBits, x, r, block);
        break;
      default: *scale = blockScaleVec<BlockScale::kMeanAbs, kResidual>(kBits, x, r, block);
    }
    quantizeBlockVec<kBits, kStochastic, kResidual>(x, r, block, last, *scale, base, codes);
  } else {
    *scale = blockScale<kResidual>(kind, kBits, x, r, block);
    quantizeBlock<kBits, kStochastic, kResidual>(x, r, block, *scale, base, level, codes);
  }
}

template <int kBits, bool kVector>
CLAWCOMM_INLINE void quantizeAll(const QuantizeSpec& spec, const float* x, float* r, size_t n,
                                 uint64_t seed, uint8_t* codes, float* scales) {
  const size_t block = spec.block;
  const size_t bytes = block * kBits / 8;
  std::vector<uint8_t> level(kVector ? 0 : block);
  for (size_t b = 0; b * block < n; ++b) {
    const float* xb = x + b * block;
    float* rb = r ? r + b * block : nullptr;
    const uint32_t base = quant::blockBase(seed, b);
    uint8_t* cb = codes + b * bytes;
    uint8_t* lv = level.data();
    const auto k = spec.scale;
    const bool last = (b + 1) * block >= n;
    float* sb = scales + b;
    if (spec.stochastic) {
      rb ? encodeBlock<kBits, kVector, true, true>(k, xb, rb, block, last, base, lv, cb, sb)
         : encodeBlock<kBits, kVector, true, false>(k, xb, rb, block, last, base, lv, cb, sb);
    } else {
      rb ? encodeBlock<kBits, kVector, false, true>(k, xb, rb, block, last, base, lv, cb, sb)
         : encodeBlock<kBits, kVector, false, false>(k, xb, rb, block, last, base, lv, cb, sb);
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

template <bool kVector, typename... Args>
CLAWCOMM_INLINE void quantizeAny(int bits, Args... args) {
  switch (bits) {
    case 1: return quantizeAll<1, kVector>(args...);
    case 2: return quantizeAll<2, kVector>(args...);
    case 4: return quantizeAll<4, kVector>(args...);
    default: return quantizeAll<8, kVector>(args...);
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
  quantizeAny<false>(spec.bits, spec, x, r, n, seed, codes, scales);
}

CLAWCOMM_TARGET_AVX2 void quantizeAvx2(const QuantizeSpec& spec, const float* x, float* r, size_t n,
                                       uint64_t seed, uint8_t* codes, float* scales) {
  quantizeAny<true>(spec.bits, spec, x, r, n, seed, codes, scales);
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
  quantizeAny<true>(spec.bits, spec, x, r, n, seed, codes, scales);
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
