#include "algorithms/topology.h"

#include <algorithm>

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

}  // namespace clawcomm
