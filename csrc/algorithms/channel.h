// What an algorithm sees of the world: its rank, the group size, and tagged
// sends and receives for one operation. Algorithms never name a transport.
//
// Each send/receive between a pair of ranks gets the next step number for
// that pair and direction, so the k-th send of rank a to rank b is matched
// with the k-th receive of b from a, and both carry the op's signature.
#pragma once

#include <cstddef>
#include <vector>

#include "common/op.h"
#include "common/settings.h"
#include "messenger/messenger.h"

namespace clawcomm {

class Channel {
 public:
  Channel(Messenger& messenger, const OpSignature& sig, Clock::time_point deadline,
          const Settings& settings);

  int rank() const { return messenger_.rank(); }
  int size() const { return messenger_.size(); }
  const OpSignature& signature() const { return sig_; }
  const Settings& settings() const { return settings_; }
  size_t elementBytes() const { return elementSize(sig_.dtype); }

  // Posts a send of `bytes` from `buf`; `buf` must stay untouched until wait().
  void send(int peer, const void* buf, size_t bytes);
  // Posts a receive that copies the peer's bytes into `buf`.
  void recv(int peer, void* buf, size_t bytes);
  // Posts a receive that combines the peer's elements into `buf` with the
  // op's reduce operator, straight from the transport's memory.
  void recvReduce(int peer, void* buf, size_t bytes);
  // Posts a receive whose `bytes` of payload go to `sink` as they arrive
  // (messenger/sink.h), e.g. decoded from 16 bits and added to a float32
  // buffer.
  void recvInto(int peer, const ReceiveSink& sink, size_t bytes);
  // Waits for everything posted so far.
  void wait();
  // Moves whatever bytes can move now without blocking (posted sends into
  // the transport, arrived bytes into posted receives). An algorithm calls
  // it before computing on one segment while another is in flight.
  void progress() { messenger_.progress(); }

 private:
  Messenger& messenger_;
  OpSignature sig_;
  Clock::time_point deadline_;
  const Settings& settings_;
  std::vector<uint32_t> sendSteps_;
  std::vector<uint32_t> recvSteps_;
  std::vector<TransferPtr> pending_;
};

}  // namespace clawcomm
