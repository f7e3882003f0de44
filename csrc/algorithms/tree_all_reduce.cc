// Recursive-doubling all-reduce: the latency-optimal choice for small
// messages (log2 n steps instead of the ring's 2 (n-1)).
//
// Let p be the largest power of two <= n and e = n - p the extra ranks.
//   Step 1 (only if e > 0): fold. Among ranks 0 .. 2e-1, each even rank
//     sends its whole buffer to the odd rank above it and sits out; the odd
//     rank reduces it in. p ranks remain, renumbered 0 .. p-1.
//   Step 2: for mask = 1, 2, 4, .. < p: exchange the whole buffer with the
//     (renumbered) rank `self ^ mask` and reduce. After log2 p exchanges every
//     remaining rank holds the full result.
//   Step 3 (only if e > 0): unfold. Each odd rank below 2e sends the result
//     back to the even rank it absorbed.
// Bytes sent per rank: N log2 p (+ N for the fold); steps: log2 p (+ 2).
// Partners combine the same two operands (a op b on one side, b op a on the
// other, and every supported op is commutative), so every rank ends with
// identical bits.
#include <cstring>
#include <vector>

#include "algorithms/algorithms.h"

namespace clawcomm {

void treeAllReduce(Channel& ch, void* buf, size_t count) {
  const int n = ch.size();
  const int r = ch.rank();
  if (n == 1) return;
  const size_t bytes = count * ch.elementBytes();
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;

  // Step 1: fold the extra ranks into their odd neighbours.
  int self = -1;  // rank among the p that take part in step 2
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      ch.send(r + 1, buf, bytes);
      ch.wait();
    } else {
      ch.recvReduce(r - 1, buf, bytes);
      ch.wait();
      self = r / 2;
    }
  } else {
    self = r - extra;
  }

  // Step 2: recursive doubling. Our buffer is copied aside for sending so
  // that the partner's data can be reduced into it while it streams in.
  if (self >= 0) {
    uint8_t* outgoing = ch.scratch(kAlgorithmScratch, bytes);
    for (int mask = 1; mask < p; mask <<= 1) {
      const int partnerSelf = self ^ mask;
      const int partner = partnerSelf < extra ? partnerSelf * 2 + 1 : partnerSelf + extra;
      if (bytes) std::memcpy(outgoing, buf, bytes);
      ch.send(partner, outgoing, bytes);
      ch.recvReduce(partner, buf, bytes);
      ch.wait();
    }
  }

  // Step 3: hand the result back to the ranks that sat out.
  if (r < 2 * extra) {
    if (r % 2 == 1) {
      ch.send(r - 1, buf, bytes);
    } else {
      ch.recv(r + 1, buf, bytes);
    }
    ch.wait();
  }
}

}  // namespace clawcomm
