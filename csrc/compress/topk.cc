#include "compress/topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

// One pass over `acc`: every entry with |acc[i]| >= threshold is appended to
// (cand, candVal) in ascending order and zeroed while its cache line is
// still hot. Blocks of 16 build a comparison bit mask without branches
// (vectorised by the compiler); only blocks with a hit are walked.
void collectAtLeast(float* acc, size_t n, float threshold, std::vector<int32_t>& cand,
                    std::vector<float>& candVal) {
  // Magnitudes compared as integers: for non-negative floats the bit
  // patterns order like the values, and an integer OR-reduction vectorises
  // (a float max-reduction would not, without -ffast-math). NaNs compare
  // above every threshold, so they are sent rather than hidden.
  uint32_t tb;
  std::memcpy(&tb, &threshold, 4);
  auto magBits = [&](size_t i) {
    uint32_t b;
    std::memcpy(&b, acc + i, 4);
    return b & 0x7fffffffu;
  };
  auto hit = [&](size_t i) {
    cand.push_back(int32_t(i));
    candVal.push_back(acc[i]);
    acc[i] = 0.0f;
  };
  constexpr size_t kBlock = 16;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint32_t any = 0;
    for (size_t j = 0; j < kBlock; ++j) any |= uint32_t(magBits(i + j) >= tb);
    if (!any) continue;
    for (size_t j = 0; j < kBlock; ++j) {
      if (magBits(i + j) >= tb) hit(i + j);
    }
  }
  for (; i < n; ++i) {
    if (magBits(i) >= tb) hit(i);
  }
}

// Keeps the k largest candidates (ties: lower index first), writes them to
// (idx, val) in ascending order and puts the others back into `acc`.
size_t keepLargest(float* acc, const std::vector<int32_t>& cand, const std::vector<float>& candVal,
                   size_t k, int32_t* idx, float* val) {
  if (cand.size() <= k) {
    std::copy(cand.begin(), cand.end(), idx);
    std::copy(candVal.begin(), candVal.end(), val);
    return cand.size();
  }
  std::vector<float> mags(candVal.size());
  for (size_t j = 0; j < mags.size(); ++j) mags[j] = std::fabs(candVal[j]);
  const float threshold = kthLargest(mags, k);
  size_t above = 0;
  for (float v : candVal) above += std::fabs(v) > threshold;
  size_t ties = k - above;
  size_t m = 0;
  for (size_t j = 0; j < cand.size(); ++j) {
    const float a = std::fabs(candVal[j]);
    if (a > threshold || (a == threshold && ties > 0)) {
      if (!(a > threshold)) --ties;
      idx[m] = cand[j];
      val[m] = candVal[j];
      ++m;
    } else {
      acc[cand[j]] = candVal[j];  // not sent after all: back into the residual
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
  std::vector<int32_t> cand;
  std::vector<float> candVal;
  cand.reserve(k + 64);
  candVal.reserve(k + 64);
  collectAtLeast(acc, n, threshold, cand, candVal);
  return keepLargest(acc, cand, candVal, k, idx, val);
}

size_t topkSampled(float* acc, size_t n, size_t k, uint64_t seed, int32_t* idx, float* val) {
  checkSize(n);
  k = std::min(k, n);
  if (k == 0) return 0;
  // 0.2% of the entries, at least 4096 (or all of them): DGC samples
  // 0.1-1%; the exact pass over the candidates corrects an overshoot.
  const size_t samples = std::min(n, std::max<size_t>(4096, n / 500));
  if (samples == n) return topkExact(acc, n, k, idx, val);
  // Whole cache lines at random positions: 16 samples per memory access
  // instead of one, which keeps sampling far below the cost of the pass.
  constexpr size_t kRun = 16;
  std::vector<float> mags;
  mags.reserve(samples + kRun);
  uint64_t state = seed;
  while (mags.size() < samples) {
    const uint64_t start = uint64_t((__uint128_t(nextRandom(state)) * (n - kRun + 1)) >> 64);
    for (size_t j = 0; j < kRun; ++j) mags.push_back(std::fabs(acc[start + j]));
  }
  const size_t rank = std::max<size_t>(1, size_t(double(k) * double(mags.size()) / double(n)));
  const float threshold = kthLargest(mags, rank);
  // One pass: every entry at or above the sampled threshold is a candidate.
  std::vector<int32_t> cand;
  std::vector<float> candVal;
  cand.reserve(2 * k + 64);
  candVal.reserve(2 * k + 64);
  collectAtLeast(acc, n, threshold, cand, candVal);
  return keepLargest(acc, cand, candVal, k, idx, val);
}

void scatterAdd(float* dense, size_t n, const int32_t* idx, const float* val, size_t m) {
  for (size_t i = 0; i < m; ++i) {
    CLAWCOMM_ARG_CHECK(idx[i] >= 0 && size_t(idx[i]) < n, "clawcomm::scatter_add: index ", idx[i],
                       " is outside a tensor of ", n, " elements");
  }
  for (size_t i = 0; i < m; ++i) dense[idx[i]] += val[i];
}

}  // namespace clawcomm
