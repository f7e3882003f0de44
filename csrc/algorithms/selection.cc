// The all-reduce algorithms, as one table, and CLAWCOMM_ALGO=auto's choice
// between them by an alpha-beta-gamma cost model (docs/algorithms.md
// derives it):
//   ring: 2 (n-1) a + 2 (n-1)/n N b + (n-1)/n N g
//   tree: L (a + N b + N g) (+ 2 a + 2 N b + N g when n is not a power of 2)
// where L = log2 of the largest power of two <= n, a is the per-message
// latency, b the time per byte on the wire and g the time per byte reduced.
#include <string>

#include "algorithms/algorithms.h"
#include "common/errors.h"

namespace clawcomm {
namespace {

// Fitted on the 2-core reference machine over shared memory, through
// torch.distributed (`clawcomm bench --algo ring,tree,auto`): alpha is the
// per-step cost including the wake-up of a waiting rank, which puts the
// ring/tree crossover between 32 and 128 KiB at both 2 and 4 ranks.
constexpr double kAlpha = 8e-6;       // s per message
constexpr double kBeta = 1.0 / 5e9;   // s per byte moved
constexpr double kGamma = 1.0 / 4e9;  // s per byte reduced

double ringCost(double N, int size) {
  const double n = size;
  return 2 * (n - 1) * kAlpha + 2 * (n - 1) / n * N * kBeta + (n - 1) / n * N * kGamma;
}

double treeCost(double N, int size) {
  int p = 1, levels = 0;
  while (p * 2 <= size) {
    p *= 2;
    ++levels;
  }
  double t = levels * (kAlpha + N * kBeta + N * kGamma);
  if (p != size) t += 2 * kAlpha + 2 * N * kBeta + N * kGamma;
  return t;
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
      {Algorithm::kRing, "ring", ringAllReduce, ringCost},
      {Algorithm::kTree, "tree", treeAllReduce, treeCost},
  };
  return table;
}

const AllReduceAlgorithm& chooseAllReduce(size_t bytes, int size, const Settings& settings) {
  if (settings.algo != "auto") {
    for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
      if (settings.algo == a.name) return a;
    }
    checkAlgorithmSetting(settings.algo);  // throws, naming the choices
  }
  // One rank: nothing moves; recursive doubling returns at once.
  if (size <= 1) return byId(Algorithm::kTree);
  if (settings.treeMaxBytes > 0) {
    return byId(bytes <= settings.treeMaxBytes ? Algorithm::kTree : Algorithm::kRing);
  }
  const AllReduceAlgorithm* best = nullptr;
  double bestCost = 0;
  for (const AllReduceAlgorithm& a : allReduceAlgorithms()) {
    const double c = a.cost(double(bytes), size);
    // Ties go to the later row (the tree): fewer steps for the same time.
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
