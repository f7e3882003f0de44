// Direct reduce-scatter and all-gather, for a group on one host: every rank
// exchanges its pieces with every peer in one step, straight from the
// caller's input, with no working copy and no ring steps.
//
// Reduce-scatter: rank r sends chunk q of its input to each rank q, copies
// its own chunk into `out`, and reduces the peers' chunk r into it one peer
// at a time (r+1, r+2, ...: a fixed order, so a run repeats its bits, and
// no two ranks read the same peer first). All-gather: rank r sends its input
// to every peer and receives every peer's into its place in `out`, all at
// once. Sends go out before the local copy, so peers read (by single copy
// where it is on: the messenger's reference points into the caller's input)
// while this rank copies its own part. Bytes each rank receives:
// (n-1)/n N, as the ring's; steps: 1 (all-gather), n-1 (reduce-scatter).
#include <cstdint>
#include <cstring>
#include <numeric>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {
namespace {

std::vector<size_t> offsetsOf(const std::vector<size_t>& counts, size_t es) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t c = 0; c < counts.size(); ++c) off[c + 1] = off[c] + counts[c] * es;
  return off;
}

std::vector<int> everyone(int n) {
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

}  // namespace

bool useDirect(const Topology& topo, const Settings& settings) {
  return topo.hosts() == 1 && topo.size() <= kDirectMaxRanks && settings.algo == "auto";
}

void directReduceScatter(Channel& ch, const void* in, void* out,
                         const std::vector<size_t>& counts) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> off = offsetsOf(counts, es);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  Channel sends(ch, everyone(n));  // waited for last: peers read while this rank reduces
  for (int s = 1; s < n; ++s) {
    const int q = ringIndex(r + s, n);
    if (counts[q]) sends.send(q, src + off[q], counts[q] * es);
  }
  sends.progress();
  const size_t mine = counts[r] * es;
  if (mine) {
    std::memcpy(out, src + off[r], mine);
    for (int s = 1; s < n; ++s) {
      ch.recvReduce(ringIndex(r + s, n), out, mine);
      ch.wait();
    }
  }
  sends.wait();
}

void directAllGather(Channel& ch, const void* in, void* out, const std::vector<size_t>& counts) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> off = offsetsOf(counts, es);
  uint8_t* dst = static_cast<uint8_t*>(out);
  const size_t mine = counts[r] * es;
  for (int s = 1; s < n; ++s) {
    const int q = ringIndex(r + s, n), p = ringIndex(r - s, n);
    if (mine) ch.send(q, in, mine);
    if (counts[p]) ch.recv(p, dst + off[p], counts[p] * es);
  }
  ch.progress();
  if (mine && dst + off[r] != in) std::memmove(dst + off[r], in, mine);
  ch.wait();
}

}  // namespace clawcomm
