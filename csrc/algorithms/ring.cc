#include "algorithms/ring.h"

#include <algorithm>
#include <cstdint>

namespace clawcomm {

std::vector<size_t> evenCounts(size_t count, int n) {
  std::vector<size_t> counts(size_t(n), count / size_t(n));
  for (size_t i = 0; i < count % size_t(n); ++i) ++counts[i];
  return counts;
}

std::vector<size_t> byteOffsets(const std::vector<size_t>& counts, size_t elementBytes) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i] * elementBytes;
  return off;
}

std::vector<RingStep> reduceScatterSteps(int r, int n) {
  std::vector<RingStep> steps;
  for (int s = 0; s < n - 1; ++s) {
    steps.push_back({ringIndex(r - s - 1, n), ringIndex(r - s - 2, n), /*reduce=*/true});
  }
  return steps;
}

std::vector<RingStep> allGatherSteps(int r, int n) {
  std::vector<RingStep> steps;
  for (int s = 0; s < n - 1; ++s) {
    steps.push_back({ringIndex(r - s, n), ringIndex(r - s - 1, n), /*reduce=*/false});
  }
  return steps;
}

ChunkSegments::ChunkSegments(std::vector<size_t> counts, size_t elementBytes, size_t segmentBytes)
    : counts_(std::move(counts)), offsets_(counts_.size() + 1, 0), es_(elementBytes) {
  size_t largest = 0;
  for (size_t c = 0; c < counts_.size(); ++c) {
    offsets_[c + 1] = offsets_[c] + counts_[c];
    largest = std::max(largest, counts_[c]);
  }
  const size_t segElems = std::max<size_t>(1, segmentBytes / es_);
  segments_ = std::max<size_t>(1, (largest + segElems - 1) / segElems);
}

void ChunkSegments::of(int c, size_t j, size_t* at, size_t* bytes) const {
  const size_t per = (counts_[c] + segments_ - 1) / segments_;
  const size_t lo = std::min(counts_[c], j * per);
  const size_t hi = std::min(counts_[c], lo + per);
  *at = (offsets_[c] + lo) * es_;
  *bytes = (hi - lo) * es_;
}

RingPipeline::RingPipeline(Channel& ch, void* buf, std::vector<size_t> counts,
                           std::vector<RingStep> steps)
    : ch_(ch),
      base_(static_cast<uint8_t*>(buf)),
      segments_(std::move(counts), ch.elementBytes(), ch.settings().segmentBytes),
      steps_(std::move(steps)) {
  // One rank, or nothing to do: no waves.
  waves_ = (ch.size() == 1 || steps_.empty()) ? 0 : segments_.count() + steps_.size() - 1;
}

bool RingPipeline::postWave() {
  if (wave_ >= waves_) return false;
  const int n = ch_.size();
  const int next = ringIndex(ch_.rank() + 1, n);
  const int prev = ringIndex(ch_.rank() - 1, n);
  // Every rank walks the same (wave, segment) order, so the k-th frame to
  // the next rank is the k-th frame the next rank expects.
  for (size_t j = 0; j < segments_.count(); ++j) {
    if (wave_ < j || wave_ - j >= steps_.size()) continue;
    const RingStep& s = steps_[wave_ - j];
    size_t off, len;
    segments_.of(s.sendChunk, j, &off, &len);
    ch_.send(next, base_ + off, len);
    segments_.of(s.recvChunk, j, &off, &len);
    if (s.reduce) {
      ch_.recvReduce(prev, base_ + off, len);
    } else {
      ch_.recv(prev, base_ + off, len);
    }
  }
  ++wave_;
  return true;
}

void ringPipeline(Channel& ch, void* buf, const std::vector<size_t>& counts,
                  const std::vector<RingStep>& steps) {
  RingPipeline ring(ch, buf, counts, steps);
  while (ring.postWave()) ch.wait();
}

}  // namespace clawcomm
