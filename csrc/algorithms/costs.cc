// Every collective algorithm's cost, by the alpha-beta-gamma model with two
// kinds of link that CLAWCOMM_ALGO=auto chooses by (selection.cc;
// docs/algorithms.md derives it; clawcomm/cost_model/formulas.py holds the same formulas
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
//   mesh (all-reduce) one-shot: one step in which every rank sends N to
//         each of its n-1 peers, + (n-1) N gamma; two-shot: the direct
//         reduce-scatter, then the direct all-gather (one host)
// The other collectives (N: the whole buffer; one host's costs shown):
//   reduce-scatter  ring: n-1 reducing steps of N/n + a working copy of N;
//                   direct: n-1 messages of N/n, each reduced;
//                   hierarchical: a ring inside each host over N, then one
//                   across hosts over N/k with k streams per link, both
//                   pipelined in P pieces as the all-reduce
//   all-gather      ring: n-1 copying steps of N/n; direct: one step of
//                   n-1 messages of N/n; hierarchical: across, then inside
//   broadcast       direct (one host): every peer reads N from the root
//                   at once by single copy, then acknowledges; below the
//                   single-copy size the root's n-1 copies of N in turn;
//                   tree: ceil(log2 n) copies of N and an acknowledgement
//                   (across hosts: each parent's children queue on its
//                   link); scatter_allgather: the root's n-1 messages of
//                   N/n, then twice the layout's all-gather (the root sends
//                   and receives)
//   reduce          tree: ceil(log2 n) steps of N, each reduced;
//                   reducescatter_gather: twice the layout's reduce-scatter
//                   and its sends, then the root's n-1 messages of N/n
//                   (see collectiveCost)
//   all-to-all      (N: what each rank sends, b = N/n to each rank; m hosts
//                   x k ranks) pairwise: one step, shm_alpha + (k-1) b
//                   shm_beta inside the host against net_alpha + k (n-k) b
//                   net_beta on its link, the slower; hierarchical: three
//                   steps one after the other, the sizes (shm_alpha), the
//                   shuffle (shm_alpha + (k-1) m b shm_beta) and the
//                   exchange across hosts (net_alpha + k (m-1) k b
//                   net_beta): the same bytes on each link as pairwise, in
//                   k (m-1) messages instead of k (n-k), which this model
//                   (one alpha per step, however many messages share it)
//                   does not price, so it never comes out cheaper
#include <algorithm>
#include <cmath>
#include <limits>

#include "algorithms/algorithms.h"

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

double linkCost(const Topology& t, const CostModel& m, int a, int b, double bytes) {
  return t.hostOf(a) == t.hostOf(b) ? m.shmAlpha + bytes * m.shmBeta
                                    : m.netAlpha + bytes * m.netBeta;
}

// The root (rank 0 stands for any) exchanging `bytes` with every other rank
// in turn.
double rootCost(const Topology& t, const CostModel& m, double bytes) {
  double cost = 0;
  for (int p = 1; p < t.size(); ++p) cost += linkCost(t, m, 0, p, bytes);
  return cost;
}

// binomial_reduce.cc: ceil(log2 n) steps; in the step of `mask`, rank
// r < mask takes N from r + mask and reduces it.
double binomialReduceCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  double cost = 0;
  for (int mask = 1; mask < n; mask <<= 1) {
    cost += stepCost(t, m, N, [&](int r) { return r < mask && r + mask < n ? r + mask : -1; }) +
            N * m.gamma;
  }
  return cost;
}

// binomial_broadcast.cc: rank v receives from its parent (v with its lowest
// set bit cleared, root 0), which sends to its children largest subtree
// first: the ones on its host one after another (its one progress thread
// copies them), the cross-host ones queued on its link in that order. Each
// child acknowledges with an empty message; done when the last
// acknowledgement lands. On one host: ceil(log2 n) copies of N and one
// acknowledgement. (clawcomm.simulate.messages runs the same message by message.)
double binomialBroadcastCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  if (n <= 1) return 0;
  int bits = 0;
  while ((1 << bits) <= n) ++bits;  // n's bit length
  std::vector<double> got(size_t(n), 0.0);
  double finish = 0;
  for (int v = 1; v < n; ++v) {
    const int parent = v & (v - 1);
    const bool local = t.hostOf(parent) == t.hostOf(v);
    // The parent's children sent up to v that share v's way out.
    const int low = parent ? (parent & -parent) : (1 << bits);
    int queued = 0;
    for (int mask = 1 << bits; mask >= v - parent; mask >>= 1) {
      const int child = parent + mask;
      if (mask < low && child < n && (t.hostOf(child) == t.hostOf(parent)) == local) ++queued;
    }
    double ack;
    if (local) {
      got[size_t(v)] = got[size_t(parent)] + queued * (m.shmAlpha + N * m.shmBeta);
      ack = m.shmAlpha;
    } else {
      got[size_t(v)] = got[size_t(parent)] + m.netAlpha + queued * N * m.netBeta;
      ack = m.netAlpha;
    }
    finish = std::max(finish, got[size_t(v)] + ack);
  }
  return finish;
}

constexpr double kNever = std::numeric_limits<double>::infinity();

// direct_broadcast.cc, one host: from the single-copy size (the default
// CLAWCOMM_SINGLE_COPY_BYTES; chooseAlgorithm passes it over where the
// settings leave single copy off) every peer reads the root at once, one
// copy of N; below it the root copies N into n-1 rings one after another.
// Then the acknowledgement.
double directBroadcastCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  if (!directLayout(t)) return kNever;
  if (n <= 1) return 0;
  const double copies = N >= double(kDefaultSingleCopyBytes) ? 1 : n - 1;
  return copies * (m.shmAlpha + N * m.shmBeta) + m.shmAlpha;
}

// hierarchical_gather_scatter.cc: rings inside each host over the whole
// buffer and rings across hosts over the N/k each rank owns, k streams
// sharing each link; the reduce-scatter inside first, the all-gather
// across first. Not pipelined.
double hierarchicalGatherScatterCost(double N, const Topology& t, const CostModel& m,
                                     bool reducing) {
  if (!t.hierarchical()) return kNever;
  const int k = t.ranksPerHost();
  const int hosts = t.hosts();
  const Topology inside(std::vector<int>(size_t(k), 0));
  std::vector<int> hostOf(static_cast<size_t>(hosts));
  for (int h = 0; h < hosts; ++h) hostOf[size_t(h)] = h;
  const Topology across(hostOf);
  CostModel shared = m;
  shared.netBeta *= k;
  // Pipelined in P pieces, as the all-reduce (hierarchical_gather_scatter.cc).
  const double P = double(hierarchicalPieces(size_t(N)));
  const double piece = N / P, shard = piece / (double(k) * hosts);
  const double shm = reducing ? ringSteps(inside, m, piece / k, k - 1, 0)
                              : ringSteps(inside, m, piece / k, 0, k - 1);
  const double net = reducing ? ringSteps(across, shared, shard, hosts - 1, 0)
                              : ringSteps(across, shared, shard, 0, hosts - 1);
  return P == 1 ? shm + net : P * std::max(shm, net) + std::min(shm, net);
}

// pairwise_all_to_all.cc: every rank posts its n-1 blocks of N/n at once;
// its local ones go one after another through its channel, and the blocks
// that leave a host (on (n - on) of them for `on` ranks there) share its
// link. The slower of the two.
double pairwiseAllToAllCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  if (n <= 1) return 0;
  int local = 0, leaving = 0;
  for (int h = 0; h < t.hosts(); ++h) {
    int on = 0;
    for (int r = 0; r < n; ++r) on += t.hostOf(r) == h;
    local = std::max(local, on - 1);
    leaving = std::max(leaving, on * (n - on));
  }
  const double block = N / n;
  double cost = local > 0 ? m.shmAlpha + local * block * m.shmBeta : 0;
  if (leaving > 0) cost = std::max(cost, m.netAlpha + leaving * block * m.netBeta);
  return cost;
}

// hierarchical_all_to_all.cc, one stage after the other: the sizes inside
// the host (one message), the shuffle (each rank's (k-1) m blocks one after
// another through its channel), then k (m-1) messages of k blocks leaving
// each host at once.
double hierarchicalAllToAllCost(double N, const Topology& t, const CostModel& m) {
  if (!t.hierarchical()) return kNever;
  const int k = t.ranksPerHost(), hosts = t.hosts();
  const double block = N / t.size();
  const double sizes = m.shmAlpha;
  const double shuffle = m.shmAlpha + (k - 1) * hosts * block * m.shmBeta;
  const double across = m.netAlpha + double(k) * (hosts - 1) * k * block * m.netBeta;
  return sizes + shuffle + across;
}

double reduceScatterCost(Algorithm a, double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  const double chunk = N / n;
  switch (a) {
    case Algorithm::kRing: return ringSteps(t, m, chunk, n - 1, 0) + N * m.shmBeta;
    case Algorithm::kDirect:
      return directLayout(t) ? (n - 1) * (m.shmAlpha + chunk * (m.shmBeta + m.gamma)) : kNever;
    case Algorithm::kHierarchical: return hierarchicalGatherScatterCost(N, t, m, true);
    default: return kNever;
  }
}

double allGatherCost(Algorithm a, double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  const double chunk = N / n;
  switch (a) {
    case Algorithm::kRing: return ringSteps(t, m, chunk, 0, n - 1);
    case Algorithm::kDirect:
      return directLayout(t) ? m.shmAlpha + (n - 1) * chunk * m.shmBeta : kNever;
    case Algorithm::kHierarchical: return hierarchicalGatherScatterCost(N, t, m, false);
    default: return kNever;
  }
}

// mesh_all_reduce.cc's one-shot: one step in which every rank sends N to
// each of the n-1 others (on one host, its copies into n-1 rings; across
// hosts, every message leaving a host shares its link), then n-1
// reductions of N.
double oneShotCost(double N, const Topology& t, const CostModel& m) {
  const int n = t.size();
  if (n <= 1) return 0;
  int local = 0, leaving = 0;  // the busiest rank's local peers, host's outgoing messages
  for (int h = 0; h < t.hosts(); ++h) {
    int on = 0;
    for (int r = 0; r < n; ++r) on += t.hostOf(r) == h;
    local = std::max(local, on - 1);
    leaving = std::max(leaving, on * (n - on));
  }
  double cost = local > 0 ? m.shmAlpha + local * N * m.shmBeta : 0;
  if (leaving > 0) cost = std::max(cost, m.netAlpha + leaving * N * m.netBeta);
  return cost + (n - 1) * N * m.gamma;
}

// The two-shot: the direct reduce-scatter, then the direct all-gather. At 2
// ranks those are the ring's two messages, and cost what it costs (the tie
// goes to the ring).
double twoShotCost(double N, const Topology& t, const CostModel& m) {
  if (t.size() == 2 && directLayout(t)) return ringCost(N, t, m);
  return reduceScatterCost(Algorithm::kDirect, N, t, m) +
         allGatherCost(Algorithm::kDirect, N, t, m);
}

// What the split algorithms run inside them (split_broadcast_reduce.cc).
Algorithm layoutAlgorithm(const Topology& t) {
  return directLayout(t)    ? Algorithm::kDirect
         : t.hierarchical() ? Algorithm::kHierarchical
                            : Algorithm::kRing;
}
}  // namespace

// The layout's own reduce-scatter and all-gather (what the split broadcast
// and reduce run inside), and the direct and mesh algorithms' one place:
// direct on one host, hierarchical over hosts.
bool directLayout(const Topology& t) {
  return t.hosts() == 1 && t.size() <= kDirectMaxRanks;
}

double collectiveCost(OpType op, Algorithm algo, double bytes, const Topology& topo,
                      const CostModel& model) {
  switch (op) {
    case OpType::kAllReduce: return allReduceCost(algo, bytes, topo, model);
    case OpType::kReduceScatter: return reduceScatterCost(algo, bytes, topo, model);
    case OpType::kAllGather: return allGatherCost(algo, bytes, topo, model);
    // The trees' cost is the root's: ceil(log2 n) messages of N sent (or
    // received and reduced). The split algorithms' root also sends and
    // receives inside their all-gather and reduce-scatter, so those count
    // twice (both ends of each copy), and the reduce-scatter inside the split
    // reduce twice again: measured on 2 to 8 ranks of a 2-core and a
    // 16-core host, it runs at about half the model's rate
    // (bench/results/split_broadcast_reduce.txt). Hence the trees up to 4
    // ranks and the split from 8, for large messages.
    case OpType::kBroadcast:
      if (algo == Algorithm::kTree) return binomialBroadcastCost(bytes, topo, model);
      if (algo == Algorithm::kDirect) return directBroadcastCost(bytes, topo, model);
      if (algo == Algorithm::kScatterAllGather) {
        return rootCost(topo, model, bytes / topo.size()) +
               2 * allGatherCost(layoutAlgorithm(topo), bytes, topo, model);
      }
      return kNever;
    case OpType::kReduce:
      if (algo == Algorithm::kTree) return binomialReduceCost(bytes, topo, model);
      if (algo == Algorithm::kReduceScatterGather) {
        const double sent = bytes * (topo.size() - 1) / topo.size() * model.shmBeta;
        return 2 * (reduceScatterCost(layoutAlgorithm(topo), bytes, topo, model) + sent) +
               rootCost(topo, model, bytes / topo.size());
      }
      return kNever;
    case OpType::kAllToAll:
      if (algo == Algorithm::kPairwise) return pairwiseAllToAllCost(bytes, topo, model);
      if (algo == Algorithm::kHierarchical) return hierarchicalAllToAllCost(bytes, topo, model);
      return kNever;
    default: return kNever;
  }
}

double allReduceCost(Algorithm algo, double bytes, const Topology& topo, const CostModel& model) {
  switch (algo) {
    case Algorithm::kRing: return ringCost(bytes, topo, model);
    case Algorithm::kTree: return treeCost(bytes, topo, model);
    case Algorithm::kHierarchical: return hierarchicalCost(bytes, topo, model);
    case Algorithm::kOneShot: return oneShotCost(bytes, topo, model);
    case Algorithm::kTwoShot: return twoShotCost(bytes, topo, model);
    default: return kNever;
  }
}

double operationCost(OpType op, Algorithm algo, double bytes, const Topology& topo,
                     const CostModel& model) {
  const int n = topo.size();
  if (n <= 1) return 0;
  switch (algo) {
    case Algorithm::kRing16BitWire:
      // The ring's, on the 2-byte elements it sends.
      return op == OpType::kAllReduce ? ringCost(bytes, topo, model)
                                      : reduceScatterCost(Algorithm::kRing, bytes, topo, model);
    case Algorithm::kDeterministic: {
      // Each chunk's owner takes every rank's chunk (the layout's
      // reduce-scatter), then the all-reduce gathers the sums back; the
      // reduce gathers them at the root.
      const double scatter = reduceScatterCost(layoutAlgorithm(topo), bytes, topo, model);
      if (op == OpType::kReduceScatter) return scatter;
      if (op == OpType::kReduce) return scatter + rootCost(topo, model, bytes / n);
      return scatter + allGatherCost(layoutAlgorithm(topo), bytes, topo, model);
    }
    default: break;
  }
  switch (op) {
    case OpType::kGather:
    case OpType::kScatter:
      // The root exchanges each rank's piece with it in turn.
      return rootCost(topo, model, bytes / n);
    case OpType::kBarrier: {
      // The dissemination barrier: ceil(log2 n) rounds of empty messages.
      const double alpha = topo.hosts() > 1 ? model.netAlpha : model.shmAlpha;
      return std::ceil(std::log2(double(n))) * alpha;
    }
    default: return collectiveCost(op, algo, bytes, topo, model);
  }
}

double pointToPointCost(int from, int to, double bytes, const Topology& topo,
                        const CostModel& model) {
  return linkCost(topo, model, from, to, bytes);
}

}  // namespace clawcomm
