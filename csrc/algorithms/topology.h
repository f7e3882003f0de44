// Where the ranks of a group run: what the hierarchical algorithms and
// CLAWCOMM_ALGO=auto need to know beyond a rank and a size.
#pragma once

#include <cstddef>
#include <vector>

namespace clawcomm {

// Which host each rank runs on: hosts are numbered in the order their first
// rank appears.
class Topology {
 public:
  Topology() = default;
  explicit Topology(std::vector<int> hostOf);
  // One host with `size` ranks.
  static Topology singleHost(int size) { return Topology(std::vector<int>(size_t(size), 0)); }

  int size() const { return int(hostOf_.size()); }
  int hosts() const { return hosts_; }
  int hostOf(int rank) const { return hostOf_[size_t(rank)]; }
  // Every host runs the same number of ranks, at least two, and there are
  // at least two hosts: the layout the hierarchical algorithms need.
  bool hierarchical() const { return hosts_ >= 2 && ranksPerHost_ >= 2; }
  int ranksPerHost() const { return ranksPerHost_; }  // 0 if hosts differ
  // The ranks on `rank`'s host, ascending; `rank` is the i-th of them.
  const std::vector<int>& localGroup(int rank) const { return ranksOf_[size_t(hostOf(rank))]; }
  int localIndex(int rank) const;
  // The i-th rank of every host, by host number, for `rank`'s i.
  std::vector<int> crossGroup(int rank) const;
  // Whether the schedules of the reducing collectives make ranks a and b
  // talk: neighbours in the ring, partners of recursive doubling (with the
  // fold when the size is not a power of two), and neighbours in each
  // host's ring (the hierarchical all-reduce). Other pairs talk only in
  // all-to-all, broadcast, reduce, gather and scatter from most roots,
  // barriers and point-to-point. Symmetric.
  bool frequentPair(int a, int b) const;

 private:
  std::vector<int> hostOf_;
  std::vector<std::vector<int>> ranksOf_;  // per host, ascending
  int hosts_ = 0;
  int ranksPerHost_ = 0;
};

}  // namespace clawcomm
