// Communicator::split: a new group from some ranks of this one, set up over
// this group's own connections instead of the store.
//
// Every rank of the parent takes part in three of the parent's all-gathers,
// in its issue order, whether or not it joins a new group:
//   1. (color, key, a random token) from every rank: each rank learns the
//      members of its new group and their order, and takes the token of the
//      first member as the group's (it names the shared-memory segments and
//      the epoch stamped into every frame, so the new group never crosses
//      another).
//   2. Each rank's endpoint addresses for its new group, or why its setup
//      failed.
//   3. Whether it connected, or why not.
// Between 2 and 3 the members connect their pairs, through the same steps a
// group made over the store takes (comm/rendezvous.h: connectPeers); the
// host identities and settings come from the parent, which checked them. A
// rank that fails anywhere still makes the all-gathers that remain,
// carrying its reason, so every rank of the parent learns of it and fails
// with the same message, none waits for a timeout.
//
// The new group's connections are its own, as ncclCommSplit's are by
// default: sharing the parent's streams would let one group's frames,
// waiting for a receive, stall the other's behind them, and groups used
// concurrently (a data-parallel and a pipeline group) must progress
// independently.
#include <algorithm>
#include <numeric>
#include <random>

#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "common/errors.h"
#include "transport/registry.h"

namespace clawcomm {
namespace {

struct SplitEntry {
  int32_t color;
  int32_t key;
  uint64_t token;
};
static_assert(sizeof(SplitEntry) == 16, "a split entry is 16 bytes");

// "<length>:<bytes>" for each string: addresses may hold any byte.
std::string encode(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += CLAWCOMM_CONCAT(s.size(), ":", s);
  return out;
}

std::vector<std::string> decode(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t colon = text.find(':', at);
    CLAWCOMM_CHECK(colon != std::string::npos, "split: a malformed address list");
    const size_t n = std::stoull(text.substr(at, colon - at));
    out.push_back(text.substr(colon + 1, n));
    at = colon + 1 + n;
  }
  return out;
}

// Steps 2 and 3 over the parent: one all-gather of text each.
class ParentExchange final : public SetupExchange {
 public:
  ParentExchange(Communicator& parent, std::vector<int> members)
      : parent_(parent), members_(std::move(members)) {}

  void publish(const std::vector<std::string>& addresses) override {
    const std::vector<std::string> all = gather(encode(addresses));
    throwIfFailed(all, "set up its endpoints");
    for (const std::string& a : all) addresses_.push_back(decode(a));
  }

  std::string addressOf(int peer, size_t transport) override {
    const std::vector<std::string>& theirs = addresses_[size_t(members_[size_t(peer)])];
    CLAWCOMM_CHECK(transport < theirs.size(), "split: rank ", members_[size_t(peer)],
                   " published no address for transport ", transport);
    return theirs[transport];
  }

  void connected() override { throwIfFailed(gather("ok"), "connect"); }

  // The steps still to come, carrying this rank's failure; never throws.
  void fail(const std::string& why) noexcept {
    try {
      while (steps_ < 2) gather(kSetupFailed + why);
    } catch (...) {  // the parent failed too: its own error reaches every rank
    }
  }

 private:
  // Every parent rank's text, in rank order.
  std::vector<std::string> gather(const std::string& mine) {
    ++steps_;
    const int n = parent_.size();
    std::vector<int64_t> lengths(static_cast<size_t>(n));
    const int64_t myLength = int64_t(mine.size());
    parent_
        .allGather(&myLength, lengths.data(), std::vector<size_t>(size_t(n), 1), DataType::kInt64)
        ->wait();
    std::vector<size_t> counts(lengths.begin(), lengths.end());
    std::string all(std::accumulate(counts.begin(), counts.end(), size_t(0)), '\0');
    parent_.allGather(mine.data(), all.data(), counts, DataType::kUInt8)->wait();
    std::vector<std::string> out;
    size_t at = 0;
    for (size_t c : counts) {
      out.push_back(all.substr(at, c));
      at += c;
    }
    return out;
  }

  void throwIfFailed(const std::vector<std::string>& all, const char* what) {
    for (size_t p = 0; p < all.size(); ++p) {
      if (all[p].compare(0, kSetupFailed.size(), kSetupFailed) == 0) {
        throw Error(CLAWCOMM_CONCAT("clawcomm: split: rank ", p, " could not ", what, ": ",
                                    all[p].substr(kSetupFailed.size())));
      }
    }
  }

  Communicator& parent_;
  std::vector<int> members_;  // the new group's ranks in the parent, by new rank
  std::vector<std::vector<std::string>> addresses_;  // by parent rank
  int steps_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> Communicator::split(int color, int key, SplitOptions options) {
  CLAWCOMM_ARG_CHECK(color >= 0 || color == kNoColor, "clawcomm: split: color ", color,
                     " is negative (kNoColor, ", kNoColor, ", joins no group)");
  CLAWCOMM_ARG_CHECK(!onProgressThread(), "clawcomm: split: called from the progress thread");
  const std::chrono::milliseconds timeout =
      options.timeout.count() > 0 ? options.timeout : this->timeout();
  // This thread waits for each of the parent's all-gathers: they may run on
  // it, as blocking calls do, instead of going to the progress thread and back.
  const Blocking blocking;

  // 1. Colors, keys and tokens.
  std::random_device rd;
  const SplitEntry mine{int32_t(color), int32_t(key), (uint64_t(rd()) << 32) ^ rd()};
  std::vector<SplitEntry> all(static_cast<size_t>(size_));
  allGather(&mine, all.data(), std::vector<size_t>(size_t(size_), sizeof(SplitEntry)),
            DataType::kUInt8)
      ->wait();
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation = splits_++;
  }
  std::vector<int> members;
  for (int p = 0; p < size_ && color != kNoColor; ++p) {
    if (all[size_t(p)].color == color) members.push_back(p);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[size_t(a)].key < all[size_t(b)].key; });
  ParentExchange exchange(*this, members);

  try {
    if (color == kNoColor) {
      exchange.publish({});
      exchange.connected();
      return nullptr;
    }
    CLAWCOMM_ARG_CHECK(options.members.empty() || options.members == members,
                       "clawcomm: split: this rank was to join ranks ",
                       describeRanks(options.members), " but its color (", color, ") and key (",
                       key, ") put it with ", describeRanks(members),
                       "; every rank of a new group must name the same ranks, in the same order");
    const int rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
    GroupPlan plan;
    plan.rank = rank;
    plan.size = int(members.size());
    plan.tokenHex = tokenHex(all[size_t(members[0])].token);
    Connections conns;
    conns.jobToken = plan.tokenHex;
    conns.storeNamespace = CLAWCOMM_CONCAT(storeNamespace_, "split/", generation, "/", color, "/");
    for (int p : members) {
      plan.ranks.push_back(RankInfo{int(plan.ranks.size()), hosts_[size_t(p)]});
      conns.hosts.push_back(hosts_[size_t(p)]);
      if (p != rank_) conns.sameHostRanks += hosts_[size_t(p)] == hosts_[size_t(rank_)];
    }
    conns.hostOf = hostNumbers(conns.hosts);
    // A group of one too: it makes no endpoint and connects nothing, but
    // still takes part in the exchange.
    connectPeers(plan, settings_, exchange, Clock::now() + timeout, conns);
    auto child = own(new Communicator(options.store ? options.store : store_, rank, plan.size,
                                      timeout, settings_, std::move(conns)));
    std::vector<int> global;
    for (int p : members) global.push_back(globalRank(p));
    child->setGlobalRanks(std::move(global));
    return child;
  } catch (const std::exception& e) {
    exchange.fail(e.what());
    throw;
  }
}

}  // namespace clawcomm
