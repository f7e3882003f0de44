#include "compress/topk.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/errors.h"

namespace clawcomm {
namespace {

// splitmix64: a small, fast generator for sample positions.
uint64_t nextRandom(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The `k`-th largest of `mags` (1-based), reordering them.
float kthLargest(std::vector<float>& mags, size_t k) {
  std::nth_element(mags.begin(), mags.begin() + long(k - 1), mags.end(), std::greater<float>());
  return mags[k - 1];
}

// Takes the entries of `acc` at `candidates` (ascending) whose magnitude is
// above `threshold`, then those equal to it, up to k; zeroes what it takes.
size_t take(float* acc, const std::vector<int32_t>& candidates, float threshold, size_t k,
            int32_t* idx, float* val) {
  size_t above = 0;
  for (int32_t i : candidates) above += std::fabs(acc[i]) > threshold;
  size_t ties = k > above ? k - above : 0;
  size_t m = 0;
  for (int32_t i : candidates) {
    const float a = std::fabs(acc[i]);
    if (a > threshold || (a == threshold && ties > 0)) {
      if (!(a > threshold)) --ties;
      idx[m] = i;
      val[m] = acc[i];
      acc[i] = 0.0f;
      ++m;
    }
  }
  return m;
}

void checkSize(size_t n) {
  CLAWCOMM_ARG_CHECK(n <= size_t(INT32_MAX), "clawcomm::topk: ", n,
                     " elements do not fit 32-bit indices");
}

}  // namespace

size_t topkExact(float* acc, size_t n, size_t k, int32_t* idx, float* val) {
  checkSize(n);
  k = std::min(k, n);
  if (k == 0) return 0;
  std::vector<float> mags(acc, acc + n);
  for (float& m : mags) m = std::fabs(m);
  const float threshold = kthLargest(mags, k);
  std::vector<int32_t> candidates;
  candidates.reserve(k + 64);
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(acc[i]) >= threshold) candidates.push_back(int32_t(i));
  }
  return take(acc, candidates, threshold, k, idx, val);
}

size_t topkSampled(float* acc, size_t n, size_t k, uint64_t seed, int32_t* idx, float* val) {
  checkSize(n);
  k = std::min(k, n);
  if (k == 0) return 0;
  // 1% of the entries, at least 4096 (or all of them), as DGC suggests.
  const size_t samples = std::min(n, std::max<size_t>(4096, n / 100));
  if (samples == n) return topkExact(acc, n, k, idx, val);
  std::vector<float> mags(samples);
  uint64_t state = seed;
  for (float& m : mags) {
    const uint64_t i = uint64_t((__uint128_t(nextRandom(state)) * n) >> 64);
    m = std::fabs(acc[i]);
  }
  const size_t rank = std::max<size_t>(1, size_t(double(k) * double(samples) / double(n)));
  const float threshold = kthLargest(mags, rank);
  // One pass: every entry at or above the sampled threshold is a candidate.
  std::vector<int32_t> candidates;
  candidates.reserve(k + k / 4 + 64);
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(acc[i]) >= threshold) candidates.push_back(int32_t(i));
  }
  if (candidates.size() <= k) return take(acc, candidates, threshold, candidates.size(), idx, val);
  // Too many: keep the k largest candidates.
  std::vector<float> cm(candidates.size());
  for (size_t j = 0; j < candidates.size(); ++j) cm[j] = std::fabs(acc[candidates[j]]);
  return take(acc, candidates, kthLargest(cm, k), k, idx, val);
}

void scatterAdd(float* dense, size_t n, const int32_t* idx, const float* val, size_t m) {
  for (size_t i = 0; i < m; ++i) {
    CLAWCOMM_ARG_CHECK(idx[i] >= 0 && size_t(idx[i]) < n, "clawcomm::scatter_add: index ", idx[i],
                       " is outside a tensor of ", n, " elements");
  }
  for (size_t i = 0; i < m; ++i) dense[idx[i]] += val[i];
}

}  // namespace clawcomm
