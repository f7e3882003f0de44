// Ring all-reduce: a reduce-scatter followed by an all-gather, both around
// the ring 0 -> 1 -> ... -> n-1 -> 0, in one segmented pipeline.
//
// The buffer is cut into n chunks (sizes differ by at most one element).
//   Reduce-scatter, steps s = 0 .. n-2:
//     rank r sends chunk r-s-1 to r+1 and reduces chunk r-s-2 from r-1 into
//     its own copy. After step n-2, rank r holds the full reduction of chunk r.
//   All-gather, steps s = 0 .. n-2:
//     rank r sends chunk r-s (the one it completed or just received) and
//     overwrites chunk r-s-1 with what r-1 sends.
// Bytes sent per rank: 2 (n-1)/n N; steps: 2 (n-1). Every rank ends with the
// bits its chunk's owner computed, so results are identical on all ranks.
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void ringAllReduce(Channel& ch, void* buf, size_t count) {
  std::vector<RingStep> steps = reduceScatterSteps(ch.rank(), ch.size());
  for (const RingStep& s : allGatherSteps(ch.rank(), ch.size())) steps.push_back(s);
  ringPipeline(ch, buf, evenCounts(count, ch.size()), steps);
}

}  // namespace clawcomm
