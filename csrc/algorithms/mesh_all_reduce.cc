// The mesh all-reduces: every rank exchanges with every peer directly, in
// one step (one-shot) or two (two-shot), where the ring takes 2(n-1) steps
// and recursive doubling log2 n (+2 when n is not a power of two).
//
// One-shot: rank r sends its whole input to every peer at once and folds
// the n inputs in rank order, x0 op x1 op ... op x(n-1), taking each peer's
// as it comes out of the transport; the same order on every rank gives
// every rank the same bits. Bytes each rank sends and receives: (n-1) N;
// reductions: (n-1) N. One synchronisation, so it is the small messages'
// algorithm; it runs on any transport, across hosts too.
//
// Two-shot: the direct reduce-scatter of the buffer in place (rank r
// reduces chunk r from every peer's input), then the direct all-gather of
// the reduced chunks (direct_gather_scatter.cc). Bytes: 2 (n-1)/n N, the
// ring's, in 2 steps of n-1 messages. One host.
#include <cstdint>
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {

void oneShotAllReduce(Channel& ch, void* buf, size_t count) {
  const int n = ch.size(), r = ch.rank();
  if (n == 1) return;
  const size_t bytes = count * ch.elementBytes();
  // The input goes out from a copy: `buf` accumulates the result while the
  // sends may still be reading.
  uint8_t* own = ch.scratch(kAlgorithmScratch, bytes);
  if (bytes) std::memcpy(own, buf, bytes);
  Channel sends(ch, everyRank(n));  // waited for last
  for (int s = 1; s < n; ++s) sends.send(ringIndex(r + s, n), own, bytes);
  const OpSignature& sig = ch.signature();
  for (int p = 0; p < n; ++p) {
    if (p == r) {
      // Rank 0's accumulator starts as its own input, already in `buf`.
      if (p > 0 && count) reduceInto(sig.dtype, sig.redop, buf, own, count);
      continue;
    }
    if (p == 0) {
      ch.recv(p, buf, bytes);
    } else {
      ch.recvReduce(p, buf, bytes);
    }
    ch.wait();
  }
  sends.wait();
}

void twoShotAllReduce(Channel& ch, void* buf, size_t count) {
  const int n = ch.size(), r = ch.rank();
  if (n == 1) return;
  const std::vector<size_t> counts = evenCounts(count, n);
  uint8_t* mine = static_cast<uint8_t*>(buf) + byteOffsets(counts, ch.elementBytes())[size_t(r)];
  // The reduce-scatter reads chunk r of `buf` and writes it in place; it
  // returns once every peer has taken its chunk from this rank, so the
  // all-gather may then overwrite them.
  directReduceScatter(ch, buf, mine, counts);
  directAllGather(ch, mine, buf, counts);
}

}  // namespace clawcomm
