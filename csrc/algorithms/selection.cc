// CLAWCOMM_ALGO=auto: pick ring or tree all-reduce from an alpha-beta-gamma
// cost model (docs/algorithms.md derives it):
//   ring: 2 (n-1) a + 2 (n-1)/n N b + (n-1)/n N g
//   tree: L (a + N b + N g) (+ 2 a + 2 N b + N g when n is not a power of 2)
// where L = log2 of the largest power of two <= n, a is the per-message
// latency, b the time per byte on the wire and g the time per byte reduced.
#include <cmath>

#include "algorithms/algorithms.h"

namespace clawcomm {
namespace {

// Fitted on the 2-core reference machine over shared memory, through
// torch.distributed (`clawcomm bench --algo ring,tree,auto`): alpha is the
// per-step cost including the wake-up of a waiting rank, which puts the
// ring/tree crossover between 32 and 128 KiB at both 2 and 4 ranks.
constexpr double kAlpha = 8e-6;       // s per message
constexpr double kBeta = 1.0 / 5e9;   // s per byte moved
constexpr double kGamma = 1.0 / 4e9;  // s per byte reduced

}  // namespace

bool allReduceUsesTree(size_t bytes, int size, const Settings& settings) {
  if (settings.algo == AlgoChoice::kRing) return false;
  if (settings.algo == AlgoChoice::kTree) return true;
  if (size <= 1) return true;
  if (settings.treeMaxBytes > 0) return bytes <= settings.treeMaxBytes;
  const double n = size;
  const double N = double(bytes);
  int p = 1, levels = 0;
  while (p * 2 <= size) {
    p *= 2;
    ++levels;
  }
  const double ring = 2 * (n - 1) * kAlpha + 2 * (n - 1) / n * N * kBeta + (n - 1) / n * N * kGamma;
  double tree = levels * (kAlpha + N * kBeta + N * kGamma);
  if (p != size) tree += 2 * kAlpha + 2 * N * kBeta + N * kGamma;
  return tree <= ring;
}

}  // namespace clawcomm
