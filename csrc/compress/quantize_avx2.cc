// The block quantiser's encoder in AVX2 (compress/quantize.h): the same
// arithmetic as quantize_math.h's scalar definition, lane by lane, bit for
// bit (tests/test_methods.py holds every SIMD level to the portable build's
// bits). The AVX-512 level runs it too: its work is 8-lane throughout.
//
// Per block of values:
//   - the scale is the eight partials of quantize_math.h, the lanes of one
//     vector, added value by value in order; the block's partials are
//     accumulated while the block before it is being encoded, so the chain
//     of adds, the square root and the division overlap that block's work
//     instead of stalling in front of this one;
//   - the uniforms are lowbias32 of eight counters at once;
//   - codes are packed 32 at a time by AVX2's saturating packs (four vectors
//     of 8 codes into 32 bytes in order), then pairs of nibbles or quads of
//     2-bit fields merged by multiply-adds, or signs taken by movemask. A
//     block whose size is not a multiple of 32 ends 8 at a time through a
//     64-bit word. The stored code's offset (level + 1) is added once per
//     packed byte.
// This took the stochastic encoders from 36-54% of a copy's bandwidth to
// the figures in docs/compression.md.
#include <immintrin.h>

#include <cstring>

#include "compress/quantize_math.h"
#include "compress/quantize_simd.h"

namespace clawcomm {
namespace {

// (Every function taking or returning these is inlined: no call passes one,
// so GCC's note on the AVX calling convention does not apply.)
#pragma GCC diagnostic ignored "-Wpsabi"
using F8 = float __attribute__((vector_size(32)));
using I8 = int32_t __attribute__((vector_size(32)));
using U8 = uint32_t __attribute__((vector_size(32)));
using B8 = uint8_t __attribute__((vector_size(8)));
using B32 = uint8_t __attribute__((vector_size(32)));

// Intrinsics inline only into code compiled for their target, so every
// function here carries it.
#define CLAWCOMM_AVX2 __attribute__((target("avx2")))
#define CLAWCOMM_VEC CLAWCOMM_AVX2 [[gnu::always_inline]] inline

CLAWCOMM_VEC F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

CLAWCOMM_VEC void store8(float* p, F8 v) {
  std::memcpy(p, &v, sizeof v);
}

CLAWCOMM_VEC F8 abs8(F8 v) {
  return (F8)((U8)v & 0x7fffffffu);
}

// What the block quantises at values i..i+7: x, or x + residual.
template <bool kResidual>
CLAWCOMM_VEC F8 values8(const float* x, const float* r, size_t i) {
  return kResidual ? load8(x + i) + load8(r + i) : load8(x + i);
}

// Eight values into the scale's eight partials (quant::addToScale per lane).
template <BlockScale kKind>
CLAWCOMM_VEC F8 addToScale8(F8 part, F8 a) {
  if constexpr (kKind == BlockScale::kMax) return part < abs8(a) ? abs8(a) : part;
  if constexpr (kKind == BlockScale::kL2) return part + a * a;
  return part + abs8(a);
}

template <BlockScale kKind, bool kResidual>
CLAWCOMM_VEC F8 scaleParts(const float* x, const float* r, size_t block) {
  static_assert(quant::kScaleLanes == 8, "one lane per partial");
  F8 part = {};
  for (size_t i = 0; i < block; i += 8)
    part = addToScale8<kKind>(part, values8<kResidual>(x, r, i));
  return part;
}

template <BlockScale kKind>
CLAWCOMM_VEC float finishScale8(int bits, F8 part, size_t block) {
  float total = 0.0f;
  for (int l = 0; l < quant::kScaleLanes; ++l) total = quant::combineScale(kKind, total, part[l]);
  return quant::finishScale(kKind, bits, total, block);
}

// v >> 16 and v >> 8 in each lane as byte shuffles, which more of the
// core's vector pipes run than shifts.
CLAWCOMM_VEC U8 shiftRight16(U8 v) {
  const __m256i m = _mm256_setr_epi8(2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1, 2,
                                     3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1);
  return U8(_mm256_shuffle_epi8(__m256i(v), m));
}

CLAWCOMM_VEC U8 shiftRight8(U8 v) {
  const __m256i m = _mm256_setr_epi8(1, 2, 3, -1, 5, 6, 7, -1, 9, 10, 11, -1, 13, 14, 15, -1, 1, 2,
                                     3, -1, 5, 6, 7, -1, 9, 10, 11, -1, 13, 14, 15, -1);
  return U8(_mm256_shuffle_epi8(__m256i(v), m));
}

// quant::uniformAt for the eight counters base + i + l.
CLAWCOMM_VEC F8 uniforms8(U8 v) {
  v ^= shiftRight16(v);
  v *= 0x7feb352du;
  v ^= v >> 15;
  v *= 0x846ca68bu;
  v ^= shiftRight16(v);
  // exact: below 2^24
  return __builtin_convertvector((I8)shiftRight8(v), F8) * (1.0f / 16777216.0f);
}

// What the stored code of a level l adds to it (l + 1 for bits >= 2: v +
// 2^(bits-1) with v = l - q), in every field of a byte. It never carries out
// of a field (l + 1 <= 2q + 1 fits), so the packers add it once per byte
// after packing instead of once per value before.
template <int kBits>
constexpr uint8_t kCodeOffsets = kBits == 8   ? 0x01
                                 : kBits == 4 ? 0x11
                                 : kBits == 2 ? 0x55
                                              : 0x00;

// The fields of values i..i+7 (one per 32-bit lane: the level l, or the sign
// bit), their residuals written back (quant::encodeValue per lane, less the
// stored code's offset, which the packers add).
template <int kBits, bool kStochastic, bool kResidual>
CLAWCOMM_VEC I8 fields8(const float* x, float* r, size_t i, float scale, float inverse,
                        U8 counters) {
  const F8 a = values8<kResidual>(x, r, i);
  I8 field;
  F8 decoded;
  if constexpr (kBits == 1) {
    const I8 up = a >= 0.0f;  // all ones where a >= 0
    field = up & 1;
    decoded = (F8)(((U8)up & (U8)(F8{} + scale)) | (~(U8)up & (U8)(F8{} - scale)));
  } else {
    constexpr int q = (1 << (kBits - 1)) - 1;
    const F8 u = kStochastic ? uniforms8(counters) : F8{} + 0.5f;
    F8 t = a * inverse + u + float(q);
    // maxOf(t, 0) and minOf(t, 2q), NaN kept as they keep it: MAXPS and
    // MINPS return their second operand where the comparison is false.
    t = F8(_mm256_max_ps(__m256(F8{}), __m256(t)));
    t = F8(_mm256_min_ps(__m256(F8{} + float(2 * q)), __m256(t)));
    const I8 l = __builtin_convertvector(t, I8);  // floor: t >= 0
    field = l;
    decoded = __builtin_convertvector(l - q, F8) * scale;
  }
  if constexpr (kResidual) store8(r + i, a - decoded);
  return field;
}

// Eight fields (lane l's low byte) as bits-bit codes, lane l at bit
// bits * l, written at out (kBits bytes).
template <int kBits>
CLAWCOMM_VEC void pack8(I8 field, uint8_t* out) {
  uint64_t w;
  const B8 bytes = __builtin_shufflevector((B32)field, (B32)field, 0, 4, 8, 12, 16, 20, 24, 28);
  std::memcpy(&w, &bytes, sizeof w);
  if constexpr (kBits == 4) {
    w = (w | (w >> 4)) & 0x00ff00ff00ff00ffull;
    w = (w | (w >> 8)) & 0x0000ffff0000ffffull;
    w = (w | (w >> 16)) & 0xffffffffull;
  } else if constexpr (kBits == 2) {
    w = (w | (w >> 6)) & 0x00ff00ff00ff00ffull;
    w = (w | (w >> 12)) & 0x0000ffff0000ffffull;
    w = (w | (w >> 24)) & 0xffffull;
  } else if constexpr (kBits == 1) {
    w = (w * 0x0102040810204080ull) >> 56;  // bit 0 of byte l to bit l
  }
  w += 0x0101010101010101ull * kCodeOffsets<kBits>;  // only the low kBits bytes are kept
  std::memcpy(out, &w, kBits);                       // little-endian: the low kBits bytes
}

// Thirty-two fields (four vectors in order) packed the same way, written at
// out (4 * kBits bytes).
template <int kBits>
CLAWCOMM_VEC void pack32(I8 c0, I8 c1, I8 c2, I8 c3, uint8_t* out) {
  // Fields fit a byte, so saturation never bites: 32 bytes, each 128-bit
  // half holding four fields of every vector, which the permute puts in order.
  const __m256i offsets = _mm256_set1_epi8(char(kCodeOffsets<kBits>));
  const __m256i w = _mm256_packs_epi32(__m256i(c0), __m256i(c1));
  const __m256i z = _mm256_packs_epi32(__m256i(c2), __m256i(c3));
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, z),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (kBits == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_add_epi8(b, offsets));
  } else if constexpr (kBits == 4) {
    // even + 16 * odd in each 16-bit lane, narrowed to bytes
    const __m256i m = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(m, m), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm256_castsi256_si128(_mm256_add_epi8(p, offsets)));
  } else if constexpr (kBits == 2) {
    // c0 + 4 c1 in 16-bit lanes, then + 16 (c2 + 4 c3) in 32-bit ones;
    // each half's four bytes gathered, then the two halves side by side
    const __m256i m = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x0401));
    const __m256i d = _mm256_madd_epi16(m, _mm256_set1_epi32(0x00100001));
    const __m256i low =
        _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i s = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(d, low),
                                                  _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out),
                     _mm256_castsi256_si128(_mm256_add_epi8(s, offsets)));
  } else {
    const uint32_t bits = uint32_t(_mm256_movemask_epi8(_mm256_slli_epi16(b, 7)));
    std::memcpy(out, &bits, sizeof bits);
  }
}

// One block's codes, its scale known, while the next block's scale
// partials accumulate (`next` null: this is the last block); returns them.
template <int kBits, BlockScale kKind, bool kStochastic, bool kResidual>
CLAWCOMM_VEC F8 encodeBlock(const float* x, float* r, size_t block, const float* next,
                            const float* nextR, float scale, uint32_t base, uint8_t* codes) {
  const float inverse = quant::inverseOf(scale);
  U8 counters = base + U8{0, 1, 2, 3, 4, 5, 6, 7};
  F8 part = {};
  size_t i = 0;
  for (; i + 32 <= block; i += 32, counters += 32) {
    if (next) {
      for (size_t j = i; j < i + 32; j += 8)
        part = addToScale8<kKind>(part, values8<kResidual>(next, nextR, j));
    }
    const I8 c0 = fields8<kBits, kStochastic, kResidual>(x, r, i, scale, inverse, counters);
    const I8 c1 = fields8<kBits, kStochastic, kResidual>(x, r, i + 8, scale, inverse, counters + 8);
    const I8 c2 =
        fields8<kBits, kStochastic, kResidual>(x, r, i + 16, scale, inverse, counters + 16);
    const I8 c3 =
        fields8<kBits, kStochastic, kResidual>(x, r, i + 24, scale, inverse, counters + 24);
    pack32<kBits>(c0, c1, c2, c3, codes + i * kBits / 8);
  }
  for (; i < block; i += 8, counters += 8) {
    if (next) part = addToScale8<kKind>(part, values8<kResidual>(next, nextR, i));
    pack8<kBits>(fields8<kBits, kStochastic, kResidual>(x, r, i, scale, inverse, counters),
                 codes + i * kBits / 8);
  }
  return part;
}

template <int kBits, BlockScale kKind, bool kStochastic, bool kResidual>
CLAWCOMM_AVX2 void encodeAll(size_t block, const float* x, float* r, size_t n, uint64_t seed,
                             uint8_t* codes, float* scales) {
  const size_t blocks = n / block;
  const size_t bytes = block * kBits / 8;
  if (blocks == 0) return;  // nothing to read, not even the first block
  F8 part = scaleParts<kKind, kResidual>(x, r, block);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t o = b * block;
    float* rb = kResidual ? r + o : nullptr;
    const bool more = b + 1 < blocks;
    scales[b] = finishScale8<kKind>(kBits, part, block);
    part = encodeBlock<kBits, kKind, kStochastic, kResidual>(
        x + o, rb, block, more ? x + o + block : nullptr, more && kResidual ? rb + block : nullptr,
        scales[b], quant::blockBase(seed, b), codes + b * bytes);
  }
}

template <int kBits, BlockScale kKind>
void encodeKind(const QuantizeSpec& spec, const float* x, float* r, size_t n, uint64_t seed,
                uint8_t* codes, float* scales) {
  const size_t k = spec.block;
  if (spec.stochastic) {
    r ? encodeAll<kBits, kKind, true, true>(k, x, r, n, seed, codes, scales)
      : encodeAll<kBits, kKind, true, false>(k, x, r, n, seed, codes, scales);
  } else {
    r ? encodeAll<kBits, kKind, false, true>(k, x, r, n, seed, codes, scales)
      : encodeAll<kBits, kKind, false, false>(k, x, r, n, seed, codes, scales);
  }
}

template <int kBits>
void encodeBits(const QuantizeSpec& spec, const float* x, float* r, size_t n, uint64_t seed,
                uint8_t* codes, float* scales) {
  if constexpr (kBits == 1) {
    encodeKind<1, BlockScale::kMeanAbs>(spec, x, r, n, seed, codes, scales);
  } else if (spec.scale == BlockScale::kL2) {
    encodeKind<kBits, BlockScale::kL2>(spec, x, r, n, seed, codes, scales);
  } else {
    encodeKind<kBits, BlockScale::kMax>(spec, x, r, n, seed, codes, scales);
  }
}

}  // namespace

void quantizeBlocksAvx2(const QuantizeSpec& spec, const float* x, float* residual, size_t n,
                        uint64_t seed, uint8_t* codes, float* scales) {
  switch (spec.bits) {
    case 1: return encodeBits<1>(spec, x, residual, n, seed, codes, scales);
    case 2: return encodeBits<2>(spec, x, residual, n, seed, codes, scales);
    case 4: return encodeBits<4>(spec, x, residual, n, seed, codes, scales);
    default: return encodeBits<8>(spec, x, residual, n, seed, codes, scales);
  }
}

}  // namespace clawcomm
