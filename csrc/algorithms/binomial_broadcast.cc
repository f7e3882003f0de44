// Binomial-tree broadcast.
//
// Ranks are renumbered v = (r - root) mod n. In round k (k = 0, 1, ..) every
// rank v < 2^k that already has the data sends it to v + 2^k.
// Implemented from each rank's view: receive once from the parent (v with
// its lowest set bit cleared), then send to children v + 2^j for the bits j
// below it, largest subtree first.
// Bytes sent by the root: N ceil(log2 n); steps: ceil(log2 n).
//
// Every child then sends its parent an empty acknowledgement frame. It costs
// one small message off the data path, and it is what catches ranks that
// disagree about the root: two self-declared roots would otherwise both just
// send, compare nothing, and return different data without an error.
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void binomialBroadcast(Channel& ch, void* buf, size_t bytes, int root) {
  const int n = ch.size();
  const int v = ringIndex(ch.rank() - root, n);
  int parent = -1;
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      parent = ringIndex(v - mask + root, n);
      ch.recv(parent, buf, bytes);
      ch.wait();
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < n) {
      const int child = ringIndex(v + mask + root, n);
      ch.send(child, buf, bytes);
      ch.recv(child, nullptr, 0);  // the child's acknowledgement
    }
  }
  if (parent >= 0) ch.send(parent, nullptr, 0);
  ch.wait();
}

}  // namespace clawcomm
