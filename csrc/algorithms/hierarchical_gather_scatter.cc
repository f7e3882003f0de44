// Hierarchical reduce-scatter and all-gather, for m hosts with k ranks each:
// the network carries each byte once per host pair instead of once per
// ring step that crosses a host.
//
// Rank R(h, j) is the j-th rank of host h. Both work on a scratch copy that
// holds the per-rank blocks local-index-major, [j][h], so that what one
// local rank owns across hosts is contiguous.
//
// Reduce-scatter (input: every rank's blocks, in rank order):
//   1. Ring reduce-scatter inside the host over the k segments [j][*]:
//      local rank i ends with its host's sum of blocks R(*, i).
//   2. Ring reduce-scatter across hosts, among the i-th ranks of every
//      host, over segment i: rank R(h, i) ends with block R(h, i) summed
//      over every rank.
//   Bytes per host link: (m-1)/m N, against the flat ring's (n-1)/n N.
// All-gather (the same steps backwards):
//   1. Ring all-gather across hosts of this rank's block within segment i.
//   2. Ring all-gather inside the host of the k segments.
//   Then the blocks go back to rank order.
#include <cstring>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {
namespace {

// The layout both share: for each (j, h), the rank R(h, j), its block's
// offset in rank order and in the scratch's [j][h] order, in elements.
struct Blocks {
  std::vector<int> local, cross;                   // this rank's subgroups
  std::vector<std::vector<int>> rank;              // rank[j][h] = R(h, j)
  std::vector<size_t> rankOffset;                  // per global rank
  std::vector<std::vector<size_t>> scratchOffset;  // [j][h]
  std::vector<size_t> segmentCounts;               // per j: sum over h
  std::vector<size_t> crossCounts;                 // this rank's segment, per h
  int i = 0, h = 0;                                // this rank's local and host index
};

Blocks layOut(const Channel& ch, const std::vector<size_t>& counts) {
  const Topology& t = ch.topology();
  Blocks b;
  b.local = t.localGroup(ch.rank());
  b.cross = t.crossGroup(ch.rank());
  const int k = int(b.local.size()), m = int(b.cross.size());
  for (int j = 0; j < k; ++j) {
    b.rank.push_back(t.crossGroup(b.local[size_t(j)]));
    if (b.local[size_t(j)] == ch.rank()) b.i = j;
  }
  for (int x = 0; x < m; ++x) {
    if (b.cross[size_t(x)] == ch.rank()) b.h = x;
  }
  b.rankOffset.assign(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) b.rankOffset[r + 1] = b.rankOffset[r] + counts[r];
  size_t at = 0;
  b.scratchOffset.assign(size_t(k), std::vector<size_t>(size_t(m), 0));
  b.segmentCounts.assign(size_t(k), 0);
  for (int j = 0; j < k; ++j) {
    for (int x = 0; x < m; ++x) {
      b.scratchOffset[size_t(j)][size_t(x)] = at;
      const size_t c = counts[size_t(b.rank[size_t(j)][size_t(x)])];
      at += c;
      b.segmentCounts[size_t(j)] += c;
    }
  }
  for (int x = 0; x < m; ++x)
    b.crossCounts.push_back(counts[size_t(b.rank[size_t(b.i)][size_t(x)])]);
  return b;
}

// Copies every block between rank order (`ranked`) and [j][h] order.
void permute(const Blocks& b, const std::vector<size_t>& counts, size_t es, uint8_t* ranked,
             uint8_t* scratch, bool toScratch) {
  for (size_t j = 0; j < b.rank.size(); ++j) {
    for (size_t x = 0; x < b.rank[j].size(); ++x) {
      const int r = b.rank[j][x];
      uint8_t* a = ranked + b.rankOffset[size_t(r)] * es;
      uint8_t* s = scratch + b.scratchOffset[j][x] * es;
      const size_t bytes = counts[size_t(r)] * es;
      if (bytes == 0) continue;
      if (toScratch) {
        std::memcpy(s, a, bytes);
      } else {
        std::memcpy(a, s, bytes);
      }
    }
  }
}

}  // namespace

void hierarchicalReduceScatter(Channel& ch, void* buf, const std::vector<size_t>& counts) {
  const Blocks b = layOut(ch, counts);
  const size_t es = ch.elementBytes();
  uint8_t* ranked = static_cast<uint8_t*>(buf);
  uint8_t* scratch = ch.scratch(kAlgorithmScratch, b.rankOffset.back() * es);
  permute(b, counts, es, ranked, scratch, true);
  Channel local(ch, b.local), cross(ch, b.cross);
  ringReduceScatter(local, scratch, b.segmentCounts);
  ringReduceScatter(cross, scratch + b.scratchOffset[size_t(b.i)][0] * es, b.crossCounts);
  const size_t mine = counts[size_t(ch.rank())] * es;
  if (mine) {
    std::memcpy(ranked + b.rankOffset[size_t(ch.rank())] * es,
                scratch + b.scratchOffset[size_t(b.i)][size_t(b.h)] * es, mine);
  }
}

void hierarchicalAllGather(Channel& ch, void* buf, const std::vector<size_t>& counts) {
  const Blocks b = layOut(ch, counts);
  const size_t es = ch.elementBytes();
  uint8_t* ranked = static_cast<uint8_t*>(buf);
  uint8_t* scratch = ch.scratch(kAlgorithmScratch, b.rankOffset.back() * es);
  const size_t mine = counts[size_t(ch.rank())] * es;
  if (mine) {
    std::memcpy(scratch + b.scratchOffset[size_t(b.i)][size_t(b.h)] * es,
                ranked + b.rankOffset[size_t(ch.rank())] * es, mine);
  }
  Channel local(ch, b.local), cross(ch, b.cross);
  ringAllGather(cross, scratch + b.scratchOffset[size_t(b.i)][0] * es, b.crossCounts);
  ringAllGather(local, scratch, b.segmentCounts);
  permute(b, counts, es, ranked, scratch, false);
}

}  // namespace clawcomm
