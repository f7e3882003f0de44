// Direct reduce-scatter and all-gather, for a group on one host: every rank
// exchanges its pieces with every peer in one step, straight from the
// caller's input, with no working copy and no ring steps.
//
// Reduce-scatter: rank r sends chunk q of its input to each rank q and
// reduces the peers' chunk r into `out` one peer at a time (r+1, r+2, ...: a
// fixed order, so a run repeats its bits, and no two ranks read the same
// peer first); the first is added to r's own chunk as it arrives, which
// saves copying that chunk first. All-gather: rank r sends its input to
// every peer and receives every peer's into its place in `out`, all at
// once. Sends go out before the local copy, which moves bytes between its
// pieces (Channel::copyLocal), so peers keep going (by single copy where it
// is on: the reference points into the caller's input) while this rank
// copies its own part. Bytes each rank receives:
// (n-1)/n N, as the ring's; steps: 1 (all-gather), n-1 (reduce-scatter).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {
void directReduceScatter(Channel& ch, const void* in, void* out,
                         const std::vector<size_t>& counts) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> off = byteOffsets(counts, es);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(out);
  // Every chunk is cut into the same number of segments (at most
  // CLAWCOMM_SEGMENT_BYTES each), and the segments go in lockstep waves: a
  // rank sends segment j only once it has reduced segment j-1, so what a
  // peer reduces was written a segment ago and is still in cache. (One
  // frame per chunk let the writer run a whole ring ahead: a 64 MiB
  // reduce-scatter took longer than the all-reduce.)
  const ChunkSegments segments(counts, es, ch.settings().segmentBytes);
  if (n == 1) {
    if (counts[0]) std::memcpy(dst, src, counts[0] * es);
    return;
  }
  Channel sends(ch, everyRank(n));  // waited for last: the input is not written
  for (size_t j = 0; j < segments.count(); ++j) {
    for (int s = 1; s < n; ++s) {
      const int q = ringIndex(r + s, n);
      size_t at, bytes;
      segments.of(q, j, &at, &bytes);
      if (bytes) sends.send(q, src + at, bytes);
    }
    size_t at, bytes;
    segments.of(r, j, &at, &bytes);
    if (!bytes) continue;
    uint8_t* seg = dst + (at - off[r]);
    for (int s = 1; s < n; ++s) {
      // The first peer's segment is added to this rank's own as it arrives
      // (reduceFrom: no separate copy of the own chunk), the others to that.
      const int p = ringIndex(r + s, n);
      if (s == 1) {
        ch.recvInto(
            p, ReceiveSink::reduceFrom(seg, src + at, ch.signature().dtype, ch.signature().redop),
            bytes);
      } else {
        ch.recvReduce(p, seg, bytes);
      }
      ch.wait();
    }
  }
  sends.wait();
}

void directAllGather(Channel& ch, const void* in, void* out, const std::vector<size_t>& counts) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> off = byteOffsets(counts, es);
  uint8_t* dst = static_cast<uint8_t*>(out);
  const size_t mine = counts[r] * es;
  for (int s = 1; s < n; ++s) {
    const int q = ringIndex(r + s, n), p = ringIndex(r - s, n);
    if (mine) ch.send(q, in, mine);
    if (counts[p]) ch.recv(p, dst + off[p], counts[p] * es);
  }
  ch.progress();
  uint8_t* own = dst + off[r];
  const auto* src = static_cast<const uint8_t*>(in);
  if (mine && own != src) {
    if (own + mine <= src || src + mine <= own) {
      ch.copyLocal(own, src, mine);
    } else {
      std::memmove(own, src, mine);
    }
  }
  ch.wait();
}

}  // namespace clawcomm
