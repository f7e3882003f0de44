// Ring all-gather, in place: the second half of the ring all-reduce.
//
// Steps s = 0 .. n-2: rank r sends chunk r-s to r+1 (its own at s = 0, then
// the one it received in step s-1) and receives chunk r-s-1 from r-1.
// Bytes sent per rank: (n-1)/n N; steps: n-1.
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void ringAllGather(Channel& ch, void* buf, const std::vector<size_t>& counts) {
  const int n = ch.size();
  const int r = ch.rank();
  std::vector<RingStep> steps;
  for (int s = 0; s < n - 1; ++s) {
    steps.push_back({ringIndex(r - s, n), ringIndex(r - s - 1, n), /*reduce=*/false});
  }
  ringPipeline(ch, buf, counts, steps);
}

}  // namespace clawcomm
