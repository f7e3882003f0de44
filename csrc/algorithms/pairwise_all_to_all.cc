// All-to-all with uneven splits, pairwise: for s = 1 .. n-1, rank r sends its
// block for r+s and receives the block from r-s. All n-1 exchanges are posted
// at once and the progress engine interleaves them; each pair carries one
// frame per direction, so nothing can deadlock. Bytes sent per rank: the sum
// of its blocks for the others; one step.
#include <cstdint>
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void pairwiseAllToAll(Channel& ch, const void* in, const std::vector<size_t>& sendBytes, void* out,
                      const std::vector<size_t>& recvBytes) {
  const int n = ch.size();
  const int r = ch.rank();
  std::vector<size_t> sendOff(size_t(n) + 1, 0), recvOff(size_t(n) + 1, 0);
  for (int p = 0; p < n; ++p) {
    sendOff[p + 1] = sendOff[p] + sendBytes[p];
    recvOff[p + 1] = recvOff[p] + recvBytes[p];
  }
  const uint8_t* i = static_cast<const uint8_t*>(in);
  uint8_t* o = static_cast<uint8_t*>(out);
  for (int s = 1; s < n; ++s) {
    const int to = ringIndex(r + s, n);
    const int from = ringIndex(r - s, n);
    ch.send(to, i + sendOff[to], sendBytes[to]);
    ch.recv(from, o + recvOff[from], recvBytes[from]);
  }
  ch.progress();  // the frames (or references) out first: peers read while this rank copies
  ch.copyLocal(o + recvOff[r], i + sendOff[r], recvBytes[r]);
  ch.wait();
}

}  // namespace clawcomm
