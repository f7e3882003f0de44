// rANS decoding in AVX2 (compress/rans.h): the sixteen states as two
// vectors of eight, decoded a round of sixteen symbols at a time, bit for
// bit what the scalar loop in rans.cc decodes (tests/test_codecs.py holds
// the two levels to the same bytes).
//
// Per vector of eight states: the slots by one gather; the frequency and
// the offset out of each slot; the states updated by one 32-bit multiply;
// the eight symbols packed into eight bytes by one shuffle. Renormalising:
// the states below kRansLow are a mask of eight bits, whose population
// count is the words they take and which indexes a table of permutations
// that hands the k-th word to the k-th such state, in lane order (the
// order the scalar loop takes them). The two vectors' gathers overlap; the
// second vector's words follow the first's.
#include <immintrin.h>

#include <array>
#include <cstring>

#include "compress/rans.h"

namespace clawcomm {
namespace {

#define CLAWCOMM_AVX2 __attribute__((target("avx2,popcnt")))

// For each mask of eight lanes: lane k takes word (set bits of the mask
// below k); lanes outside the mask take word 0 and blend it away.
struct Permutations {
  alignas(32) std::array<std::array<uint32_t, 8>, 256> index{};
  Permutations() {
    for (int m = 0; m < 256; ++m) {
      int next = 0;
      for (int k = 0; k < 8; ++k) index[m][k] = (m >> k) & 1 ? uint32_t(next++) : 0u;
    }
  }
};

const Permutations& permutations() {
  static const Permutations table;
  return table;
}

struct Vector {
  __m256i x;
  __m256i need;
  int mask;
};

CLAWCOMM_AVX2 inline Vector decode8(const uint32_t* slots, __m256i x, uint8_t* out) {
  const __m256i low12 = _mm256_set1_epi32(0xfff);
  const __m256i e =
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(slots), _mm256_and_si256(x, low12), 4);
  const __m256i freq =
      _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 8), low12), _mm256_set1_epi32(1));
  x = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srli_epi32(x, kRansScaleBits)),
                       _mm256_srli_epi32(e, 20));
  // Byte 0 of each lane to bytes 0-3 of its half.
  const __m256i pick =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(e, pick);
  const uint32_t lo = uint32_t(_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes)));
  const uint32_t hi = uint32_t(_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1)));
  std::memcpy(out, &lo, 4);
  std::memcpy(out + 4, &hi, 4);
  const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(x, 16), _mm256_setzero_si256());
  return {x, need, _mm256_movemask_ps(_mm256_castsi256_ps(need))};
}

// The vector's states that fell below kRansLow take the words at `p`.
CLAWCOMM_AVX2 inline __m256i refill(const Vector& v, const uint8_t* p, const Permutations& perm) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i index =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(perm.index[v.mask].data()));
  const __m256i mine = _mm256_permutevar8x32_epi32(words, index);
  const __m256i refilled = _mm256_or_si256(_mm256_slli_epi32(v.x, 16), mine);
  return _mm256_blendv_epi8(v.x, refilled, v.need);
}

}  // namespace

CLAWCOMM_AVX2 size_t decodeRansAvx2(const uint32_t* slots, uint32_t* x, const uint8_t*& p,
                                    const uint8_t* end, uint8_t* out, size_t i, size_t n) {
  static_assert(kRansStates == 16, "two vectors of eight states");
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8));
  const Permutations& perm = permutations();  // (its guard checked once, not per vector)
  // Each vector reads 16 bytes of words (8 at most used): 32 must be left.
  for (; i + 16 <= n && end - p >= 32; i += 16) {
    const Vector va = decode8(slots, a, out + i);
    const Vector vb = decode8(slots, b, out + i + 8);
    a = refill(va, p, perm);
    p += 2 * _mm_popcnt_u32(uint32_t(va.mask));
    b = refill(vb, p, perm);
    p += 2 * _mm_popcnt_u32(uint32_t(vb.mask));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8), b);
  return i;
}

}  // namespace clawcomm
