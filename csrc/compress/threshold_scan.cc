#include "compress/threshold_scan.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define CLAWCOMM_X86 1
#define CLAWCOMM_TARGET_AVX2 __attribute__((target("avx2")))
#define CLAWCOMM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#endif

namespace clawcomm {
namespace {

// The loops below take 16 entries at a time, and return early (at a block
// boundary) when the candidate buffer might not hold another block; the
// driver then grows it and calls again.
constexpr size_t kBlock = 16;

// Where a kernel writes: the buffers, their capacity and the count so far.
struct Sink {
  int32_t* idx;
  float* val;
  size_t cap;
  size_t m;
  bool roomForBlock() const { return m + kBlock <= cap; }
};

// Magnitudes are compared as integers: for non-negative floats the bit
// patterns order like the values. NaNs compare above every threshold, so
// they are sent rather than hidden in the residual.
inline uint32_t magBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b & 0x7fffffffu;
}

// ---- portable: a branch-free test per block, a scalar walk of blocks that
// hold a hit (about one block in six at 1%).

template <bool kFold>
inline void scalarRun(float* grad, float* acc, size_t i, size_t len, uint32_t tb, Sink& s) {
  float a[kBlock];
  uint32_t any = 0;
  for (size_t j = 0; j < len; ++j) {
    a[j] = kFold ? grad[i + j] + acc[i + j] : acc[i + j];
    any |= uint32_t(magBits(a[j]) >= tb);
  }
  if (kFold) {
    for (size_t j = 0; j < len; ++j) {
      acc[i + j] = a[j];
      grad[i + j] = 0.0f;
    }
  }
  if (!any) return;
  for (size_t j = 0; j < len; ++j) {
    if (magBits(a[j]) >= tb) {
      s.idx[s.m] = int32_t(i + j);
      s.val[s.m] = a[j];
      ++s.m;
      acc[i + j] = 0.0f;
    }
  }
}

template <bool kFold>
size_t blocksPortable(float* grad, float* acc, size_t i, size_t end, uint32_t tb, Sink& s) {
  for (; i < end && s.roomForBlock(); i += kBlock) scalarRun<kFold>(grad, acc, i, kBlock, tb, s);
  return i;
}

#ifdef CLAWCOMM_X86

// ---- AVX2: 8 lanes; a compare mask, then the hits' lanes by bit scan.
template <bool kFold>
CLAWCOMM_TARGET_AVX2 size_t blocksAvx2(float* grad, float* acc, size_t i, size_t end, uint32_t tb,
                                       Sink& s) {
  const __m256i absMask = _mm256_set1_epi32(0x7fffffff);
  // Signed compare is safe: magnitudes and tb are below 2^31 (tb - 1 >= -1).
  const __m256i below = _mm256_set1_epi32(int32_t(tb) - 1);
  for (; i < end && s.roomForBlock(); i += kBlock) {
    for (size_t h = i; h < i + kBlock; h += 8) {
      __m256 a = _mm256_loadu_ps(acc + h);
      if (kFold) a = _mm256_add_ps(_mm256_loadu_ps(grad + h), a);
      const __m256i mag = _mm256_and_si256(_mm256_castps_si256(a), absMask);
      const __m256 hit = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, below));
      unsigned mask = unsigned(_mm256_movemask_ps(hit));
      if (kFold) {
        _mm256_storeu_ps(grad + h, _mm256_setzero_ps());
        _mm256_storeu_ps(acc + h, _mm256_andnot_ps(hit, a));
      }
      if (!mask) continue;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, a);
      while (mask) {
        const int j = __builtin_ctz(mask);
        mask &= mask - 1;
        s.idx[s.m] = int32_t(h + j);
        s.val[s.m] = lanes[j];
        ++s.m;
        if (!kFold) acc[h + j] = 0.0f;
      }
    }
  }
  return i;
}

// ---- AVX-512: 16 lanes; the hits are compress-stored, with no branch per
// hit.
template <bool kFold>
CLAWCOMM_TARGET_AVX512 size_t blocksAvx512(float* grad, float* acc, size_t i, size_t end,
                                           uint32_t tb, Sink& s) {
  const __m512i absMask = _mm512_set1_epi32(0x7fffffff);
  const __m512i threshold = _mm512_set1_epi32(int32_t(tb));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 zero = _mm512_setzero_ps();
  for (; i < end && s.roomForBlock(); i += kBlock) {
    __m512 a = _mm512_loadu_ps(acc + i);
    if (kFold) a = _mm512_add_ps(_mm512_loadu_ps(grad + i), a);
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(a), absMask);
    const __mmask16 hit = _mm512_cmpge_epu32_mask(mag, threshold);
    if (kFold) {
      _mm512_storeu_ps(grad + i, zero);
      _mm512_storeu_ps(acc + i, _mm512_mask_mov_ps(a, hit, zero));
    } else if (hit) {
      _mm512_mask_storeu_ps(acc + i, hit, zero);
    }
    if (!hit) continue;
    _mm512_mask_compressstoreu_ps(s.val + s.m, hit, a);
    const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(i)));
    _mm512_mask_compressstoreu_epi32(s.idx + s.m, hit, index);
    s.m += size_t(__builtin_popcount(hit));
  }
  return i;
}

#endif  // CLAWCOMM_X86

template <bool kFold>
size_t blocksAt(SimdLevel level, float* grad, float* acc, size_t i, size_t end, uint32_t tb,
                Sink& s) {
#ifdef CLAWCOMM_X86
  if (level == SimdLevel::kAvx512) return blocksAvx512<kFold>(grad, acc, i, end, tb, s);
  if (level == SimdLevel::kAvx2) return blocksAvx2<kFold>(grad, acc, i, end, tb, s);
#endif
  return blocksPortable<kFold>(grad, acc, i, end, tb, s);
}

template <bool kFold>
void scan(SimdLevel level, float* grad, float* acc, size_t n, float threshold, Candidates& out) {
  CLAWCOMM_ARG_CHECK(level <= detectSimdLevel(), "clawcomm::topk: this CPU lacks ",
                     simdLevelName(level));
  CLAWCOMM_ARG_CHECK(!(threshold < 0.0f), "clawcomm::topk: negative threshold ", threshold);
  const uint32_t tb = magBits(threshold);
  const size_t body = n - n % kBlock;
  size_t m = out.idx.size();
  // Room for about 2% of the entries to start with; it doubles when full.
  size_t cap = std::max(m + 4 * kBlock, m + n / 50);
  out.idx.resize(cap);
  out.val.resize(cap);
  Sink s{out.idx.data(), out.val.data(), cap, m};
  size_t i = 0;
  for (;;) {
    i = blocksAt<kFold>(level, grad, acc, i, body, tb, s);
    if (i >= body) break;
    cap *= 2;
    out.idx.resize(cap);
    out.val.resize(cap);
    s = Sink{out.idx.data(), out.val.data(), cap, s.m};
  }
  // Fewer than 16 left. The loop stops at `body` whether or not a block
  // still fits, so make room for one (when every entry is a hit and `body`
  // is exactly the capacity, the tail would write past the end).
  if (!s.roomForBlock()) {
    cap = s.m + kBlock;
    out.idx.resize(cap);
    out.val.resize(cap);
    s = Sink{out.idx.data(), out.val.data(), cap, s.m};
  }
  scalarRun<kFold>(grad, acc, body, n - body, tb, s);
  out.idx.resize(s.m);
  out.val.resize(s.m);
}

}  // namespace

void scanInPlace(float* acc, size_t n, float threshold, Candidates& out, SimdLevel level) {
  scan<false>(level, nullptr, acc, n, threshold, out);
}

void scanFold(float* grad, float* residual, size_t n, float threshold, Candidates& out,
              SimdLevel level) {
  scan<true>(level, grad, residual, n, threshold, out);
}

}  // namespace clawcomm
