#include "algorithms/channel.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/errors.h"

namespace clawcomm {

std::vector<int> everyRank(int n) {
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

Channel::Channel(Messenger& messenger, const OpSignature& sig, Clock::time_point deadline,
                 const Settings& settings, const Topology& topology, Scratch* scratch,
                 ChannelMemory* memory)
    : messenger_(messenger),
      sig_(sig),
      deadline_(deadline),
      settings_(settings),
      topology_(topology),
      ownMemory_(memory ? nullptr : std::make_unique<ChannelMemory>()),
      memory_(memory ? memory : ownMemory_.get()),
      wholeGroup_(true),
      rank_(messenger.rank()),
      ownScratch_(scratch ? nullptr : std::make_shared<Scratch>()),
      scratch_(scratch ? scratch : ownScratch_.get()) {
  const size_t n = size_t(messenger.size());
  if (memory_->everyRank.size() != n) {  // the first operation
    memory_->sendSteps.resize(n);
    memory_->recvSteps.resize(n);
    memory_->everyRank = everyRank(int(n));
  }
  std::fill(memory_->sendSteps.begin(), memory_->sendSteps.end(), 0);
  std::fill(memory_->recvSteps.begin(), memory_->recvSteps.end(), 0);
  members_ = memory_->everyRank.data();
  size_ = int(n);
  pending_.swap(memory_->pending);
}

Channel::Channel(Channel& parent, const std::vector<int>& members)
    : messenger_(parent.messenger_),
      sig_(parent.sig_),
      deadline_(parent.deadline_),
      settings_(parent.settings_),
      topology_(parent.topology_),
      memory_(parent.memory_),
      wholeGroup_(false),
      rank_(-1),
      ownScratch_(parent.ownScratch_),
      scratch_(parent.scratch_) {
  for (int m : members) {
    if (m == parent.rank()) rank_ = int(viewMembers_.size());
    viewMembers_.push_back(parent.globalRank(m));
  }
  members_ = viewMembers_.data();
  size_ = int(viewMembers_.size());
  CLAWCOMM_CHECK(rank_ >= 0, "rank ", parent.rank(), " is not a member of its own subgroup");
}

Channel::~Channel() {
  if (!wholeGroup_) return;
  // Transfers still posted (the operation failed) go now, as before; the
  // vector's capacity goes back for the next operation.
  pending_.clear();
  pending_.swap(memory_->pending);
}

void Channel::send(int peer, const void* buf, size_t bytes) {
  const int g = members_[peer];
  pending_.push_back(
      messenger_.sendCollective(g, sig_, memory_->sendSteps[size_t(g)]++, buf, bytes));
}

void Channel::recv(int peer, void* buf, size_t bytes) {
  const int g = members_[peer];
  pending_.push_back(messenger_.recvCollective(g, sig_, memory_->recvSteps[size_t(g)]++,
                                               ReceiveSink::copy(buf), bytes));
}

void Channel::recvReduce(int peer, void* buf, size_t bytes) {
  recvInto(peer, ReceiveSink::reduce(buf, sig_.dtype, sig_.redop), bytes);
}

void Channel::recvInto(int peer, const ReceiveSink& sink, size_t bytes) {
  const int g = members_[peer];
  pending_.push_back(
      messenger_.recvCollective(g, sig_, memory_->recvSteps[size_t(g)]++, sink, bytes));
}

void Channel::copyLocal(void* dst, const void* src, size_t bytes) {
  constexpr size_t kPiece = size_t(1) << 20;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t off = 0; off < bytes; off += kPiece) {
    std::memcpy(d + off, s + off, std::min(kPiece, bytes - off));
    messenger_.progress();
  }
}

void Channel::wait() {
  if (pending_.empty()) return;
  messenger_.waitAll(pending_, deadline_);
  pending_.clear();
}

bool Channel::test() {
  if (pending_.empty()) return true;
  messenger_.progress();
  const bool done = std::all_of(pending_.begin(), pending_.end(),
                                [](const TransferPtr& t) { return t->complete; });
  if (done) pending_.clear();
  return done;
}

}  // namespace clawcomm
