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
//
// Large buffers are cut into pieces and pipelined, as the hierarchical
// all-reduce is: piece p holds the p-th part of every rank's block, laid out
// [j][h] in a region of its own, and while piece p crosses the network the
// next (reduce-scatter) or the one before (all-gather) runs its shared-
// memory ring and its copies, so they hide behind the network. Each lane
// runs its rings in piece order on every rank, so frames always match.
#include <cstring>
#include <functional>
#include <memory>
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

// Copies every block between rank order (`ranked`, block r at `at[r]`
// elements) and [j][h] order.
void permute(const Blocks& b, const std::vector<size_t>& counts, const std::vector<size_t>& at,
             size_t es, uint8_t* ranked, uint8_t* scratch, bool toScratch) {
  for (size_t j = 0; j < b.rank.size(); ++j) {
    for (size_t x = 0; x < b.rank[j].size(); ++x) {
      const int r = b.rank[j][x];
      uint8_t* a = ranked + at[size_t(r)] * es;
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

// The pieces of a pipelined run: piece p holds part p of every rank's block
// (evenCounts of it), in scratch region p, laid out as `blocks[p]` says.
struct Pieces {
  std::vector<Blocks> blocks;
  std::vector<std::vector<size_t>> counts;  // [p][r]: part p of rank r's block
  std::vector<std::vector<size_t>> ranked;  // [p][r]: where it sits in rank order
  std::vector<size_t> region;               // [p]: where region p starts in the scratch
};

Pieces cutPieces(const Channel& ch, const std::vector<size_t>& counts, size_t pieces) {
  Pieces out;
  std::vector<size_t> rankOffset(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) rankOffset[r + 1] = rankOffset[r] + counts[r];
  std::vector<std::vector<size_t>> parts;  // [r][p]
  for (size_t c : counts) parts.push_back(evenCounts(c, int(pieces)));
  std::vector<size_t> done(counts.size(), 0);  // elements of each block in earlier pieces
  size_t region = 0;
  for (size_t p = 0; p < pieces; ++p) {
    std::vector<size_t> cp, at;
    for (size_t r = 0; r < counts.size(); ++r) {
      cp.push_back(parts[r][p]);
      at.push_back(rankOffset[r] + done[r]);
      done[r] += parts[r][p];
    }
    out.blocks.push_back(layOut(ch, cp));
    out.region.push_back(region);
    region += out.blocks.back().rankOffset.back();
    out.counts.push_back(std::move(cp));
    out.ranked.push_back(std::move(at));
  }
  return out;
}

// Runs every piece through two rings in turn, `first` then `second`, each
// lane in piece order; piece p's second ring starts once its first has
// ended, and `done(p)` follows it. One lane is shared memory (its waves
// waited for as posted: they are quick), the other the network (polled
// between them, and waited for when shared memory has nothing to do).
using MakeRing = std::function<std::unique_ptr<RingPipeline>(size_t piece)>;
void runPieces(Channel& shm, Channel& net, bool shmFirst, size_t pieces, const MakeRing& first,
               const MakeRing& second, const std::function<void(size_t)>& done) {
  size_t firsts = 0, seconds = 0;  // pieces through each ring
  std::unique_ptr<RingPipeline> shmRun, netRun;
  bool netPosted = false;
  auto next = [&](bool isFirst) -> std::unique_ptr<RingPipeline> {
    if (isFirst) return firsts < pieces ? first(firsts) : nullptr;
    return seconds < firsts ? second(seconds) : nullptr;
  };
  auto finished = [&](bool isFirst) {
    if (isFirst) {
      ++firsts;
    } else {
      done(seconds++);
    }
  };
  while (seconds < pieces) {
    if (!netRun) {
      netRun = next(!shmFirst);
      netPosted = false;
    }
    if (netRun && (!netPosted || net.test())) {
      netPosted = netRun->postWave();
      if (!netPosted) {
        netRun.reset();
        finished(!shmFirst);
        continue;
      }
    }
    if (!shmRun) shmRun = next(shmFirst);
    if (shmRun) {
      if (shmRun->postWave()) {
        shm.wait();
      } else {
        shmRun.reset();
        finished(shmFirst);
      }
      continue;
    }
    if (netRun) net.wait();  // shared memory waits for the network
  }
}

}  // namespace

void hierarchicalReduceScatter(Channel& ch, void* buf, const std::vector<size_t>& counts) {
  const Blocks b = layOut(ch, counts);
  const size_t es = ch.elementBytes();
  uint8_t* ranked = static_cast<uint8_t*>(buf);
  uint8_t* scratch = ch.scratch(kAlgorithmScratch, b.rankOffset.back() * es);
  Channel local(ch, b.local), cross(ch, b.cross);
  const size_t pieces = hierarchicalPieces(b.rankOffset.back() * es);
  if (pieces > 1) {
    const Pieces ps = cutPieces(ch, counts, pieces);
    const int me = ch.rank();
    runPieces(
        local, cross, /*shmFirst=*/true, pieces,
        [&](size_t p) {  // this host's sums of each local rank's segment
          const Blocks& bp = ps.blocks[p];
          uint8_t* region = scratch + ps.region[p] * es;
          permute(bp, ps.counts[p], ps.ranked[p], es, ranked, region, true);
          return std::make_unique<RingPipeline>(local, region, bp.segmentCounts,
                                                reduceScatterSteps(local.rank(), local.size()));
        },
        [&](size_t p) {  // across hosts, this rank's segment
          const Blocks& bp = ps.blocks[p];
          uint8_t* segment = scratch + (ps.region[p] + bp.scratchOffset[size_t(bp.i)][0]) * es;
          return std::make_unique<RingPipeline>(cross, segment, bp.crossCounts,
                                                reduceScatterSteps(cross.rank(), cross.size()));
        },
        [&](size_t p) {  // this rank's part, summed over every rank
          const Blocks& bp = ps.blocks[p];
          const size_t n = ps.counts[p][size_t(me)] * es;
          if (n == 0) return;
          std::memcpy(ranked + ps.ranked[p][size_t(me)] * es,
                      scratch + (ps.region[p] + bp.scratchOffset[size_t(bp.i)][size_t(bp.h)]) * es,
                      n);
        });
    return;
  }
  permute(b, counts, b.rankOffset, es, ranked, scratch, true);
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
  Channel local(ch, b.local), cross(ch, b.cross);
  const size_t pieces = hierarchicalPieces(b.rankOffset.back() * es);
  if (pieces > 1) {
    const Pieces ps = cutPieces(ch, counts, pieces);
    const int me = ch.rank();
    runPieces(
        local, cross, /*shmFirst=*/false, pieces,
        [&](size_t p) {  // this rank's part to the same local rank of every host
          const Blocks& bp = ps.blocks[p];
          const size_t n = ps.counts[p][size_t(me)] * es;
          if (n) {
            std::memcpy(
                scratch + (ps.region[p] + bp.scratchOffset[size_t(bp.i)][size_t(bp.h)]) * es,
                ranked + ps.ranked[p][size_t(me)] * es, n);
          }
          uint8_t* segment = scratch + (ps.region[p] + bp.scratchOffset[size_t(bp.i)][0]) * es;
          return std::make_unique<RingPipeline>(cross, segment, bp.crossCounts,
                                                allGatherSteps(cross.rank(), cross.size()));
        },
        [&](size_t p) {  // every segment inside the host
          return std::make_unique<RingPipeline>(local, scratch + ps.region[p] * es,
                                                ps.blocks[p].segmentCounts,
                                                allGatherSteps(local.rank(), local.size()));
        },
        [&](size_t p) {  // back to rank order
          permute(ps.blocks[p], ps.counts[p], ps.ranked[p], es, ranked, scratch + ps.region[p] * es,
                  false);
        });
    return;
  }
  const size_t mine = counts[size_t(ch.rank())] * es;
  if (mine) {
    std::memcpy(scratch + b.scratchOffset[size_t(b.i)][size_t(b.h)] * es,
                ranked + b.rankOffset[size_t(ch.rank())] * es, mine);
  }
  ringAllGather(cross, scratch + b.scratchOffset[size_t(b.i)][0] * es, b.crossCounts);
  ringAllGather(local, scratch, b.segmentCounts);
  permute(b, counts, b.rankOffset, es, ranked, scratch, false);
}

}  // namespace clawcomm
