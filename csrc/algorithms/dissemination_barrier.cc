// Dissemination barrier: in round k (k = 1, 2, 4, .. < n) rank r sends an
// empty frame to r + k and waits for one from r - k. After ceil(log2 n)
// rounds every rank has heard, directly or not, from every other rank.
#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void disseminationBarrier(Channel& ch) {
  const int n = ch.size();
  const int r = ch.rank();
  for (int k = 1; k < n; k <<= 1) {
    ch.send(ringIndex(r + k, n), nullptr, 0);
    ch.recv(ringIndex(r - k, n), nullptr, 0);
    ch.wait();
  }
}

}  // namespace clawcomm
