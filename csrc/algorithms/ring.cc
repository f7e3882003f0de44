#include "algorithms/ring.h"

#include <algorithm>
#include <cstdint>

namespace clawcomm {

std::vector<size_t> evenCounts(size_t count, int n) {
  std::vector<size_t> counts(size_t(n), count / size_t(n));
  for (size_t i = 0; i < count % size_t(n); ++i) ++counts[i];
  return counts;
}

void ringPipeline(Channel& ch, void* buf, const std::vector<size_t>& counts,
                  const std::vector<RingStep>& steps) {
  const int n = ch.size();
  if (n == 1 || steps.empty()) return;
  const size_t es = ch.elementBytes();
  uint8_t* base = static_cast<uint8_t*>(buf);
  std::vector<size_t> offsets(counts.size() + 1, 0);
  size_t largest = 0;
  for (size_t c = 0; c < counts.size(); ++c) {
    offsets[c + 1] = offsets[c] + counts[c];
    largest = std::max(largest, counts[c]);
  }
  const size_t segElems = std::max<size_t>(1, ch.settings().segmentBytes / es);
  const size_t segments = std::max<size_t>(1, (largest + segElems - 1) / segElems);
  // Segment j of chunk c: elements [c.begin + j*per, c.begin + min((j+1)*per, count)).
  auto segment = [&](int c, size_t j, size_t* begin, size_t* len) {
    const size_t per = (counts[c] + segments - 1) / segments;
    const size_t lo = std::min(counts[c], j * per);
    const size_t hi = std::min(counts[c], lo + per);
    *begin = (offsets[c] + lo) * es;
    *len = (hi - lo) * es;
  };
  const int next = ringIndex(ch.rank() + 1, n);
  const int prev = ringIndex(ch.rank() - 1, n);
  const size_t numSteps = steps.size();
  for (size_t wave = 0; wave + 1 < segments + numSteps; ++wave) {
    // Every rank walks the same (wave, segment) order, so the k-th frame to
    // the next rank is the k-th frame the next rank expects.
    for (size_t j = 0; j < segments; ++j) {
      if (wave < j || wave - j >= numSteps) continue;
      const RingStep& s = steps[wave - j];
      size_t off, len;
      segment(s.sendChunk, j, &off, &len);
      ch.send(next, base + off, len);
      segment(s.recvChunk, j, &off, &len);
      if (s.reduce) {
        ch.recvReduce(prev, base + off, len);
      } else {
        ch.recv(prev, base + off, len);
      }
    }
    ch.wait();
  }
}

}  // namespace clawcomm
