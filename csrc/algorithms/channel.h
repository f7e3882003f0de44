// What an algorithm sees of the world: its rank, the group size, where the
// ranks run (the topology), and tagged sends and receives for one
// operation. Algorithms never name a transport.
//
// Each send/receive between a pair of ranks gets the next step number for
// that pair and direction, so the k-th send of rank a to rank b is matched
// with the k-th receive of b from a, and both carry the op's signature.
//
// A channel can be narrowed to a subgroup (the ranks of one host, or one
// rank of every host): the view numbers its members 0 .. size-1, keeps its
// own list of posted transfers (so one phase can wait while another's stay
// in flight), and shares the step counters with the whole group's channel.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "algorithms/topology.h"
#include "common/op.h"
#include "common/scratch.h"
#include "common/settings.h"
#include "messenger/messenger.h"

namespace clawcomm {

// 0 .. n-1: the members of a view over a whole channel of n ranks.
std::vector<int> everyRank(int n);

// What a whole-group channel keeps from one operation to the next, so that
// making one allocates nothing (the communicator holds one: one collective
// runs at a time): the step counters, zeroed for each operation, the
// group's ranks 0 .. n-1, and the list of posted transfers (empty between
// operations, its capacity kept). A small all-reduce used to pay four
// allocations here (issue 62).
struct ChannelMemory {
  std::vector<uint32_t> sendSteps, recvSteps;  // per global peer
  std::vector<int> everyRank;
  std::vector<TransferPtr> pending;
};

class Channel {
 public:
  // `scratch`: the communicator's reusable buffers, `memory` its channel
  // memory (null: the channel's own; neither may serve two channels at once).
  Channel(Messenger& messenger, const OpSignature& sig, Clock::time_point deadline,
          const Settings& settings, const Topology& topology, Scratch* scratch = nullptr,
          ChannelMemory* memory = nullptr);
  // The view of `parent` over `members` (ranks of the parent's numbering,
  // this rank among them): member i is rank i of the view.
  // everyRank(size()) gives a view of the whole group whose posted
  // transfers are waited for apart from the rest.
  Channel(Channel& parent, const std::vector<int>& members);
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  ~Channel();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Where the whole group's ranks run (global rank numbers).
  const Topology& topology() const { return topology_; }
  // The whole group's number of this view's rank `r`.
  int globalRank(int r) const { return members_[r]; }
  const OpSignature& signature() const { return sig_; }
  const Settings& settings() const { return settings_; }
  size_t elementBytes() const { return elementSize(sig_.dtype); }
  // Uninitialised working memory that outlives the call (common/scratch.h):
  // operations take kOpScratch, algorithms kAlgorithmScratch.
  uint8_t* scratch(ScratchSlot slot, size_t bytes) { return scratch_->get(slot, bytes); }

  // Posts a send of `bytes` from `buf`; `buf` must stay untouched until wait().
  void send(int peer, const void* buf, size_t bytes);
  // Posts a receive that copies the peer's bytes into `buf`.
  void recv(int peer, void* buf, size_t bytes);
  // Posts a receive that combines the peer's elements into `buf` with the
  // op's reduce operator, straight from the transport's memory.
  void recvReduce(int peer, void* buf, size_t bytes);
  // Copies `bytes` from `src` to `dst` (not overlapping: this rank's own
  // piece of an operation) 1 MiB at a time, moving bytes between the pieces,
  // so that peers waiting for this rank keep going while it copies.
  void copyLocal(void* dst, const void* src, size_t bytes);
  // Posts a receive whose `bytes` of payload go to `sink` as they arrive
  // (messenger/sink.h), e.g. decoded from 16 bits and added to a float32
  // buffer.
  void recvInto(int peer, const ReceiveSink& sink, size_t bytes);
  // Waits for everything posted so far through this view.
  void wait();
  // Moves what can move now; true if everything posted through this view
  // has completed (then it is forgotten, as after wait()).
  bool test();
  // Moves whatever bytes can move now without blocking (posted sends into
  // the transport, arrived bytes into posted receives). An algorithm calls
  // it before computing on one segment while another is in flight.
  void progress() { messenger_.progress(); }

 private:
  Messenger& messenger_;
  OpSignature sig_;
  Clock::time_point deadline_;
  const Settings& settings_;
  const Topology& topology_;
  std::unique_ptr<ChannelMemory> ownMemory_;  // a whole-group channel's, when given none
  ChannelMemory* memory_;                     // the whole group's: its step counters
  bool wholeGroup_;                           // pending_ is memory_->pending's, lent
  std::vector<int> viewMembers_;              // a view's
  const int* members_;                        // global rank of each member
  int size_;
  int rank_;
  std::vector<TransferPtr> pending_;
  std::shared_ptr<Scratch> ownScratch_;  // when the communicator gave none
  Scratch* scratch_;
};

}  // namespace clawcomm
