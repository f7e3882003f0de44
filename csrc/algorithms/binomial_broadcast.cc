// Binomial-tree broadcast.
//
// Ranks are renumbered v = (r - root) mod n. In round k (k = 0, 1, ..) every
// rank v < 2^k that already has the data sends it to v + 2^k.
// Implemented from each rank's view: receive once from the parent (v with
// its lowest set bit cleared), then send to children v + 2^j for the bits j
// below it, largest subtree first.
// Bytes sent by the root: N ceil(log2 n); steps: ceil(log2 n).
//
// The sends to the children go one at a time: the next starts when the last
// has left (into the transport), so the largest subtree gets the data first
// and starts forwarding it while the smaller ones wait their turn. Posted all
// at once, they shared the rank's link: over TCP the first child got its
// data only when the last did, and a broadcast to 8 hosts took 1.3-1.4x the
// log2(n) steps (bench/model_validation.py, 8 x 1 at 1 Gbit/s).
//
// Every child then sends its parent an empty acknowledgement frame. It costs
// one small message off the data path, and it is what catches ranks that
// disagree about the root: two self-declared roots would otherwise both just
// send, compare nothing, and return different data without an error. The
// acknowledgements are received through a view of their own, so that
// waiting for a send does not wait for a child's whole subtree.

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
  Channel acks(ch, everyRank(n));
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < n) {
      const int child = ringIndex(v + mask + root, n);
      acks.recv(child, nullptr, 0);  // the child's acknowledgement, at the end
      ch.send(child, buf, bytes);
      ch.wait();
    }
  }
  if (parent >= 0) ch.send(parent, nullptr, 0);
  ch.wait();
  acks.wait();
}

}  // namespace clawcomm
