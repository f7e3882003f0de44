// Ring all-reduce of float32 data with 16-bit values on the wire (float16 or
// bfloat16, the channel's dtype) and float32 accumulation at every step.
//
// Summing in 16 bits rounds every partial sum and every rank's own input;
// here each rank keeps its input and its partial sums in float32, and only
// what crosses the wire is rounded, once per hop. Bytes on the wire are half
// of a float32 ring all-reduce.
//
// The buffer is cut into n chunks (ring_all_reduce.cc), staged through two
// 16-bit buffers of one chunk each:
//   Reduce-scatter, steps s = 0 .. n-2: rank r encodes chunk r-s-1 to 16
//     bits and sends it to r+1; it receives chunk r-s-2 from r-1 and adds the
//     decoded values into its float32 copy (one fused decode-add pass).
//     After step n-2 rank r holds chunk r summed over all ranks, in float32.
//   Rounding: rank r rounds its chunk to 16 bits and back, so it keeps the
//     exact values every other rank will decode.
//   All-gather, steps s = 0 .. n-2: rank r sends the 16-bit copy of chunk
//     r-s (its own, then the one it just received: decoded 16-bit values
//     re-encode to the same bits) and decodes chunk r-s-1 from r-1 into its
//     buffer.
// Every step moves its chunk in segments of CLAWCOMM_SEGMENT_BYTES on the
// wire, each encoded, exchanged and decoded while it is in cache.
// Bytes sent per rank: 2 (n-1)/n N/2 for N bytes of float32. All ranks end
// with bit-identical results.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {

void ringAllReduce16BitWire(Channel& ch, float* buf, size_t count) {
  const DataType wire = ch.signature().dtype;
  const int n = ch.size();
  const int r = ch.rank();
  const std::vector<size_t> counts = evenCounts(count, n);
  std::vector<size_t> offsets(size_t(n) + 1, 0);
  for (int c = 0; c < n; ++c) offsets[c + 1] = offsets[c] + counts[c];
  const size_t largest = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  // Chunks move in segments of at most settings().segmentBytes on the wire,
  // so each segment is encoded, sent, received and decoded while it is
  // still in cache. Every chunk is cut into the same number of segments.
  const size_t segElems = std::max<size_t>(1, ch.settings().segmentBytes / 2);
  const size_t segments = std::max<size_t>(1, (largest + segElems - 1) / segElems);
  auto segment = [&](int c, size_t j, size_t* begin, size_t* len) {
    const size_t per = (counts[c] + segments - 1) / segments;
    const size_t lo = std::min(counts[c], j * per);
    *begin = offsets[c] + lo;
    *len = std::min(counts[c], lo + per) - lo;
  };
  std::vector<uint16_t> out(std::min(largest, segElems + 1)), in(out.size());
  std::vector<uint16_t> own(counts.empty() ? 0 : counts[r]);  // our chunk, as others see it
  const int next = ringIndex(r + 1, n);
  const int prev = ringIndex(r - 1, n);

  for (int s = 0; s < n - 1; ++s) {
    const int sendChunk = ringIndex(r - s - 1, n);
    const int recvChunk = ringIndex(r - s - 2, n);
    for (size_t j = 0; j < segments; ++j) {
      size_t so, sl, ro, rl;
      segment(sendChunk, j, &so, &sl);
      segment(recvChunk, j, &ro, &rl);
      fromFloat32(wire, buf + so, out.data(), sl);
      ch.send(next, out.data(), sl * 2);
      ch.recv(prev, in.data(), rl * 2);
      ch.wait();
      addFrom16(wire, buf + ro, in.data(), rl);
    }
  }

  // Round our finished chunk the way the others will see it.
  fromFloat32(wire, buf + offsets[r], own.data(), counts[r]);
  toFloat32(wire, own.data(), buf + offsets[r], counts[r]);

  // All-gather: send our rounded chunk, then forward each received segment
  // unchanged (re-encoding the decoded values would give the same bits).
  for (int s = 0; s < n - 1; ++s) {
    const int sendChunk = ringIndex(r - s, n);
    const int recvChunk = ringIndex(r - s - 1, n);
    for (size_t j = 0; j < segments; ++j) {
      size_t so, sl, ro, rl;
      segment(sendChunk, j, &so, &sl);
      segment(recvChunk, j, &ro, &rl);
      if (s == 0) {
        std::copy(own.begin() + long(so - offsets[r]), own.begin() + long(so - offsets[r] + sl),
                  out.begin());
      } else {
        fromFloat32(wire, buf + so, out.data(), sl);
      }
      ch.send(next, out.data(), sl * 2);
      ch.recv(prev, in.data(), rl * 2);
      ch.wait();
      toFloat32(wire, in.data(), buf + ro, rl);
    }
  }
}

}  // namespace clawcomm
