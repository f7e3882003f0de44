// Ring all-gather, in place: the second half of the ring all-reduce.
//
// Steps s = 0 .. n-2: rank r sends chunk r-s to r+1 (its own at s = 0, then
// the one it received in step s-1) and receives chunk r-s-1 from r-1.
// Bytes sent per rank: (n-1)/n N; steps: n-1.
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void ringAllGather(Channel& ch, void* buf, const std::vector<size_t>& counts) {
  ringPipeline(ch, buf, counts, allGatherSteps(ch.rank(), ch.size()));
}

}  // namespace clawcomm
