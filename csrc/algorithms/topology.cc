#include "algorithms/topology.h"

#include <algorithm>
#include <cstdlib>

namespace clawcomm {

Topology::Topology(std::vector<int> hostOf) : hostOf_(std::move(hostOf)) {
  std::vector<int> count;
  for (int h : hostOf_) {
    if (h >= int(count.size())) count.resize(size_t(h) + 1, 0);
    ++count[size_t(h)];
  }
  hosts_ = int(count.size());
  ranksPerHost_ = count.empty() ? 0 : count[0];
  for (int c : count) {
    if (c != ranksPerHost_) ranksPerHost_ = 0;
  }
}

std::vector<int> Topology::localGroup(int rank) const {
  std::vector<int> out;
  for (int r = 0; r < size(); ++r) {
    if (hostOf_[size_t(r)] == hostOf(rank)) out.push_back(r);
  }
  return out;
}

std::vector<int> Topology::crossGroup(int rank) const {
  const std::vector<int> local = localGroup(rank);
  const int i = int(std::find(local.begin(), local.end(), rank) - local.begin());
  std::vector<std::vector<int>> byHost(static_cast<size_t>(hosts_));
  for (int r = 0; r < size(); ++r) byHost[size_t(hostOf_[size_t(r)])].push_back(r);
  std::vector<int> out;
  for (const auto& ranks : byHost) {
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
  const std::vector<int> local = localGroup(a);
  const int k = int(local.size());
  const int ia = int(std::find(local.begin(), local.end(), a) - local.begin());
  const int ib = int(std::find(local.begin(), local.end(), b) - local.begin());
  return (ia + 1) % k == ib || (ib + 1) % k == ia;
}

}  // namespace clawcomm
