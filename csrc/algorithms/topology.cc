#include "algorithms/topology.h"

#include <algorithm>
#include <cstdlib>

namespace clawcomm {

Topology::Topology(std::vector<int> hostOf) : hostOf_(std::move(hostOf)) {
  for (int r = 0; r < size(); ++r) {
    const size_t h = size_t(hostOf_[size_t(r)]);
    if (h >= ranksOf_.size()) ranksOf_.resize(h + 1);
    ranksOf_[h].push_back(r);
  }
  hosts_ = int(ranksOf_.size());
  ranksPerHost_ = ranksOf_.empty() ? 0 : int(ranksOf_[0].size());
  for (const auto& ranks : ranksOf_) {
    if (int(ranks.size()) != ranksPerHost_) ranksPerHost_ = 0;
  }
}

int Topology::localIndex(int rank) const {
  const std::vector<int>& local = ranksOf_[size_t(hostOf(rank))];
  return int(std::lower_bound(local.begin(), local.end(), rank) - local.begin());
}

std::vector<int> Topology::crossGroup(int rank) const {
  const int i = localIndex(rank);
  std::vector<int> out;
  for (const auto& ranks : ranksOf_) {
    if (i < int(ranks.size())) out.push_back(ranks[size_t(i)]);
  }
  return out;
}

bool Topology::frequentPair(int a, int b) const {
  const int n = size();
  if (a == b) return false;
  // The ring over the whole group (the fold pairs 2i, 2i+1 are among these).
  if (std::abs(a - b) == 1 || (std::min(a, b) == 0 && std::max(a, b) == n - 1)) return true;
  // Recursive doubling among the survivors of the fold.
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  auto survivor = [extra](int r) { return r < 2 * extra ? (r % 2 == 1 ? r / 2 : -1) : r - extra; };
  const int sa = survivor(a), sb = survivor(b);
  if (sa >= 0 && sb >= 0) {
    const int x = sa ^ sb;
    if ((x & (x - 1)) == 0) return true;
  }
  // The ring inside a host.
  if (hostOf(a) != hostOf(b)) return false;
  const int k = int(ranksOf_[size_t(hostOf(a))].size());
  const int ia = localIndex(a), ib = localIndex(b);
  return (ia + 1) % k == ib || (ib + 1) % k == ia;
}

}  // namespace clawcomm
