// Communicator::shrink: a group of this one's ranks but some, set up over
// the store, for when those ranks are dead or stuck (torch's shrink_group,
// NCCL's ncclCommShrink).
//
// Unlike split, which runs three all-gathers over the parent, nothing here
// goes through the parent's connections: an excluded rank that died or
// hangs in a collective would never finish one. Only the survivors call
// it, each with the same list of ranks to drop, and they already know
// everything a new group must agree on but its endpoints' addresses:
//   - the members and their order: the survivors, in this group's order;
//   - each member's host (this group checked them, and its settings, when
//     it connected);
//   - a token, which names the shared-memory segments and is stamped into
//     every frame: derived from this group's token, the shrink's number and
//     the excluded ranks, so that it is the same on every survivor without
//     a round trip, and differs from this group's (a late frame of the
//     parent is refused, never read as the child's).
// What remains is the step every group takes, over the store's keys under
// this group's namespace and the shrink's number: each member posts its
// endpoints' addresses, connects its pairs and says so (comm/rendezvous.h:
// connectThroughStore). The survivors' connections to each other in this
// group are not reused: after an abort they may hold half a frame.
#include <algorithm>

#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "common/errors.h"
#include "compress/quantize_math.h"  // splitmix64

namespace clawcomm {

std::shared_ptr<Communicator> Communicator::shrink(const std::vector<int>& excluded,
                                                   ShrinkOptions options) {
  CLAWCOMM_ARG_CHECK(!excluded.empty(), "clawcomm: shrink: no rank to exclude");
  std::vector<int> dropped = excluded;
  std::sort(dropped.begin(), dropped.end());
  for (size_t i = 0; i < dropped.size(); ++i) {
    CLAWCOMM_ARG_CHECK(dropped[i] >= 0 && dropped[i] < size_, "clawcomm: shrink: rank ", dropped[i],
                       " is not in this group of ", size_, " ranks");
    CLAWCOMM_ARG_CHECK(i == 0 || dropped[i] != dropped[i - 1], "clawcomm: shrink: rank ",
                       dropped[i], " is excluded twice");
  }
  CLAWCOMM_ARG_CHECK(!std::binary_search(dropped.begin(), dropped.end(), rank_),
                     "clawcomm: shrink: this rank (", rank_,
                     ") is among those excluded; only the ranks that stay call shrink");
  CLAWCOMM_ARG_CHECK(!onProgressThread(), "clawcomm: shrink: called from the progress thread");
  if (options.abortFirst) {
    abort(CLAWCOMM_CONCAT("shrink excluding ranks ", describeRanks(dropped), " aborted it"));
  }
  const std::chrono::milliseconds timeout =
      options.timeout.count() > 0 ? options.timeout : this->timeout();
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation = shrinks_++;
  }

  std::vector<int> members;
  for (int p = 0; p < size_; ++p) {
    if (!std::binary_search(dropped.begin(), dropped.end(), p)) members.push_back(p);
  }
  uint64_t token = quant::splitmix64(std::stoull(jobToken_.empty() ? "0" : jobToken_, nullptr, 16) ^
                                     quant::splitmix64(generation + 1));
  for (int p : dropped) token = quant::splitmix64(token ^ uint64_t(p));

  GroupPlan plan;
  plan.rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
  plan.size = int(members.size());
  plan.tokenHex = tokenHex(token);
  Connections conns;
  conns.jobToken = plan.tokenHex;
  conns.storeNamespace = CLAWCOMM_CONCAT(storeNamespace_, "shrink/", generation, "/");
  for (int p : members) {
    plan.ranks.push_back(RankInfo{int(plan.ranks.size()), hosts_[size_t(p)]});
    conns.hosts.push_back(hosts_[size_t(p)]);
    if (p != rank_) conns.sameHostRanks += hosts_[size_t(p)] == hosts_[size_t(rank_)];
  }
  conns.hostOf = hostNumbers(conns.hosts);
  if (plan.size == 1) {
    conns.toRank.resize(1);
  } else {
    connectThroughStore(*store_, conns.storeNamespace + "setup/", plan, settings_,
                        Clock::now() + timeout, conns);
  }
  auto child = own(new Communicator(options.store ? options.store : store_, plan.rank, plan.size,
                                    timeout, settings_, std::move(conns)));
  std::vector<int> global;
  for (int p : members) global.push_back(globalRank(p));
  child->setGlobalRanks(std::move(global));
  return child;
}

}  // namespace clawcomm
