// Binomial-tree reduce: the broadcast tree run backwards.
//
// Ranks are renumbered v = (r - root) mod n. Each rank first reduces the
// buffers of its children v + 2^j (for the bits j below its lowest set bit),
// smallest subtree first, then sends the partial result to its parent.
// Bytes received by the root: N ceil(log2 n); steps: ceil(log2 n).
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void binomialReduce(Channel& ch, void* buf, size_t count, int root) {
  const int n = ch.size();
  const int v = ringIndex(ch.rank() - root, n);
  const size_t bytes = count * ch.elementBytes();
  for (int mask = 1; mask < n; mask <<= 1) {
    if (v & mask) {
      ch.send(ringIndex(v - mask + root, n), buf, bytes);
      ch.wait();
      return;
    }
    if (v + mask < n) {
      ch.recvReduce(ringIndex(v + mask + root, n), buf, bytes);
      ch.wait();
    }
  }
}

}  // namespace clawcomm
