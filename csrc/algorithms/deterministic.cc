// The deterministic reductions (CLAWCOMM_DETERMINISTIC=1): every element's
// result is one fixed expression of the n ranks' inputs, whatever the
// layout, transport, segment size or timing.
//
// The canonical tree: the inputs x0 .. x(n-1) in rank order are combined in
// pairs of neighbours, recursively, left operand first. In place over
// v[0..n-1] = x: for s = 1, 2, 4, ... while s < n, for every i that is a
// multiple of 2s with i + s < n, v[i] = v[i] op v[i+s]; the result is v[0].
//   n = 4: (x0 + x1) + (x2 + x3)
//   n = 5: ((x0 + x1) + (x2 + x3)) + x4
//   n = 6: ((x0 + x1) + (x2 + x3)) + (x4 + x5)
// Every node is one element-wise call of the reduce kernels (a op b, one
// element at a time, float16 and bfloat16 rounded once per node), so the
// expression, not the SIMD width nor how bytes are cut, decides the bits.
//
// Reduce-scatter: chunk q (counts[q] elements) is owned by rank q.
//   1. Every rank sends chunk q of its input to each rank q (n-1 messages),
//      one segment (CLAWCOMM_SEGMENT_BYTES) per wave, one wave ahead.
//   2. The owner forms the tree's first level as the leaves arrive: for the
//      pair (2k, 2k+1), x(2k) lands in a slot and x(2k+1) is added to it
//      (from the transport's memory: no copy of its own); where this rank
//      is one of the pair, its own input is the other operand. A last,
//      unpaired leaf stays as it is.
//   3. It adds the pairs' sums by the tree's upper levels, the root's
//      straight into `out`.
// Bytes each rank sends and receives: (n-1)/n N, the ring's. Any transport:
// every pair of ranks talks directly (shared memory, TCP, mixed).
//
// All-reduce: the reduce-scatter in place, with a direct all-gather in the
// same pipeline: each reduced segment goes to every peer as soon as it is
// done (it copies bits and adds nothing), so the gather of one segment
// overlaps the reduction of the next, as in the ring's pipeline. Bytes:
// 2 (n-1)/n N each way. Reduce: the reduce-scatter, then the
// root gathers the chunks. AVG is a SUM here; the operation divides once at
// the end.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {
namespace {

// dst = a op b, through an L1 block, so that `dst` may be `b` (an in-place
// all-reduce's own input as the last, unpaired leaf).
void combineInto(const OpSignature& sig, uint8_t* dst, const uint8_t* a, const uint8_t* b,
                 size_t bytes) {
  if (dst == a) {
    reduceInto(sig.dtype, sig.redop, dst, b, bytes / elementSize(sig.dtype));
    return;
  }
  constexpr size_t kPiece = 4096;  // a multiple of every element size
  alignas(64) uint8_t piece[kPiece];
  for (size_t at = 0; at < bytes; at += kPiece) {
    const size_t m = std::min(kPiece, bytes - at);
    std::memcpy(piece, a + at, m);
    reduceInto(sig.dtype, sig.redop, piece, b + at, m / elementSize(sig.dtype));
    std::memcpy(dst + at, piece, m);
  }
}

// The reduce-scatter, and with `gather` (the all-reduce's buffer, which is
// `in`) the all-gather too, segment by segment: once this rank's segment j
// is reduced it goes to every peer, and the peers' segment j lands in
// `gather`, while later segments are still being reduced.
//
// Between each pair of ranks, one direction's frames go in this order:
// reduce-scatter segment 0, then per wave j reduce-scatter segment j+1 and
// all-gather segment j; the receives are posted in the same order (wave j:
// reduce-scatter segment j, then all-gather segment j-1). An all-gather
// segment overwrites a piece of `gather` that this rank sent to that peer
// for reducing: the peer sends its result only once it has received all
// of it, so the piece is no longer read.
void treeReduceScatter(Channel& ch, const void* in, void* out, const std::vector<size_t>& counts,
                       uint8_t* gather) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> off = byteOffsets(counts, es);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(out);
  if (n == 1) {
    if (counts[0] && dst != src) std::memmove(dst, src, counts[0] * es);
    return;
  }
  const OpSignature& sig = ch.signature();
  const ChunkSegments segments(counts, es, ch.settings().segmentBytes);
  const size_t waves = segments.count();
  const int pairs = (n + 1) / 2;  // the tree's first level (the last may be one leaf)
  const size_t segBytes = (counts[size_t(r)] + waves - 1) / waves * es;
  uint8_t* slots = ch.scratch(kAlgorithmScratch, size_t(pairs) * segBytes);
  Channel sends(ch, everyRank(n));     // waited for last: the input is not written
  Channel gathered(ch, everyRank(n));  // the all-gather's receives, waited for last
  auto postSends = [&](size_t j) {
    for (int s = 1; s < n; ++s) {
      const int q = ringIndex(r + s, n);
      size_t at, bytes;
      segments.of(q, j, &at, &bytes);
      if (bytes) sends.send(q, src + at, bytes);
    }
  };
  auto postGathers = [&](size_t j) {
    for (int s = 1; s < n; ++s) {
      const int q = ringIndex(r - s, n);
      size_t at, bytes;
      segments.of(q, j, &at, &bytes);
      if (bytes) gathered.recv(q, gather + at, bytes);
    }
  };
  postSends(0);
  std::vector<const uint8_t*> node(static_cast<size_t>(pairs), nullptr);
  for (size_t j = 0; j < waves; ++j) {
    size_t at, bytes;
    segments.of(r, j, &at, &bytes);
    const uint8_t* own = src + at;
    uint8_t* result = dst + (at - off[size_t(r)]);
    // The sum of this rank's own pair is formed in `result`: its own input
    // there (in place) is read only as that pair's operand. The others in
    // scratch slots.
    auto slot = [&](int k) { return k == r / 2 ? result : slots + size_t(k) * segBytes; };
    if (bytes) {
      // Step 2: the left leaves (or whole pairs that hold this rank), then
      // the right leaves onto them.
      for (int k = 0; k < pairs; ++k) {
        const int left = 2 * k, right = left + 1;
        node[size_t(k)] = slot(k);
        if (right >= n) {
          if (left == r) {
            node[size_t(k)] = own;
          } else {
            ch.recv(left, slot(k), bytes);
          }
        } else if (left == r) {
          ch.recvInto(right, ReceiveSink::reduceFrom(slot(k), own, sig.dtype, sig.redop), bytes);
        } else if (right == r) {
          ch.recvInto(left, ReceiveSink::reduceOnto(slot(k), own, sig.dtype, sig.redop), bytes);
        } else {
          ch.recv(left, slot(k), bytes);
        }
      }
      ch.wait();
      for (int k = 0; k < pairs; ++k) {
        const int left = 2 * k, right = left + 1;
        if (right < n && left != r && right != r) ch.recvReduce(right, slot(k), bytes);
      }
    }
    if (gather && j > 0) postGathers(j - 1);
    // The next wave's sends go out before this rank adds, so peers can go on.
    if (j + 1 < waves) postSends(j + 1);
    if (!bytes) continue;
    ch.wait();
    // Step 3: the upper levels; the root's node is written to `result`.
    for (int s = 1; s < pairs; s *= 2) {
      for (int i = 0; i + s < pairs; i += 2 * s) {
        uint8_t* to = (i == 0 && 2 * s >= pairs) ? result : slot(i);
        combineInto(sig, to, node[size_t(i)], node[size_t(i + s)], bytes);
        node[size_t(i)] = to;
      }
    }
    if (node[0] != result) std::memcpy(result, node[0], bytes);
    if (gather) {
      for (int s = 1; s < n; ++s) sends.send(ringIndex(r + s, n), result, bytes);
    }
  }
  if (gather) postGathers(waves - 1);
  gathered.wait();
  sends.wait();
}

}  // namespace

void deterministicReduceScatter(Channel& ch, const void* in, void* out,
                                const std::vector<size_t>& counts) {
  treeReduceScatter(ch, in, out, counts, nullptr);
}

void deterministicAllReduce(Channel& ch, void* buf, size_t count) {
  const int n = ch.size(), r = ch.rank();
  if (n == 1) return;
  const std::vector<size_t> counts = evenCounts(count, n);
  uint8_t* b = static_cast<uint8_t*>(buf);
  treeReduceScatter(ch, buf, b + byteOffsets(counts, ch.elementBytes())[size_t(r)], counts, b);
}

void deterministicReduce(Channel& ch, void* buf, size_t count, int root) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> counts = evenCounts(count, n);
  const std::vector<size_t> off = byteOffsets(counts, es);
  uint8_t* b = static_cast<uint8_t*>(buf);
  // The root reduces its chunk in place; the others into scratch, leaving
  // `buf` as it was.
  uint8_t* mine = r == root ? b + off[size_t(r)] : ch.scratch(kOpScratch, counts[size_t(r)] * es);
  deterministicReduceScatter(ch, buf, mine, counts);
  if (r != root) {
    if (counts[size_t(r)]) ch.send(root, mine, counts[size_t(r)] * es);
  } else {
    for (int p = 0; p < n; ++p) {
      if (p != root && counts[size_t(p)]) ch.recv(p, b + off[size_t(p)], counts[size_t(p)] * es);
    }
  }
  ch.wait();
}

}  // namespace clawcomm
