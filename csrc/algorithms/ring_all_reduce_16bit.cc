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
//     r-s (its own, then the one it just received, forwarded unchanged) and
//     decodes chunk r-s-1 from r-1 into its buffer.
// Bytes sent per rank: 2 (n-1)/n N/2 for N bytes of float32. All ranks end
// with bit-identical results.
#include <algorithm>
#include <cstdint>
#include <utility>
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
  std::vector<uint16_t> out(largest), in(largest);
  const int next = ringIndex(r + 1, n);
  const int prev = ringIndex(r - 1, n);

  for (int s = 0; s < n - 1; ++s) {
    const int sendChunk = ringIndex(r - s - 1, n);
    const int recvChunk = ringIndex(r - s - 2, n);
    fromFloat32(wire, buf + offsets[sendChunk], out.data(), counts[sendChunk]);
    ch.send(next, out.data(), counts[sendChunk] * 2);
    ch.recv(prev, in.data(), counts[recvChunk] * 2);
    ch.wait();
    addFrom16(wire, buf + offsets[recvChunk], in.data(), counts[recvChunk]);
  }

  // Round our finished chunk the way the others will see it.
  fromFloat32(wire, buf + offsets[r], out.data(), counts[r]);
  toFloat32(wire, out.data(), buf + offsets[r], counts[r]);

  for (int s = 0; s < n - 1; ++s) {
    const int sendChunk = ringIndex(r - s, n);
    const int recvChunk = ringIndex(r - s - 1, n);
    ch.send(next, out.data(), counts[sendChunk] * 2);
    ch.recv(prev, in.data(), counts[recvChunk] * 2);
    ch.wait();
    toFloat32(wire, in.data(), buf + offsets[recvChunk], counts[recvChunk]);
    std::swap(out, in);  // forward what arrived, unchanged
  }
}

}  // namespace clawcomm
