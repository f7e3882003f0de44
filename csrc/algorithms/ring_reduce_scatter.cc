// Ring reduce-scatter, in place: the first half of the ring all-reduce.
//
// Steps s = 0 .. n-2: rank r sends chunk r-s-1 to r+1 and reduces chunk
// r-s-2 from r-1 into its buffer. After the last step chunk r is complete.
// Bytes sent per rank: (n-1)/n N; steps: n-1. Chunks may have any sizes
// (counts[c] elements each), so uneven splits need no padding.
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void ringReduceScatter(Channel& ch, void* buf, const std::vector<size_t>& counts) {
  ringPipeline(ch, buf, counts, reduceScatterSteps(ch.rank(), ch.size()));
}

}  // namespace clawcomm
