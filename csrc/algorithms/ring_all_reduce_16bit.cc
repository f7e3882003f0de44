// Ring all-reduce of float32 data with 16-bit values on the wire (float16 or
// bfloat16, the channel's dtype) and float32 accumulation at every step.
//
// Summing in 16 bits rounds every partial sum and every rank's own input;
// here each rank keeps its input and its partial sums in float32, and only
// what crosses the wire is rounded, once per hop. Bytes on the wire are half
// of a float32 ring all-reduce.
//
// The buffer is cut into n chunks (ring_all_reduce.cc); what is sent is
// encoded into 16-bit buffers of one segment (two, alternating) or, for
// this rank's finished chunk, one of its own. What arrives is decoded by the
// receive's sink (messenger/sink.h) straight out of the transport's memory,
// with no copy into a staging buffer first:
//   Reduce-scatter, steps s = 0 .. n-2: rank r encodes chunk r-s-1 to 16
//     bits and sends it to r+1; it receives chunk r-s-2 from r-1 and adds the
//     decoded values into its float32 copy (one fused decode-add pass).
//     After step n-2 rank r holds chunk r summed over all ranks, in float32.
//   Rounding: as it finishes its chunk, rank r also encodes it to 16 bits
//     and keeps the decoded values, the exact ones every other rank will
//     decode (one pass: addFrom16AndRound).
//   All-gather, steps s = 0 .. n-2: rank r sends the 16-bit copy of chunk
//     r-s (its own, then the one it just received: decoded 16-bit values
//     re-encode to the same bits) and decodes chunk r-s-1 from r-1 into its
//     buffer.
// Every step moves its chunk in segments of CLAWCOMM_SEGMENT_BYTES on the
// wire. A (step, segment) pair is a unit; units run in order, and while unit
// u is on the wire (and decoded as it arrives) the rank encodes unit u+1, so
// encoding overlaps the transfer instead of adding to it. Unit u+1 depends
// on unit u+1-segments (the same segment one step earlier), which is done by
// then whenever a chunk has two segments or more; with one segment the
// units run one after another.
// The pre-scale (1/n for a mean, against overflow) multiplies this rank's
// input inside the first kernel that reads it, and the post-scale multiplies
// the result inside the last kernel that writes it (or, for a segment this
// rank still has to forward, right after encoding it, while it is in cache):
// neither costs a pass over memory of its own.
// Bytes sent per rank: 2 (n-1)/n N/2 for N bytes of float32. All ranks end
// with bit-identical results.
//
// The reduce-scatter (ringReduceScatter16BitWire) is the first phase alone:
// rank r's chunk r, summed in float32 (not rounded to 16 bits: nobody else
// decodes it), post-scaled into `out`; the input serves as the partial sums'
// scratch. Bytes sent per rank: (n-1)/n N/2.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {

namespace {

void scale(float* x, size_t count, float factor) {
  if (factor == 1.0f) return;
  for (size_t i = 0; i < count; ++i) x[i] *= factor;
}

}  // namespace

namespace {

// Both phases, or (scatterOut set) the reduce-scatter alone into scatterOut.
void ring16(Channel& ch, float* buf, size_t count, float prescale, float postscale,
            float* scatterOut) {
  const DataType wire = ch.signature().dtype;
  const int n = ch.size();
  const int r = ch.rank();
  const size_t segElems = std::max<size_t>(1, ch.settings().segmentBytes / 2);
  if (n == 1) {
    // Nothing to exchange; round the way a larger group would.
    std::vector<uint16_t> tmp(std::min(count, segElems));
    float* to = scatterOut ? scatterOut : buf;
    for (size_t at = 0; at < count; at += segElems) {
      const size_t len = std::min(segElems, count - at);
      fromFloat32(wire, buf + at, tmp.data(), len, prescale);
      toFloat32(wire, tmp.data(), to + at, len, postscale);
    }
    return;
  }
  const std::vector<size_t> counts = evenCounts(count, n);
  std::vector<size_t> offsets(size_t(n) + 1, 0);
  for (int c = 0; c < n; ++c) offsets[c + 1] = offsets[c] + counts[c];
  const size_t largest = *std::max_element(counts.begin(), counts.end());
  // Every chunk is cut into the same number of segments.
  const size_t segments = std::max<size_t>(1, (largest + segElems - 1) / segElems);
  auto segment = [&](int c, size_t j, size_t* begin, size_t* len) {
    const size_t per = (counts[c] + segments - 1) / segments;
    const size_t lo = std::min(counts[c], j * per);
    *begin = offsets[c] + lo;
    *len = std::min(counts[c], lo + per) - lo;
  };
  const size_t bufElems = std::min(largest, segElems + 1);
  std::vector<uint16_t> out[2] = {std::vector<uint16_t>(bufElems), std::vector<uint16_t>(bufElems)};
  // Our finished chunk in 16 bits, encoded by the last reduce-scatter step
  // and sent from here by the first all-gather step.
  std::vector<uint16_t> own(scatterOut ? 0 : counts[r]);
  const int next = ringIndex(r + 1, n);
  const int prev = ringIndex(r - 1, n);

  // Unit u: phase 0 (reduce-scatter) or 1 (all-gather), step s, segment j.
  const size_t perPhase = size_t(n - 1) * segments;
  const size_t units = scatterOut ? perPhase : 2 * perPhase;
  struct Unit {
    bool gather;
    int step;
    size_t seg;
    int sendChunk, recvChunk;
  };
  auto unit = [&](size_t u) {
    Unit x;
    x.gather = u >= perPhase;
    const size_t k = u % perPhase;
    x.step = int(k / segments);
    x.seg = k % segments;
    x.sendChunk = ringIndex(r - x.step - (x.gather ? 0 : 1), n);
    x.recvChunk = ringIndex(r - x.step - (x.gather ? 1 : 2), n);
    return x;
  };
  // Where unit u's 16-bit payload is (or will be).
  auto payload = [&](size_t u, size_t begin) -> uint16_t* {
    const Unit x = unit(u);
    return x.gather && x.step == 0 ? own.data() + (begin - offsets[r]) : out[u % 2].data();
  };
  // Encodes what unit u sends into out[u % 2].
  auto prepare = [&](size_t u) {
    const Unit x = unit(u);
    size_t o, l;
    segment(x.sendChunk, x.seg, &o, &l);
    if (!x.gather) {
      // Step 0 sends our own input (its first use); later steps partial sums.
      fromFloat32(wire, buf + o, out[u % 2].data(), l, x.step == 0 ? prescale : 1.0f);
    } else if (x.step > 0) {
      // Forward what the previous step decoded (the same bits again); it
      // still lacks the post-scale, which it takes now, while in cache.
      fromFloat32(wire, buf + o, out[u % 2].data(), l);
      scale(buf + o, l, postscale);
    }  // (step 0 sends `own`, encoded when the chunk was finished)
  };
  // How unit u's payload is taken in as it arrives.
  auto sinkOf = [&](size_t u) {
    const Unit x = unit(u);
    size_t o, l;
    segment(x.recvChunk, x.seg, &o, &l);
    if (x.gather) {
      // A segment forwarded in the next step gets its post-scale then.
      return ReceiveSink::decode(buf + o, wire, x.step == n - 2 ? postscale : 1.0f);
    }
    if (x.step == n - 2 && !scatterOut) {
      // Our chunk is complete: encode it for the all-gather, and keep the
      // rounded values every other rank will decode.
      return ReceiveSink::decodeAddRound(buf + o, wire, own.data() + (o - offsets[r]), prescale,
                                         postscale);
    }
    return ReceiveSink::decodeAdd(buf + o, wire, prescale);  // first use of our input
  };
  auto post = [&](size_t u) {
    const Unit x = unit(u);
    size_t so, sl, ro, rl;
    segment(x.sendChunk, x.seg, &so, &sl);
    segment(x.recvChunk, x.seg, &ro, &rl);
    ch.send(next, payload(u, so), sl * 2);
    ch.recvInto(prev, sinkOf(u), rl * 2);
    ch.progress();  // the send starts before we compute
  };

  prepare(0);
  for (size_t u = 0; u < units; ++u) {
    post(u);
    // Unit u+1 reads what unit u+1-segments decoded (except in the first
    // reduce-scatter step): already done unless that is unit u itself.
    const bool ahead = u + 1 < units && (u + 1 < segments || u + 1 - segments < u);
    if (ahead) prepare(u + 1);
    ch.wait();
    if (!ahead && u + 1 < units) prepare(u + 1);
  }
  if (scatterOut) {
    const float* mine = buf + offsets[r];
    for (size_t i = 0; i < counts[r]; ++i) scatterOut[i] = mine[i] * postscale;
  }
}

}  // namespace

void ringAllReduce16BitWire(Channel& ch, float* buf, size_t count, float prescale,
                            float postscale) {
  ring16(ch, buf, count, prescale, postscale, nullptr);
}

void ringReduceScatter16BitWire(Channel& ch, float* buf, size_t count, float prescale,
                                float postscale, float* out) {
  ring16(ch, buf, count, prescale, postscale, out);
}

}  // namespace clawcomm
