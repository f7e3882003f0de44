// The messenger's single copy (messenger.h): sends by reference on the
// sender's side, and on the receiver's the reads of the payloads referenced,
// straight into the receives or, for unexpected frames, parked first.
#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "messenger/messenger.h"

namespace clawcomm {
namespace {

// A reference's payload is read this much per progress pass (copy sinks
// straight into the destination; other sinks through bounce_, small enough
// to stay in cache between the read and the reduction).
constexpr size_t kReferenceChunkBytes = size_t(2) << 20;
constexpr size_t kBounceBytes = size_t(256) << 10;
// How long an unexpected reference waits for its receive before it is read
// into a stash: a receive posted meanwhile takes the payload with one copy,
// and a sender whose receiver posts late (or only after a collective of its
// own) still completes.
constexpr auto kParkTime = std::chrono::milliseconds(5);
// A tree broadcast's frames up to this size go by reference: see
// referenceSuits.
constexpr size_t kBroadcastReferenceMaxBytes = size_t(8) << 20;

}  // namespace

bool Messenger::referenceSuits(OpType op, Algorithm algo, size_t bytes) {
  // Where data flows one way (broadcast, the tree of a reduce, the
  // reduce-scatter half of a ring), the ring's two copies run on two cores
  // at once, the sender's into the ring beside the receiver's out of it (or
  // its reduction), while a single copy leaves the sender's core idle: a 64
  // MiB reduce took 9.4 ms by reference and 5.4 ms through the ring here,
  // a broadcast 5.2 and 4.9 ms. Where every rank sends and receives at once
  // (send/recv pairs, all-gather, all-to-all) every core is busy either way,
  // and one copy instead of two wins (docs/algorithms.md). The direct
  // broadcast is of the second kind: every peer reads the root at once.
  // A tree broadcast's frame of up to 8 MiB, whose copy runs from the
  // caches, goes by reference too: at 2 ranks on the Sapphire Rapids VM
  // it took 0.39-0.75x the ring's time from 64 KiB to 4 MiB, the same at
  // 8 and 16 MiB, and 1.1-1.4x at 32 and 64 MiB, where the kernel's copy
  // from memory is slower than the ring's two pipelined ones.
  switch (op) {
    case OpType::kBroadcast:
      return algo == Algorithm::kDirect || bytes <= kBroadcastReferenceMaxBytes;
    case OpType::kAllReduce:
    case OpType::kReduceScatter:
    case OpType::kReduce: return false;
    default: return true;
  }
}

bool Messenger::referenceFits(const PeerState& ps) const {
  uint64_t oldest = ps.referencesSent + 1;
  for (const auto& t : ps.awaitingRead) oldest = std::min(oldest, t->referenceSeq);
  return ps.referencesSent + 1 - oldest < Connection::kReferenceWindow;
}

bool Messenger::settleReferences(PeerState& ps) {
  bool moved = false;
  auto& waiting = ps.awaitingRead;
  for (size_t i = 0; i < waiting.size();) {
    if (ps.conn->referenceWasRead(waiting[i]->referenceSeq)) {
      waiting[i]->complete = true;
      waiting[i] = waiting.back();
      waiting.pop_back();
      moved = true;
    } else {
      ++i;
    }
  }
  return moved;
}

bool Messenger::takeReference(PeerState& ps, bool& moved) {
  Connection& c = *ps.conn;
  while (ps.referenceFill < sizeof(Reference)) {
    const Readable r = c.peek();
    if (r.size == 0) return false;
    const size_t n = std::min(r.size, sizeof(Reference) - ps.referenceFill);
    std::memcpy(ps.reference + ps.referenceFill, r.data, n);
    c.consume(n);
    ps.referenceFill += n;
    moved = true;
  }
  return true;
}

void Messenger::readChunk(Connection& c, const Reference& ref, const ReceiveSink& sink,
                          size_t& offset) {
  // Chunks are multiples of 8 bytes, so of every sink's granule; the last
  // ends with the payload, a whole element.
  size_t n = ref.bytes - offset;
  if (sink.kind == ReceiveSink::Kind::kCopy) {
    n = std::min(n, kReferenceChunkBytes);
    c.readPeer(ref.address + offset, sink.dst + offset, n);
  } else {
    n = std::min(n, kBounceBytes);
    if (bounce_.empty()) bounce_.resize(kBounceBytes);
    c.readPeer(ref.address + offset, bounce_.data(), n);
    sink.take(offset, bounce_.data(), n);
  }
  offset += n;
}

bool Messenger::progressParked(PeerState& ps) {
  for (auto it = ps.unexpected.begin(); it != ps.unexpected.end(); ++it) {
    Transfer& s = **it;
    if (!s.parked || s.complete) continue;
    if (ps.closed && s.done == 0) {
      // The sender shut down with this send unread: it failed the send
      // first, and its buffer may be gone or reused.
      if (!s.claimedBy) continue;
      throw PeerError(CLAWCOMM_CONCAT("rank ", s.peer,
                                      " shut down its communicator before its send of ", s.bytes,
                                      " bytes (tag ", s.tag, ") was received"));
    }
    // Straight into the receive that claimed it, unless a read into the
    // stash has begun (then the stash is delivered at the end).
    const bool direct = s.claimedBy && !s.readIntoStash;
    if (!direct && !s.readIntoStash) {
      if (Clock::now() - s.parkedAt < kParkTime) continue;
      s.readIntoStash = true;
      s.stash.resize(s.bytes);
      s.sink.dst = s.stash.data();
    }
    readChunk(*ps.conn, s.reference, direct ? s.claimedBy->sink : s.sink, s.done);
    if (s.done == s.bytes) {
      ps.conn->referenceRead(s.reference.seq);
      s.complete = true;
      if (s.claimedBy) {
        Transfer& recv = *s.claimedBy;
        if (direct) {
          recv.done = s.bytes;
          recv.complete = true;
        } else {
          deliver(s, recv);
        }
        ps.unexpected.erase(it);
      }
    }
    return true;  // one chunk per pass
  }
  return false;
}

}  // namespace clawcomm
