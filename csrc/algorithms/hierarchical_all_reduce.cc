// Hierarchical all-reduce (Horovod's scheme), for m hosts with k ranks each:
//
//   1. Reduce-scatter inside each host over shared memory (a ring over the
//      k local ranks): local rank i ends with its host's sum of shard i,
//      N/k bytes.
//   2. All-reduce of shard i across hosts, among the i-th ranks of every
//      host (ring, or recursive doubling for small shards by the cost
//      model): k streams share each host's link, each 2(m-1)/m N/k bytes,
//      so a link carries 2(m-1)/m N in all. A flat ring over the same ranks
//      crosses a link at every step and pushes 2(n-1)/n N through it: 1.5x
//      as much for 2 hosts x 2 ranks, 1.75x for 2 x 4.
//   3. All-gather of the shards inside each host.
//
// Large buffers are cut into pieces and pipelined: while piece p crosses the
// network, piece p+1 is reduce-scattered and piece p-1 all-gathered over
// shared memory, so the cheap phases hide behind the expensive one. Every
// local rank walks the shared-memory phases in one fixed order
// (RS 0, RS 1, AG 0, RS 2, AG 1, ..., AG P-1), waiting for the network where
// an all-gather's piece has not come back yet, so frames between local
// ranks always match; the network phases run in piece order.
//
// Results are identical on every rank: each shard is summed once per host
// by its owner, then across hosts by one ring (or tree) whose members all
// end with the same bits, then copied.
#include <algorithm>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "common/errors.h"

namespace clawcomm {

Algorithm crossHostAlgorithm(size_t shardBytes, int hosts, int streams, const CostModel& model) {
  // One rank per host, and the host's link shared by `streams` rings.
  std::vector<int> hostOf(static_cast<size_t>(hosts));
  std::iota(hostOf.begin(), hostOf.end(), 0);
  CostModel shared = model;
  shared.netBeta *= streams;
  const Topology acrossHosts(hostOf);
  const double ring = allReduceCost(Algorithm::kRing, double(shardBytes), acrossHosts, shared);
  const double tree = allReduceCost(Algorithm::kTree, double(shardBytes), acrossHosts, shared);
  return tree <= ring ? Algorithm::kTree : Algorithm::kRing;
}

size_t hierarchicalPieces(size_t bytes) {
  return std::min<size_t>(kHierarchicalMaxPieces,
                          std::max<size_t>(1, bytes / kHierarchicalPieceBytes));
}

void hierarchicalAllReduce(Channel& ch, void* buf, size_t count) {
  const Topology& topo = ch.topology();
  if (!topo.hierarchical() || ch.size() != topo.size()) {
    ringAllReduce(ch, buf, count);  // one host, or uneven hosts: nothing to gain
    return;
  }
  Channel local(ch, topo.localGroup(ch.rank()));
  Channel cross(ch, topo.crossGroup(ch.rank()));
  const int k = local.size();
  const int i = local.rank();
  const int m = cross.size();
  const size_t es = ch.elementBytes();
  uint8_t* base = static_cast<uint8_t*>(buf);

  // Piece p: elements [pieceStart[p], pieceStart[p + 1]), cut into k
  // shards; this rank carries shard i of each piece across hosts.
  const size_t pieces = hierarchicalPieces(count * es);
  const std::vector<size_t> pieceCounts = evenCounts(count, int(pieces));
  std::vector<size_t> pieceStart(pieces + 1, 0);
  for (size_t p = 0; p < pieces; ++p) pieceStart[p + 1] = pieceStart[p] + pieceCounts[p];
  auto shard = [&](size_t p, size_t* start, size_t* n) {
    const std::vector<size_t> shards = evenCounts(pieceCounts[p], k);
    *start = pieceStart[p];
    for (int s = 0; s < i; ++s) *start += shards[size_t(s)];
    *n = shards[size_t(i)];
  };
  auto localRing = [&](size_t p, bool reduce) {
    return std::make_unique<RingPipeline>(local, base + pieceStart[p] * es,
                                          evenCounts(pieceCounts[p], k),
                                          reduce ? reduceScatterSteps(i, k) : allGatherSteps(i, k));
  };

  // One piece: the three phases in turn, with the cross-host algorithm the
  // cost model picks for the shard.
  if (pieces == 1) {
    size_t start, n;
    shard(0, &start, &n);
    ringReduceScatter(local, buf, evenCounts(count, k));
    if (crossHostAlgorithm(n * es, m, k, ch.settings().costModel) == Algorithm::kTree) {
      treeAllReduce(cross, base + start * es, n);
    } else {
      ringAllReduce(cross, base + start * es, n);
    }
    ringAllGather(local, buf, evenCounts(count, k));
    return;
  }

  // Several pieces: two lanes. The shared-memory lane runs its fixed
  // sequence of rings, a wave at a time, waiting on each wave; the network
  // lane posts the next wave of the current piece's cross-host ring
  // whenever the previous one has completed (checked between shm waves).
  std::vector<std::pair<bool, size_t>> shmTasks;  // (reduce-scatter?, piece)
  shmTasks.push_back({true, 0});
  for (size_t p = 1; p < pieces; ++p) {
    shmTasks.push_back({true, p});
    shmTasks.push_back({false, p - 1});
  }
  shmTasks.push_back({false, pieces - 1});

  size_t nextTask = 0, scattered = 0, crossed = 0;
  std::unique_ptr<RingPipeline> shmRun, netRun;
  bool netPosted = false;
  while (nextTask < shmTasks.size() || shmRun) {
    // Network lane: start the next piece once it is reduce-scattered; post
    // its next wave once the last one has moved.
    if (!netRun && crossed < scattered) {
      size_t start, n;
      shard(crossed, &start, &n);
      std::vector<RingStep> steps = reduceScatterSteps(cross.rank(), m);
      for (const RingStep& s : allGatherSteps(cross.rank(), m)) steps.push_back(s);
      netRun = std::make_unique<RingPipeline>(cross, base + start * es, evenCounts(n, m), steps);
      netPosted = false;
    }
    if (netRun && (!netPosted || cross.test())) {
      netPosted = netRun->postWave();
      if (!netPosted) {
        netRun.reset();
        ++crossed;
        continue;
      }
    }
    // Shared-memory lane.
    if (!shmRun) {
      const auto [reduce, p] = shmTasks[nextTask];
      if (!reduce && crossed <= p) {
        cross.wait();  // this piece is still on the network
        continue;
      }
      shmRun = localRing(p, reduce);
    }
    if (shmRun->postWave()) {
      local.wait();
    } else {
      shmRun.reset();
      if (shmTasks[nextTask].first) ++scattered;
      ++nextTask;
    }
  }
  CLAWCOMM_CHECK(crossed == pieces && !netRun, "hierarchical all-reduce ended with ", crossed,
                 " of ", pieces, " pieces across hosts");
}

}  // namespace clawcomm
