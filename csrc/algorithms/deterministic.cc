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
// All-reduce: the reduce-scatter in place, then the layout's all-gather
// (direct, hierarchical or ring: it copies bits and adds nothing). Bytes:
// 2 (n-1)/n N each way. Reduce: the reduce-scatter, then the root gathers
// the chunks. AVG is a SUM here; the operation divides once at the end.
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

}  // namespace

void deterministicReduceScatter(Channel& ch, const void* in, void* out,
                                const std::vector<size_t>& counts) {
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
  const int pairs = (n + 1) / 2;  // the tree's first level (the last may be one leaf)
  const size_t segBytes = (counts[size_t(r)] + segments.count() - 1) / segments.count() * es;
  uint8_t* slots = ch.scratch(kAlgorithmScratch, size_t(pairs) * segBytes);
  Channel sends(ch, everyRank(n));  // waited for last: the input is not written
  auto postSends = [&](size_t j) {
    for (int s = 1; s < n; ++s) {
      const int q = ringIndex(r + s, n);
      size_t at, bytes;
      segments.of(q, j, &at, &bytes);
      if (bytes) sends.send(q, src + at, bytes);
    }
  };
  postSends(0);
  std::vector<const uint8_t*> node(static_cast<size_t>(pairs), nullptr);
  for (size_t j = 0; j < segments.count(); ++j) {
    size_t at, bytes;
    segments.of(r, j, &at, &bytes);
    const uint8_t* own = src + at;
    uint8_t* result = dst + (at - off[size_t(r)]);
    // Pair 0's slot is the result itself, unless that is this rank's own
    // input (in place) and this rank is not of pair 0: it is still to be
    // read when x0 arrives.
    const bool slot0IsResult = result != own || r < 2;
    auto slot = [&](int k) {
      return k == 0 && slot0IsResult ? result : slots + size_t(k) * segBytes;
    };
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
    // The next wave's sends go out before this rank adds, so peers can go on.
    if (j + 1 < segments.count()) postSends(j + 1);
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
  }
  sends.wait();
}

void deterministicAllReduce(Channel& ch, void* buf, size_t count) {
  const int n = ch.size(), r = ch.rank();
  if (n == 1) return;
  const std::vector<size_t> counts = evenCounts(count, n);
  uint8_t* b = static_cast<uint8_t*>(buf);
  uint8_t* mine = b + byteOffsets(counts, ch.elementBytes())[size_t(r)];
  // The reduce-scatter returns once every peer has taken its chunk from
  // this rank, so the all-gather may then overwrite them.
  deterministicReduceScatter(ch, buf, mine, counts);
  const Topology& topo = ch.topology();
  if (directLayout(topo)) {
    directAllGather(ch, mine, buf, counts);
  } else if (topo.hierarchical()) {
    hierarchicalAllGather(ch, buf, counts);
  } else {
    ringAllGather(ch, buf, counts);
  }
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
