#include "algorithms/channel.h"

namespace clawcomm {

Channel::Channel(Messenger& messenger, const OpSignature& sig, Clock::time_point deadline,
                 const Settings& settings)
    : messenger_(messenger),
      sig_(sig),
      deadline_(deadline),
      settings_(settings),
      sendSteps_(size_t(messenger.size()), 0),
      recvSteps_(size_t(messenger.size()), 0) {}

void Channel::send(int peer, const void* buf, size_t bytes) {
  pending_.push_back(messenger_.sendCollective(peer, sig_, sendSteps_[peer]++, buf, bytes));
}

void Channel::recv(int peer, void* buf, size_t bytes) {
  pending_.push_back(
      messenger_.recvCollective(peer, sig_, recvSteps_[peer]++, ReceiveSink::copy(buf), bytes));
}

void Channel::recvReduce(int peer, void* buf, size_t bytes) {
  pending_.push_back(messenger_.recvCollective(
      peer, sig_, recvSteps_[peer]++, ReceiveSink::reduce(buf, sig_.dtype, sig_.redop), bytes));
}

void Channel::recvInto(int peer, const ReceiveSink& sink, size_t bytes) {
  pending_.push_back(messenger_.recvCollective(peer, sig_, recvSteps_[peer]++, sink, bytes));
}

void Channel::wait() {
  if (pending_.empty()) return;
  messenger_.waitAll(pending_, deadline_);
  pending_.clear();
}

}  // namespace clawcomm
