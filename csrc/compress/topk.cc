#include "compress/topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "compress/sampling.h"
#include "compress/threshold_scan.h"

namespace clawcomm {
namespace {

// The `k`-th largest of `mags` (1-based), reordering them.
float kthLargest(std::vector<float>& mags, size_t k) {
  std::nth_element(mags.begin(), mags.begin() + long(k - 1), mags.end(), std::greater<float>());
  return mags[k - 1];
}

// The magnitude that k/n of a sample of `magAt(i)` reach (compress/sampling.h
// says where the sample lies).
template <typename MagAt>
float sampledThreshold(size_t n, size_t k, uint64_t seed, MagAt magAt) {
  const size_t runs = sampleRuns(n);
  std::vector<float> mags;
  mags.reserve(runs * kSampleRun);
  for (size_t j = 0; j < runs; ++j) {
    const uint64_t start = sampleStart(seed, j, n);
    for (size_t i = 0; i < kSampleRun; ++i) mags.push_back(magAt(start + i));
  }
  return kthLargest(mags, sampleRank(k, mags.size(), n));
}

// Keeps the k largest candidates (ties: lower index first), writes them to
// (idx, val) in ascending order and puts the others back into `acc`.
size_t keepLargest(float* acc, const Candidates& c, size_t k, int32_t* idx, float* val) {
  const std::vector<int32_t>& cand = c.idx;
  const std::vector<float>& candVal = c.val;
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
  Candidates cand;
  scanInPlace(acc, n, threshold, cand);
  return keepLargest(acc, cand, k, idx, val);
}

size_t topkSampled(float* acc, size_t n, size_t k, uint64_t seed, int32_t* idx, float* val) {
  checkSize(n);
  k = std::min(k, n);
  if (k == 0) return 0;
  if (sampleSize(n) == n) return topkExact(acc, n, k, idx, val);
  const float threshold =
      sampledThreshold(n, k, seed, [acc](size_t i) { return std::fabs(acc[i]); });
  // One pass: every entry at or above the sampled threshold is a candidate.
  Candidates cand;
  scanInPlace(acc, n, threshold, cand);
  return keepLargest(acc, cand, k, idx, val);
}

size_t topkWithFeedback(float* grad, float* residual, size_t n, size_t k, TopkSelection selection,
                        uint64_t seed, int32_t* idx, float* val) {
  checkSize(n);
  k = std::min(k, n);
  if (k == 0) {  // nothing is sent: everything stays in the residual
    for (size_t i = 0; i < n; ++i) {
      residual[i] += grad[i];
      grad[i] = 0.0f;
    }
    return 0;
  }
  auto accAt = [grad, residual](size_t i) { return std::fabs(grad[i] + residual[i]); };
  float threshold;
  if (selection == TopkSelection::kSampled && sampleSize(n) < n) {
    threshold = sampledThreshold(n, k, seed, accAt);
  } else {
    std::vector<float> mags(n);
    for (size_t i = 0; i < n; ++i) mags[i] = accAt(i);
    threshold = kthLargest(mags, k);
  }
  Candidates cand;
  scanFold(grad, residual, n, threshold, cand);
  return keepLargest(residual, cand, k, idx, val);
}

void scatterAdd(float* dense, size_t n, const int32_t* idx, const float* val, size_t m,
                float scale) {
  for (size_t i = 0; i < m; ++i) {
    CLAWCOMM_ARG_CHECK(idx[i] >= 0 && size_t(idx[i]) < n, "clawcomm::scatter_add: index ", idx[i],
                       " is outside a tensor of ", n, " elements");
  }
  // The targets are scattered over the whole tensor, so nearly every one is
  // a cache miss: ask for the line a few dozen entries ahead.
  constexpr size_t kAhead = 32;
  for (size_t i = 0; i < m; ++i) {
    if (i + kAhead < m) __builtin_prefetch(dense + idx[i + kAhead], 1);
    dense[idx[i]] += scale == 1.0f ? val[i] : val[i] * scale;
  }
}

}  // namespace clawcomm
