// The all-reduce algorithms, as one table, and CLAWCOMM_ALGO=auto's choice
// between them by an alpha-beta-gamma cost model with two kinds of link
// (docs/algorithms.md derives it; clawcomm/model.py holds the same formulas
// for `clawcomm simulate`). A message between ranks of one host costs
// shm_alpha + bytes * shm_beta; one between hosts costs
// net_alpha + bytes * net_beta * (streams through the busiest host link in
// that step). A step costs its slowest message. With n ranks, N bytes:
//   ring: n-1 reducing and n-1 copying steps of N/n bytes (see ringSteps)
//   tree: log2 n exchanges of N bytes (+ a fold and unfold when n is not a
//         power of two), + N gamma each
//   hierarchical (m hosts x k ranks, P pieces): per piece, shm = a ring
//         reduce-scatter and all-gather over k ranks, net = the cheaper of
//         ring and tree over m hosts on N/k bytes with k streams per link;
//         P max(shm, net) + min(shm, net), the phases overlapping.
#include <algorithm>
#include <limits>
#include <string>

#include "algorithms/algorithms.h"
#include "common/errors.h"

namespace clawcomm {
namespace {

// The slowest message of a step in which every rank r sends `bytes` to
// partner(r).
template <typename Partner>
double stepCost(const Topology& t, const CostModel& m, double bytes, Partner partner) {
  std::vector<int> leaving(size_t(t.hosts()), 0);
  bool local = false;
  for (int r = 0; r < t.size(); ++r) {
    const int p = partner(r);
    if (p < 0 || p == r) continue;
    if (t.hostOf(p) == t.hostOf(r)) {
      local = true;
    } else {
      ++leaving[size_t(t.hostOf(r))];
    }
  }
  const int streams = *std::max_element(leaving.begin(), leaving.end());
  double cost = local ? m.shmAlpha + bytes * m.shmBeta : 0;
  if (streams > 0) cost = std::max(cost, m.netAlpha + streams * bytes * m.netBeta);
  return cost;
}

// `reducing` then `copying` steps of the ring 0 -> 1 -> ... -> n-1 -> 0 with
// `chunk` bytes each. With only shared-memory edges, or only network ones,
// every step is a message and (when reducing) a reduction. With both, the
// link is the bottleneck: the ranks behind a shared-memory edge reduce
// while the link carries the next chunk, so a step costs the slower of the
// link's message and a local message plus its reduction, with one
// reduction left at the end.
double ringSteps(const Topology& t, const CostModel& m, double chunk, int reducing, int copying) {
  const int n = t.size();
  bool local = false;
  std::vector<int> leaving(size_t(t.hosts()), 0);
  for (int r = 0; r < n; ++r) {
    const int next = (r + 1) % n;
    if (t.hostOf(next) == t.hostOf(r)) {
      local = true;
    } else {
      ++leaving[size_t(t.hostOf(r))];
    }
  }
  const int streams = *std::max_element(leaving.begin(), leaving.end());
  const double shm = m.shmAlpha + chunk * m.shmBeta;
  const double reduce = chunk * m.gamma;
  if (streams == 0) return reducing * (shm + reduce) + copying * shm;
  const double net = m.netAlpha + streams * chunk * m.netBeta;
  if (!local) return reducing * (net + reduce) + copying * net;
  return reducing * std::max(net, shm + reduce) + copying * std::max(net, shm) +
         (reducing > 0 ? reduce : 0.0);
}

double ringCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  if (n <= 1) return 0;
  return ringSteps(t, m, N / n, n - 1, n - 1);
}

double treeCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  double cost = 0;
  // Fold and unfold: even ranks below 2e pair with the odd rank above.
  if (extra > 0) {
    const double fold = stepCost(t, m, N, [extra](int r) { return r < 2 * extra ? (r ^ 1) : -1; });
    cost += 2 * fold + N * m.gamma;
  }
  // The survivors: the odd ranks below 2e and every rank from 2e on.
  std::vector<int> survivor;
  for (int r = 0; r < n; ++r) {
    if (r >= 2 * extra || r % 2 == 1) survivor.push_back(r);
  }
  std::vector<int> index(size_t(n), -1);
  for (size_t s = 0; s < survivor.size(); ++s) index[size_t(survivor[s])] = int(s);
  for (int mask = 1; mask < p; mask *= 2) {
    cost += stepCost(t, m, N,
                     [&](int r) {
                       return index[size_t(r)] < 0 ? -1 : survivor[size_t(index[size_t(r)] ^ mask)];
                     }) +
            N * m.gamma;
  }
  return cost;
}

double hierarchicalCost(double N, const Topology& t, const CostModel& m) {
  if (!t.hierarchical()) return std::numeric_limits<double>::infinity();
  const int k = t.ranksPerHost();
  const int hosts = t.hosts();
  const double P = double(hierarchicalPieces(size_t(N)));
  const double piece = N / P;
  // Shared memory: a reduce-scatter and an all-gather over k local ranks.
  const double shm =
      2 * (k - 1) * (m.shmAlpha + piece / k * m.shmBeta) + double(k - 1) / k * piece * m.gamma;
  // Network: k rings (or trees) of one rank per host, sharing each link.
  std::vector<int> hostOf(static_cast<size_t>(hosts));
  for (int h = 0; h < hosts; ++h) hostOf[size_t(h)] = h;
  const Topology across(hostOf);
  CostModel shared = m;
  shared.netBeta *= k;
  const double net =
      P == 1 && crossHostAlgorithm(size_t(piece / k), hosts, k, m) == Algorithm::kTree
          ? treeCost(piece / k, across, shared)
          : ringCost(piece / k, across, shared);
  if (P == 1) return shm + net;
  return P * std::max(shm, net) + std::min(shm, net);
}

const AllReduceAlgorithm& byId(Algorithm id) {
  for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
    if (a.id == id) return a;
  }
  CLAWCOMM_CHECK(false, "no all-reduce algorithm ", int(id));
  throw;  // unreachable
}

}  // namespace

const std::vector<AllReduceAlgorithm>& allReduceAlgorithms() {
  static const std::vector<AllReduceAlgorithm> table = {
      {Algorithm::kRing, "ring", ringAllReduce},
      {Algorithm::kTree, "tree", treeAllReduce},
      {Algorithm::kHierarchical, "hierarchical", hierarchicalAllReduce},
  };
  return table;
}

double allReduceCost(Algorithm algo, double bytes, const Topology& topo, const CostModel& model) {
  switch (algo) {
    case Algorithm::kRing: return ringCost(bytes, topo, model);
    case Algorithm::kTree: return treeCost(bytes, topo, model);
    case Algorithm::kHierarchical: return hierarchicalCost(bytes, topo, model);
    default: return std::numeric_limits<double>::infinity();
  }
}

const AllReduceAlgorithm& chooseAllReduce(size_t bytes, const Topology& topo,
                                          const Settings& settings) {
  if (settings.algo != "auto") {
    for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
      if (settings.algo != a.name) continue;
      // Where the layout is not hierarchical, the hierarchical algorithm is
      // the ring: report it as such.
      if (a.id == Algorithm::kHierarchical && !topo.hierarchical()) return byId(Algorithm::kRing);
      return a;
    }
    checkAlgorithmSetting(settings.algo);  // throws, naming the choices
  }
  // One rank: nothing moves; recursive doubling returns at once.
  if (topo.size() <= 1) return byId(Algorithm::kTree);
  if (settings.treeMaxBytes > 0 && !topo.hierarchical()) {
    return byId(bytes <= settings.treeMaxBytes ? Algorithm::kTree : Algorithm::kRing);
  }
  const AllReduceAlgorithm* best = nullptr;
  double bestCost = 0;
  for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
    const double c = allReduceCost(a.id, double(bytes), topo, settings.costModel);
    // Ties go to the later row (the tree over the ring): fewer steps for
    // the same time.
    if (best == nullptr || c <= bestCost) {
      best = &a;
      bestCost = c;
    }
  }
  return *best;
}

void checkAlgorithmSetting(const std::string& value) {
  if (value == "auto") return;
  std::string names = "auto";
  for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
    if (value == a.name) return;
    names += std::string(", ") + a.name;
  }
  throw InvalidArgument(
      CLAWCOMM_CONCAT("clawcomm: CLAWCOMM_ALGO=", value, " is not one of ", names));
}

}  // namespace clawcomm
