// Messenger (messenger.h): construction, framing, matching and progress.
// Waiting and ending are in waits.cc, single copy in references.cc.
#include "messenger/messenger.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/errors.h"
#include "transport/doorbell.h"

namespace clawcomm {
namespace {

constexpr size_t kHeaderBytes = sizeof(FrameHeader);
// Frames up to this size are assembled contiguously and written in one call.
constexpr size_t kSmallFrameBytes = 4096;
const uint8_t kZeros[8] = {0};
constexpr size_t kWriteChunkBytes = size_t(256) << 10;

size_t padTo8(size_t n) {
  return (n + 7) & ~size_t(7);
}

}  // namespace

OpSignature signatureOf(const FrameHeader& h) {
  OpSignature s;
  s.type = h.opType;
  s.dtype = h.dtype;
  s.redop = h.redop;
  s.root = h.root;
  s.count = h.count;
  s.seq = h.seq;
  s.algo = Algorithm(h.algo);
  return s;
}

Messenger::Messenger(int rank, int size, std::vector<std::unique_ptr<Connection>> connections,
                     int spinMicros, int yieldMicros)
    : rank_(rank),
      size_(size),
      spinMicros_(spinMicros),
      yieldMicros_(yieldMicros),
      peers_(size_t(size)) {
  CLAWCOMM_CHECK_EQ(connections.size(), size_t(size));
  for (int p = 0; p < size; ++p) {
    peers_[p].conn = std::move(connections[p]);
    CLAWCOMM_CHECK((p == rank) == (peers_[p].conn == nullptr), "connection to rank ", p);
  }
  // How to sleep: on the shared doorbell when every peer is on shared memory,
  // in poll() when every peer is on TCP. Mixed (shm inside the host, TCP
  // across hosts): on the doorbell too, which a watcher thread rings when a
  // TCP socket becomes readable or writable.
  bool sameDoorbell = true, someDoorbell = false, allFds = size > 1;
  std::vector<int> tcpFds;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    Doorbell* d = peers_[p].conn->doorbell();
    if (d) {
      sameDoorbell &= doorbell_ == nullptr || d == doorbell_;
      doorbell_ = d;
      someDoorbell = true;
    } else if (peers_[p].conn->pollFd() >= 0) {
      for (int fd : peers_[p].conn->allFds()) tcpFds.push_back(fd);
    } else {
      sameDoorbell = false;  // neither: only naps can wait for it
    }
    allFds &= peers_[p].conn->pollFd() >= 0;
  }
  if (!someDoorbell || !sameDoorbell) doorbell_ = nullptr;
  pollFds_ = allFds && !doorbell_;
  if (pollFds_) wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (doorbell_ && !tcpFds.empty()) startTcpWatcher(tcpFds);
}

Messenger::~Messenger() {
  if (tcpWatcher_.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(stopFd_, &one, sizeof(one));
    tcpWatcher_.join();
    ::close(stopFd_);
  }
  if (wakeFd_ >= 0) ::close(wakeFd_);
}

const char* Messenger::transportOf(int peer) const {
  return peers_[peer].conn ? peers_[peer].conn->kind() : "self";
}

TransferPtr Messenger::newTransfer() {
  for (auto& t : spareTransfers_) {
    if (t.use_count() == 1) {
      // Its last other holder let go with a release; see its writes.
      std::atomic_thread_fence(std::memory_order_acquire);
      *t = Transfer();
      return t;
    }
  }
  auto t = std::make_shared<Transfer>();
  if (spareTransfers_.size() < kSpareTransfers) {
    spareTransfers_.push_back(t);
  } else {
    spareTransfers_[sparesReplaced_++ % kSpareTransfers] = t;
  }
  return t;
}

TransferPtr Messenger::queueSend(int peer, const FrameHeader& header, const void* src,
                                 size_t bytes) {
  CLAWCOMM_CHECK(peer >= 0 && peer < size_ && peer != rank_, "send to rank ", peer);
  auto t = newTransfer();
  t->mode = Transfer::Mode::kSend;
  t->peer = peer;
  t->src = static_cast<const uint8_t*>(src);
  t->bytes = bytes;
  t->header = header;
  t->header.magic = kFrameMagic;
  t->header.epoch = epoch_;
  t->header.payloadBytes = bytes;
  peers_[peer].sendQueue.push_back(t);
  return t;
}

TransferPtr Messenger::sendCollective(int peer, const OpSignature& sig, uint32_t step,
                                      const void* src, size_t bytes) {
  FrameHeader h{};
  h.kind = FrameKind::kCollective;
  h.opType = sig.type;
  h.dtype = sig.dtype;
  h.redop = sig.redop;
  h.seq = sig.seq;
  h.count = sig.count;
  h.root = sig.root;
  h.step = step;
  h.algo = uint8_t(sig.algo);
  return queueSend(peer, h, src, bytes);
}

TransferPtr Messenger::recvCollective(int peer, const OpSignature& sig, uint32_t step,
                                      const ReceiveSink& sink, size_t bytes) {
  CLAWCOMM_CHECK(peer >= 0 && peer < size_ && peer != rank_, "recv from rank ", peer);
  auto t = newTransfer();
  t->mode = Transfer::Mode::kRecv;
  t->peer = peer;
  t->expect = sig;
  t->step = step;
  t->sink = sink;
  t->bytes = bytes;
  peers_[peer].postedCollective.push_back(t);
  return t;
}

TransferPtr Messenger::sendPointToPoint(int peer, uint64_t tag, const void* src, size_t bytes) {
  FrameHeader h{};
  h.kind = FrameKind::kPointToPoint;
  h.opType = OpType::kSend;
  h.seq = tag;
  h.root = -1;
  return queueSend(peer, h, src, bytes);
}

TransferPtr Messenger::recvPointToPoint(int peer, uint64_t tag, void* dst, size_t bytes) {
  auto t = std::make_shared<Transfer>();
  t->mode = Transfer::Mode::kRecv;
  t->peer = peer;
  t->tag = tag;
  t->sink = ReceiveSink::copy(dst);
  t->bytes = bytes;
  // An unexpected frame that already arrived (or is arriving) is claimed
  // first, oldest first, so messages between a pair with one tag stay FIFO.
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || (peer >= 0 && p != peer)) continue;
    PeerState& ps = peers_[p];
    for (auto it = ps.unexpected.begin(); it != ps.unexpected.end(); ++it) {
      Transfer& stash = **it;
      if (stash.tag != tag || stash.claimedBy) continue;
      if (stash.bytes != bytes) {
        throw MismatchError(CLAWCOMM_CONCAT("rank ", p, " sent ", stash.bytes, " bytes with tag ",
                                            tag, ", rank ", rank_, " expected ", bytes));
      }
      t->peer = p;
      if (stash.complete) {
        deliver(stash, *t);
        ps.unexpected.erase(it);
      } else {
        stash.claimedBy = t;
      }
      return t;
    }
  }
  if (peer >= 0) {
    peers_[peer].postedPointToPoint.push_back(t);
  } else {
    anySource_.push_back(t);
  }
  return t;
}

void Messenger::growStash(Transfer& t, size_t need) {
  if (t.stash.size() >= need) return;
  t.stash.resize(std::min(t.bytes, std::max(need, 2 * t.stash.size())));
  t.sink.dst = t.stash.data();
}

void Messenger::deliver(Transfer& stash, Transfer& recv) {
  recv.sink.take(0, stash.stash.data(), stash.bytes);
  recv.done = stash.bytes;
  recv.complete = true;
}

bool Messenger::progress() {
  // Sends to every peer first: a receive's pass may read a whole chunk of
  // a peer's payload by single copy, and a send (or reference) posted after
  // it would leave its reader idle that long.
  bool moved = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    PeerState& ps = peers_[p];
    moved |= settleReferences(ps);
    moved |= progressSend(ps);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    PeerState& ps = peers_[p];
    moved |= progressRecv(p, ps);
    moved |= progressParked(ps);
  }
  return moved;
}

bool Messenger::progressSend(PeerState& ps) {
  bool moved = false;
  while (!ps.sendQueue.empty()) {
    Transfer& t = *ps.sendQueue.front();
    const bool data =
        t.header.kind == FrameKind::kCollective || t.header.kind == FrameKind::kPointToPoint;
    if (t.done == 0 && data && !t.header.byReference && t.bytes >= ps.conn->referenceMinBytes() &&
        (referenceSuits(t.header.opType, Algorithm(t.header.algo), t.bytes) ||
         ps.conn->referencesForEveryOp()) &&
        referenceFits(ps)) {
      t.header.byReference = 1;
      t.referenceSeq = ++ps.referencesSent;
    }
    const bool byReference = t.header.byReference != 0;
    const size_t payloadEnd = kHeaderBytes + (byReference ? sizeof(Reference) : t.bytes);
    const size_t total = padTo8(payloadEnd);
    if (t.done == 0 && total <= kSmallFrameBytes) {
      // Small frame: one contiguous write keeps latency to a single store
      // (shm) or a single packet (tcp).
      ps.scratch.resize(kSmallFrameBytes);
      std::memcpy(ps.scratch.data(), &t.header, kHeaderBytes);
      if (byReference) {
        const Reference ref{reinterpret_cast<uint64_t>(t.src), t.bytes, t.referenceSeq, 0};
        std::memcpy(ps.scratch.data() + kHeaderBytes, &ref, sizeof(ref));
      } else if (t.bytes) {
        std::memcpy(ps.scratch.data() + kHeaderBytes, t.src, t.bytes);
      }
      std::memset(ps.scratch.data() + payloadEnd, 0, total - payloadEnd);
    }
    while (t.done < total) {
      const uint8_t* p;
      size_t n;
      if (total <= kSmallFrameBytes) {
        p = ps.scratch.data() + t.done;
        n = total - t.done;
      } else if (t.done < kHeaderBytes) {
        p = reinterpret_cast<const uint8_t*>(&t.header) + t.done;
        n = kHeaderBytes - t.done;
      } else if (t.done < payloadEnd) {
        p = t.src + (t.done - kHeaderBytes);
        n = payloadEnd - t.done;
      } else {
        p = kZeros;
        n = total - t.done;
      }
      // At most kWriteChunkBytes per write: a transport publishes what one
      // write copied, so the receiver copies out (or reduces) one chunk
      // while this rank copies in the next, instead of after the whole
      // frame.
      const size_t w = ps.conn->write(p, std::min(n, kWriteChunkBytes));
      if (w == 0) return moved;
      t.done += w;
      moved = true;
    }
    if (data) {
      OpTraffic& c = traffic_.of(t.header.opType);
      Traffic::bump(c.framesSent, 1);
      Traffic::bump(c.bytesSent, padTo8(kHeaderBytes + t.bytes));
      Traffic::bump(c.payloadSent, t.bytes);
      if (byReference) Traffic::bump(c.framesSentByReference, 1);
    }
    if (byReference) {
      ps.awaitingRead.push_back(ps.sendQueue.front());  // complete once the peer has read it
    } else {
      t.complete = true;
    }
    ps.sendQueue.pop_front();
  }
  return moved;
}

bool Messenger::progressRecv(int peer, PeerState& ps) {
  bool moved = false;
  Connection& c = *ps.conn;
  while (true) {
    if (ps.headerFill < kHeaderBytes) {
      const Readable r = c.peek();
      if (r.size == 0) return moved;
      const size_t n = std::min(r.size, kHeaderBytes - ps.headerFill);
      std::memcpy(ps.header + ps.headerFill, r.data, n);
      c.consume(n);
      ps.headerFill += n;
      moved = true;
      if (ps.headerFill < kHeaderBytes) continue;
      FrameHeader h;
      std::memcpy(&h, ps.header, kHeaderBytes);
      if (h.magic != kFrameMagic) {
        throw PeerError(
            CLAWCOMM_CONCAT("corrupt stream from rank ", peer, " (frame magic ", h.magic, ")"));
      }
      if (h.epoch != epoch_) {
        throw PeerError(CLAWCOMM_CONCAT("rank ", peer, " sent a frame of another group (epoch ",
                                        h.epoch, ", this group's is ", epoch_, ")"));
      }
      // The op type indexes the traffic counters.
      if (int(h.opType) >= kNumOpTypes) {
        throw PeerError(CLAWCOMM_CONCAT("corrupt stream from rank ", peer, ": op type ",
                                        int(h.opType), " is not one of clawcomm's ", kNumOpTypes));
      }
      ps.target.reset();
      ps.frameDone = 0;
      ps.referenceFill = 0;
      if (h.kind == FrameKind::kClose) {
        ps.closed = true;
        ps.headerFill = 0;
        continue;
      }
    }
    FrameHeader h;
    std::memcpy(&h, ps.header, kHeaderBytes);
    if (!ps.target) {
      ps.target = match(peer, ps, h);
      if (!ps.target) return moved;  // back-pressure: its receive is not posted yet
    }
    Transfer& t = *ps.target;
    const size_t payload = h.payloadBytes;
    const size_t total = padTo8(payload);
    if (h.byReference) {
      if (h.kind != FrameKind::kCollective && h.kind != FrameKind::kPointToPoint) {
        throw PeerError(CLAWCOMM_CONCAT("corrupt stream from rank ", peer, ": a frame of kind ",
                                        int(h.kind), " by reference"));
      }
      if (!takeReference(ps, moved)) return moved;
      Reference& ref = t.reference;
      std::memcpy(&ref, ps.reference, sizeof(ref));
      if (ref.bytes != payload) {
        throw PeerError(CLAWCOMM_CONCAT("corrupt stream from rank ", peer, ": a reference to ",
                                        ref.bytes, " bytes in a frame of ", payload));
      }
      if (t.unexpected) {  // parked (references.cc); the stream moves on
        t.parked = true;
        t.parkedAt = Clock::now();
      } else {
        if (ps.frameDone < payload) {
          readChunk(c, ref, t.sink, ps.frameDone);
          t.done = ps.frameDone;
          moved = true;
          if (ps.frameDone < payload) return moved;  // the next chunk on the next pass
        }
        c.referenceRead(ref.seq);
      }
    }
    while (!h.byReference && ps.frameDone < total) {
      const Readable r = c.peek();
      if (r.size == 0) return moved;
      size_t n;
      if (ps.frameDone < payload) {
        n = std::min(r.size, payload - ps.frameDone);
        const size_t unit = t.sink.granule();
        n -= n % unit;
        if (n == 0) return moved;  // the rest of an element is still in flight
        if (t.unexpected) growStash(t, ps.frameDone + n);
        t.sink.take(ps.frameDone, r.data, n);
        t.done += n;
      } else {
        n = std::min(r.size, total - ps.frameDone);
      }
      c.consume(n);
      ps.frameDone += n;
      moved = true;
    }
    if (h.kind == FrameKind::kCollective || h.kind == FrameKind::kPointToPoint) {
      OpTraffic& c = traffic_.of(h.kind == FrameKind::kPointToPoint ? OpType::kRecv : h.opType);
      Traffic::bump(c.framesReceived, 1);
      Traffic::bump(c.bytesReceived, kHeaderBytes + total);  // by reference too: the same bytes
      Traffic::bump(c.payloadReceived, payload);
      if (h.byReference) Traffic::bump(c.framesReceivedByReference, 1);
    }
    if (!t.parked) finishReceive(peer, ps, ps.target);
    ps.target.reset();
    ps.headerFill = 0;
    moved = true;
  }
}

TransferPtr Messenger::match(int peer, PeerState& ps, const FrameHeader& h) {
  if (h.kind == FrameKind::kCollective) {
    if (ps.postedCollective.empty()) return nullptr;
    TransferPtr t = ps.postedCollective.front();
    const OpSignature got = signatureOf(h);
    if (!got.sameAs(t->expect)) {
      throw MismatchError(CLAWCOMM_CONCAT("rank ", peer, " called ", got.describe(), ", rank ",
                                          rank_, " called ", t->expect.describe()));
    }
    if (h.step != t->step || h.payloadBytes != t->bytes) {
      throw MismatchError(CLAWCOMM_CONCAT("rank ", peer, " sent message ", h.step, " of ",
                                          h.payloadBytes, " bytes, rank ", rank_,
                                          " expected message ", t->step, " of ", t->bytes,
                                          " bytes (do the ranks pass different sizes?)"));
    }
    ps.postedCollective.pop_front();
    return t;
  }
  if (h.kind == FrameKind::kAbort) {
    if (h.payloadBytes != kAbortReasonBytes) {
      throw PeerError(CLAWCOMM_CONCAT("rank ", peer, " sent a malformed abort frame (",
                                      h.payloadBytes, " bytes, not ", kAbortReasonBytes, ")"));
    }
    auto reason = std::make_shared<Transfer>();
    reason->abortReason = true;
    reason->peer = peer;
    reason->bytes = h.payloadBytes;
    reason->stash.resize(h.payloadBytes);
    reason->sink = ReceiveSink::copy(reason->stash.data());
    return reason;
  }
  if (h.kind != FrameKind::kPointToPoint) {
    throw PeerError(CLAWCOMM_CONCAT("rank ", peer, " sent a frame of unknown kind ", int(h.kind),
                                    " (a corrupt stream, or not a clawcomm peer)"));
  }
  auto take = [&](std::list<TransferPtr>& posted) -> TransferPtr {
    for (auto it = posted.begin(); it != posted.end(); ++it) {
      if ((*it)->tag != h.seq) continue;
      TransferPtr t = *it;
      if (t->bytes != h.payloadBytes) {
        throw MismatchError(CLAWCOMM_CONCAT("rank ", peer, " sent ", h.payloadBytes,
                                            " bytes with tag ", h.seq, ", rank ", rank_,
                                            " expected ", t->bytes));
      }
      posted.erase(it);
      t->peer = peer;
      return t;
    }
    return nullptr;
  };
  if (TransferPtr t = take(ps.postedPointToPoint)) return t;
  if (TransferPtr t = take(anySource_)) return t;
  auto stash = std::make_shared<Transfer>();
  stash->mode = Transfer::Mode::kRecv;
  stash->peer = peer;
  stash->tag = h.seq;
  stash->bytes = h.payloadBytes;
  stash->unexpected = true;
  // Stored as it arrives (growStash), never sized from the header alone:
  // a header can claim any length.
  stash->sink = ReceiveSink::copy(nullptr);
  ps.unexpected.push_back(stash);
  return stash;
}

void Messenger::finishReceive(int peer, PeerState& ps, const TransferPtr& t) {
  t->complete = true;
  if (t->abortReason) {
    // The peer's text, up to its first NUL, in printable ASCII only: it
    // ends up in an exception message that Python decodes as UTF-8.
    std::string reason(t->stash.begin(), std::find(t->stash.begin(), t->stash.end(), 0));
    for (char& ch : reason) {
      if (ch < 0x20 || ch > 0x7e) ch = '?';
    }
    throw PeerError(CLAWCOMM_CONCAT("rank ", peer, " aborted: ", reason));
  }
  if (t->unexpected && t->claimedBy) {
    // An unexpected frame that a receive claimed while it was arriving.
    deliver(*t, *t->claimedBy);
    ps.unexpected.remove(t);
  }
}

}  // namespace clawcomm
