// Every collective's algorithms, as one table, and CLAWCOMM_ALGO's choice
// between them: the one it names, else the cheapest by the cost model
// (costs.cc; docs/algorithms.md derives it, clawcomm/cost_model/formulas.py
// holds the same formulas for `clawcomm simulate`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "algorithms/algorithms.h"
#include "common/errors.h"

namespace clawcomm {
namespace {

// Whether `name` is an algorithm of `op` (a row of the table).
const CollectiveAlgorithm* rowOf(OpType op, const std::string& name) {
  for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
    if (a.op == op && name == a.name) return &a;
  }
  return nullptr;
}

std::vector<std::string> splitList(const std::string& text) {
  std::vector<std::string> items;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    items.push_back(text.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}

// The algorithm CLAWCOMM_ALGO names for `op` ("" for auto): an item "op:name"
// for it, else a bare name that is one of op's algorithms.
std::string namedFor(const std::string& setting, OpType op) {
  std::string bare;
  for (const std::string& item : splitList(setting)) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      if (rowOf(op, item)) bare = item;
    } else if (item.substr(0, colon) == opTypeName(op)) {
      const std::string name = item.substr(colon + 1);
      return name == "auto" ? "" : name;
    }
  }
  return bare;
}

// The all-to-all's algorithm under auto. Every rank must run the same one
// (each frame carries it, and ranks that differ fail at the first frame),
// but with uneven splits no byte count is the same on every rank: each
// knows only what it sends and receives. So the choice is the layout's,
// made from what every rank has alike, the topology and the cost model:
// the hierarchical all-to-all where the model prices it below the pairwise
// one at every size (0, then 1 byte to 1 TiB by powers of two), else the
// pairwise one. With costs.cc's formulas that never holds (the hierarchical
// all-to-all moves the pairwise one's bytes over each link in one step as
// it does, after a shuffle the pairwise one does not pay), and the
// measurement agrees (docs/algorithms.md).
Algorithm allToAllByLayout(const Topology& topo, const CostModel& model) {
  for (int bits = -1; bits <= 40; ++bits) {
    const double bytes = bits < 0 ? 0.0 : double(uint64_t(1) << bits);
    if (collectiveCost(OpType::kAllToAll, Algorithm::kHierarchical, bytes, topo, model) >=
        collectiveCost(OpType::kAllToAll, Algorithm::kPairwise, bytes, topo, model)) {
      return Algorithm::kPairwise;
    }
  }
  return Algorithm::kHierarchical;
}

}  // namespace

const AllReduceAlgorithm& allReduceById(Algorithm id) {
  for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
    if (a.id == id) return a;
  }
  CLAWCOMM_CHECK(false, "no all-reduce algorithm ", int(id));
  throw;  // unreachable
}

const std::vector<AllReduceAlgorithm>& allReduceAlgorithms() {
  static const std::vector<AllReduceAlgorithm> table = {
      {Algorithm::kOneShot, "oneshot", oneShotAllReduce},
      {Algorithm::kTwoShot, "twoshot", twoShotAllReduce},
      {Algorithm::kRing, "ring", ringAllReduce},
      {Algorithm::kTree, "tree", treeAllReduce},
      {Algorithm::kHierarchical, "hierarchical", hierarchicalAllReduce},
      // Not a row of collectiveAlgorithms(): CLAWCOMM_DETERMINISTIC=1 picks
      // it, never the cost model nor CLAWCOMM_ALGO.
      {Algorithm::kDeterministic, "deterministic", deterministicAllReduce},
  };
  return table;
}

const std::vector<CollectiveAlgorithm>& collectiveAlgorithms() {
  // Within an op, ties in cost go to the later row (the mesh all-reduces
  // come first: at 2 ranks they cost what the ring and the tree cost).
  static const std::vector<CollectiveAlgorithm> table = {
      {OpType::kAllReduce, Algorithm::kOneShot, "oneshot"},
      {OpType::kAllReduce, Algorithm::kTwoShot, "twoshot"},
      {OpType::kAllReduce, Algorithm::kRing, "ring"},
      {OpType::kAllReduce, Algorithm::kTree, "tree"},
      {OpType::kAllReduce, Algorithm::kHierarchical, "hierarchical"},
      {OpType::kReduceScatter, Algorithm::kRing, "ring"},
      {OpType::kReduceScatter, Algorithm::kHierarchical, "hierarchical"},
      {OpType::kReduceScatter, Algorithm::kDirect, "direct"},
      {OpType::kAllGather, Algorithm::kRing, "ring"},
      {OpType::kAllGather, Algorithm::kHierarchical, "hierarchical"},
      {OpType::kAllGather, Algorithm::kDirect, "direct"},
      {OpType::kBroadcast, Algorithm::kDirect, "direct"},
      {OpType::kBroadcast, Algorithm::kScatterAllGather, "scatter_allgather"},
      {OpType::kBroadcast, Algorithm::kTree, "tree"},
      {OpType::kReduce, Algorithm::kReduceScatterGather, "reducescatter_gather"},
      {OpType::kReduce, Algorithm::kTree, "tree"},
      {OpType::kAllToAll, Algorithm::kPairwise, "pairwise"},
      {OpType::kAllToAll, Algorithm::kHierarchical, "hierarchical"},
  };
  return table;
}

Algorithm chooseAlgorithm(OpType op, size_t bytes, const Topology& topo, const Settings& settings) {
  // CLAWCOMM_DETERMINISTIC=1 overrides CLAWCOMM_ALGO for every reduction
  // (docs/deterministic.md): the result must not depend on the algorithm.
  if (settings.deterministic &&
      (op == OpType::kAllReduce || op == OpType::kReduceScatter || op == OpType::kReduce)) {
    return Algorithm::kDeterministic;
  }
  const std::string named = namedFor(settings.algo, op);
  if (!named.empty()) {
    const CollectiveAlgorithm* row = rowOf(op, named);
    if (!row) checkAlgorithmSetting(settings.algo);  // throws, naming the choices
    // A named algorithm the layout cannot run (hierarchical on one host,
    // direct across hosts) runs the ring (the all-to-all: pairwise).
    if (std::isinf(collectiveCost(op, row->id, double(bytes), topo, settings.costModel))) {
      return op == OpType::kAllToAll ? Algorithm::kPairwise : Algorithm::kRing;
    }
    return row->id;
  }
  if (op == OpType::kAllToAll) return allToAllByLayout(topo, settings.costModel);
  if (op == OpType::kAllReduce) {
    // One rank: nothing moves; recursive doubling returns at once.
    if (topo.size() <= 1) return Algorithm::kTree;
    if (settings.treeMaxBytes > 0 && !topo.hierarchical()) {
      return bytes <= settings.treeMaxBytes ? Algorithm::kTree : Algorithm::kRing;
    }
  }
  // The direct broadcast pays only by single copy (its cost assumes the
  // default size from which frames go by it), which needs shared memory
  // between every pair.
  const bool singleCopy = settings.singleCopy != Settings::SingleCopy::kOff &&
                          bytes >= settings.singleCopyMinBytes && settings.transport != "tcp" &&
                          settings.shmPeers != Settings::ShmPeers::kSparse;
  Algorithm best = Algorithm::kDefault;
  double bestCost = std::numeric_limits<double>::infinity();
  for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
    if (a.op != op) continue;
    if (op == OpType::kBroadcast && a.id == Algorithm::kDirect && !singleCopy) continue;
    // Nor the two-shot all-reduce, which it only runs where named: its
    // model moves the ring's bytes in fewer steps, but the ring overlaps its
    // all-gather steps with later segments' reduce-scatter and the two-shot
    // runs its phases one after the other; on the 2-core machine it took
    // 1.07-1.18x the ring's time at 3 ranks from 256 KiB and 0.74-1.05x at
    // 4 (docs/algorithms.md).
    if (a.id == Algorithm::kTwoShot) continue;
    const double c = collectiveCost(op, a.id, double(bytes), topo, settings.costModel);
    if (best == Algorithm::kDefault || c <= bestCost) {
      best = a.id;
      bestCost = c;
    }
  }
  return best;
}

const AllReduceAlgorithm& chooseAllReduce(size_t bytes, const Topology& topo,
                                          const Settings& settings) {
  return allReduceById(chooseAlgorithm(OpType::kAllReduce, bytes, topo, settings));
}

void checkAlgorithmSetting(const std::string& value) {
  if (value == "auto") return;
  std::vector<std::string> names;
  for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
    if (std::find(names.begin(), names.end(), a.name) == names.end()) names.push_back(a.name);
  }
  std::string all = "auto";
  for (const std::string& n : names) all += ", " + n;
  for (const std::string& item : splitList(value)) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      CLAWCOMM_ARG_CHECK(
          item == "auto" || std::find(names.begin(), names.end(), item) != names.end(),
          "clawcomm: CLAWCOMM_ALGO=", value, " is not one of ", all,
          " (or a comma-separated list of op:name, e.g. broadcast:tree)");
      continue;
    }
    const std::string opName = item.substr(0, colon), name = item.substr(colon + 1);
    const CollectiveAlgorithm* first = nullptr;
    std::string ofOp;
    for (const CollectiveAlgorithm& a : collectiveAlgorithms()) {
      if (opName != opTypeName(a.op)) continue;
      if (!first) first = &a;
      ofOp += std::string(ofOp.empty() ? "" : ", ") + a.name;
    }
    CLAWCOMM_ARG_CHECK(first != nullptr, "clawcomm: CLAWCOMM_ALGO=", value, ": '", opName,
                       "' is not an operation with a choice of algorithm (all_reduce, "
                       "reduce_scatter, all_gather, broadcast, reduce, all_to_all)");
    CLAWCOMM_ARG_CHECK(name == "auto" || rowOf(first->op, name) != nullptr,
                       "clawcomm: CLAWCOMM_ALGO=", value, ": ", opName, " has no algorithm '", name,
                       "' (", ofOp, ", or auto)");
  }
}

}  // namespace clawcomm
