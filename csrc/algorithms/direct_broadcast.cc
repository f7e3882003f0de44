// Direct broadcast, for a group on one host: the root offers its buffer to
// every peer at once and each peer reads it in one step.
//
// The root posts one send per peer (r+1, r+2, ...); the frames go by
// single copy where it is on and the message is large enough
// (Messenger::referenceSuits: under this algorithm at any size, under the
// tree's only up to 8 MiB), so every peer copies straight out of the root's
// buffer, all of them at once, and the root's own core is free for one of
// them. Below the single-copy size, or with it off, the root would copy the
// message into n-1 rings one after another; the cost model (selection.cc)
// then never picks it over the tree. Each peer acknowledges with an empty
// frame, as in the binomial broadcast, so that ranks that disagree about
// the root fail instead of returning different data.
// Bytes each peer receives: N; steps: 1 (+1 acknowledgement).

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void directBroadcast(Channel& ch, void* buf, size_t bytes, int root) {
  const int n = ch.size(), r = ch.rank();
  if (r != root) {
    ch.recv(root, buf, bytes);
    ch.wait();
    ch.send(root, nullptr, 0);
    ch.wait();
    return;
  }
  Channel acks(ch, everyRank(n));
  for (int s = 1; s < n; ++s) {
    const int p = ringIndex(r + s, n);
    acks.recv(p, nullptr, 0);
    ch.send(p, buf, bytes);
  }
  ch.wait();
  acks.wait();
}

}  // namespace clawcomm
