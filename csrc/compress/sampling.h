// Where the sampled top-k threshold samples: shared by the CPU selection
// (compress/topk.cc) and the CUDA one (cuda/compress_kernels.cu), so that
// with one seed both look at the same entries and find the same threshold.
//
// The sample is runs of kSampleRun consecutive entries (whole cache lines,
// 16 values per memory access instead of one) starting at positions from
// splitmix64; run j's start depends on j alone, so a GPU draws every run at
// once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/hd.h"

namespace clawcomm {

constexpr size_t kSampleRun = 16;

// 0.2% of the entries, at least 4096 (or all of them): DGC samples 0.1-1%;
// the exact pass over the candidates corrects an overshoot.
CLAWCOMM_HD size_t sampleSize(size_t n) {
  const size_t want = n / 500 > 4096 ? n / 500 : 4096;
  return want < n ? want : n;
}

// Runs drawn: enough whole runs to hold sampleSize(n) values.
CLAWCOMM_HD size_t sampleRuns(size_t n) {
  return (sampleSize(n) + kSampleRun - 1) / kSampleRun;
}

// The first entry of run j (0-based) for `seed`, in [0, n - kSampleRun]:
// splitmix64 of seed + (j + 1) * golden, scaled to the range.
CLAWCOMM_HD uint64_t sampleStart(uint64_t seed, uint64_t j, size_t n) {
  uint64_t z = seed + (j + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const uint64_t range = uint64_t(n - kSampleRun + 1);
#if defined(__CUDA_ARCH__)
  return __umul64hi(z, range);
#else
  return uint64_t((__uint128_t(z) * range) >> 64);
#endif
}

// Which entry of a sample of `drawn` values (1-based, largest first) is the
// threshold for k of n: k/n of the sample, at least the first.
CLAWCOMM_HD size_t sampleRank(size_t k, size_t drawn, size_t n) {
  const size_t r = size_t(double(k) * double(drawn) / double(n));
  return r > 1 ? r : 1;
}

}  // namespace clawcomm
