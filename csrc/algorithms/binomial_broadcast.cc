// Binomial-tree broadcast.
//
// Ranks are renumbered v = (r - root) mod n. In round k (k = 0, 1, ..) every
// rank v < 2^k that already has the data sends it to v + 2^k.
// Implemented from each rank's view: receive once from the parent (v with
// its lowest set bit cleared), then send to children v + 2^j for the bits j
// below it, largest subtree first.
// Bytes sent by the root: N ceil(log2 n); steps: ceil(log2 n).
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void binomialBroadcast(Channel& ch, void* buf, size_t bytes, int root) {
  const int n = ch.size();
  const int v = ringIndex(ch.rank() - root, n);
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      ch.recv(ringIndex(v - mask + root, n), buf, bytes);
      ch.wait();
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < n) ch.send(ringIndex(v + mask + root, n), buf, bytes);
  }
  ch.wait();
}

}  // namespace clawcomm
