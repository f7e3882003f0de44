#include "messenger/messenger.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/errors.h"
#include "transport/doorbell.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CLAWCOMM_CPU_RELAX() _mm_pause()
#else
#define CLAWCOMM_CPU_RELAX() ((void)0)
#endif

namespace clawcomm {
namespace {

constexpr uint32_t kFrameMagic = 0x434c4d46;  // "CLMF"
constexpr size_t kHeaderBytes = sizeof(FrameHeader);
// Frames up to this size are assembled contiguously and written in one call.
constexpr size_t kSmallFrameBytes = 4096;
const uint8_t kZeros[8] = {0};
constexpr size_t kWriteChunkBytes = size_t(256) << 10;
// How often a sleeping wait wakes to check that its peers are alive.
constexpr auto kHealthCheckInterval = std::chrono::milliseconds(10);

size_t padTo8(size_t n) {
  return (n + 7) & ~size_t(7);
}

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

}  // namespace

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

void Messenger::startTcpWatcher(const std::vector<int>& fds) {
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  stopFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  CLAWCOMM_CHECK(ep >= 0 && stopFd_ >= 0, "epoll/eventfd for the TCP watcher");
  // Edge-triggered: one event per change (bytes arrived, room to send, the
  // peer hung up), never a busy loop over data the progress thread has not
  // read yet. The progress thread re-reads every socket after arming the
  // doorbell, so a ring it missed while awake costs nothing.
  for (int fd : fds) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.fd = fd;
    CLAWCOMM_CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll_ctl on a TCP socket");
  }
  epoll_event stop{};
  stop.events = EPOLLIN;
  stop.data.fd = stopFd_;
  CLAWCOMM_CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, stopFd_, &stop) == 0, "epoll_ctl on the stop fd");
  Doorbell* bell = doorbell_;
  const int stopFd = stopFd_;
  tcpWatcher_ = std::thread([ep, bell, stopFd] {
    epoll_event events[16];
    while (true) {
      const int n = epoll_wait(ep, events, 16, -1);
      bool stopping = false, ring = false;
      for (int i = 0; i < n; ++i) {
        if (events[i].data.fd == stopFd) {
          stopping = true;
        } else {
          ring = true;
        }
      }
      if (ring) ringDoorbell(*bell);
      if (stopping) break;
    }
    ::close(ep);
  });
}

void Messenger::cancel(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(cancelMutex_);
    if (cancelled_.load()) return;
    cancelReason_ = reason;
  }
  cancelled_.store(true, std::memory_order_seq_cst);
  wake();
}

void Messenger::wake() {
  // Dekker with pause(): flag, full fence, then look for a sleeper (inside
  // ringDoorbell); the sleeper arms, fences, then reads the flag. One of the
  // two always sees the other.
  wakeRequested_.store(true, std::memory_order_seq_cst);
  if (doorbell_) {
    ringDoorbell(*doorbell_);
  } else if (wakeFd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wakeFd_, &one, sizeof(one));
  }
}

const char* Messenger::transportOf(int peer) const {
  return peers_[peer].conn ? peers_[peer].conn->kind() : "self";
}

TransferPtr Messenger::queueSend(int peer, const FrameHeader& header, const void* src,
                                 size_t bytes) {
  CLAWCOMM_CHECK(peer >= 0 && peer < size_ && peer != rank_, "send to rank ", peer);
  auto t = std::make_shared<Transfer>();
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
  auto t = std::make_shared<Transfer>();
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
  bool moved = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    PeerState& ps = peers_[p];
    moved |= settleReferences(ps);
    moved |= progressSend(ps);
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
        (referenceSuits(t.header.opType) || ps.conn->referencesForEveryOp()) && referenceFits(ps)) {
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

void Messenger::waitAll(const std::vector<TransferPtr>& transfers, Clock::time_point deadline) {
  Clock::time_point idleSince = Clock::now();
  while (true) {
    if (cancelled_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(cancelMutex_);
      throw PeerError(cancelReason_);
    }
    const bool moved = progress();
    bool all = true;
    for (const auto& t : transfers) all &= t->complete;
    if (all) return;
    if (moved) {
      idleSince = Clock::now();
      continue;
    }
    pause(idleSince, deadline, transfers);
  }
}

std::string Messenger::describeWait(const Transfer& t) const {
  if (t.mode == Transfer::Mode::kSend && t.header.byReference) {
    return CLAWCOMM_CONCAT("rank ", t.peer, " to read ", t.bytes, " bytes by single copy");
  }
  if (t.mode == Transfer::Mode::kSend) {
    return CLAWCOMM_CONCAT("rank ", t.peer, " to take ", t.bytes, " bytes (", t.done,
                           " frame bytes written)");
  }
  if (t.peer < 0) return CLAWCOMM_CONCAT("any rank to send ", t.bytes, " bytes");
  return CLAWCOMM_CONCAT("rank ", t.peer, " to send ", t.bytes, " bytes (", t.done, " received)");
}

void Messenger::checkPeers(const std::vector<TransferPtr>& waitingOn) {
  for (const auto& t : waitingOn) {
    if (!t->complete && t->peer >= 0 && peers_[t->peer].closed) {
      throw PeerError(CLAWCOMM_CONCAT("rank ", t->peer, " shut down its communicator while rank ",
                                      rank_, " waits for ", describeWait(*t)));
    }
  }
  // Death counts only for peers this wait needs (any-source: all of them);
  // aborts count for every peer. Report every failed peer, not just the
  // first: when one rank dies, the others abort too, and the dead one must
  // still be named.
  std::vector<bool> needed(size_t(size_), false);
  for (const auto& t : waitingOn) {
    if (t->complete) continue;
    if (t->peer < 0) {
      needed.assign(size_t(size_), true);
      break;
    }
    needed[t->peer] = true;
  }
  std::string failures;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || peers_[p].closed) continue;
    try {
      peers_[p].conn->checkPeer(needed[p]);
    } catch (const PeerError& e) {
      failures += failures.empty() ? e.what() : std::string("; ") + e.what();
    }
  }
  if (!failures.empty()) throw PeerError(failures);
}

void Messenger::pause(Clock::time_point idleSince, Clock::time_point deadline,
                      const std::vector<TransferPtr>& waitingOn) {
  Clock::time_point now = Clock::now();
  const auto idle = std::chrono::duration_cast<std::chrono::microseconds>(now - idleSince);
  if (idle.count() < spinMicros_) {
    for (int i = 0; i < 64; ++i) CLAWCOMM_CPU_RELAX();
    return;
  }
  if (idle.count() < spinMicros_ + yieldMicros_ && now < nextHealthCheck_) {
    sched_yield();
    return;
  }
  if (now >= nextHealthCheck_) {
    nextHealthCheck_ = now + kHealthCheckInterval;
    checkPeers(waitingOn);
    if (now >= deadline) {
      const Transfer* first = nullptr;
      for (const auto& t : waitingOn) {
        if (!t->complete) {
          first = t.get();
          break;
        }
      }
      throw TimeoutError(CLAWCOMM_CONCAT("timed out waiting for ",
                                         first ? describeWait(*first) : std::string("nothing")));
    }
  }
  // Sleep until a peer makes progress possible, or until the next health
  // check or the deadline, whichever comes first.
  const auto wake = std::min(nextHealthCheck_, deadline);
  const auto budget = std::chrono::duration_cast<std::chrono::microseconds>(wake - now);
  if (wakeRequested_.exchange(false, std::memory_order_seq_cst)) return;
  if (doorbell_) {
    const uint32_t seen = armDoorbell(*doorbell_);
    struct Disarm {
      Doorbell* d;
      ~Disarm() { disarmDoorbell(*d); }
    } disarm{doorbell_};
    if (progress()) return;  // bytes arrived between the last pass and arming
    // Work queued by this rank's other threads (wake()) between the check
    // above and arming.
    if (wakeRequested_.exchange(false, std::memory_order_seq_cst)) return;
    sleepOnDoorbell(*doorbell_, seen, budget);
  } else if (pollFds_) {
    std::vector<pollfd> fds;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const Connection& c = *peers_[p].conn;
      const bool writing = !peers_[p].sendQueue.empty();
      if (writing && c.writePollFd() != c.pollFd()) {  // a striped stream
        fds.push_back(pollfd{c.pollFd(), POLLIN, 0});
        fds.push_back(pollfd{c.writePollFd(), POLLOUT, 0});
      } else {
        fds.push_back(pollfd{c.pollFd(), short(POLLIN | (writing ? POLLOUT : 0)), 0});
      }
    }
    if (wakeFd_ >= 0) fds.push_back(pollfd{wakeFd_, POLLIN, 0});
    poll(fds.data(), fds.size(), int(std::max<long long>(1, budget.count() / 1000)));
    if (wakeFd_ >= 0 && (fds.back().revents & POLLIN)) {
      uint64_t drained;
      [[maybe_unused]] ssize_t n = ::read(wakeFd_, &drained, sizeof(drained));
      wakeRequested_.store(false, std::memory_order_relaxed);
    }
  } else if (idle < std::chrono::milliseconds(2)) {
    // Connections with neither a doorbell nor a file descriptor: nothing to
    // block on. Yield first (another rank may share this core), then nap in
    // growing steps.
    sched_yield();
  } else {
    const long ns = idle < std::chrono::milliseconds(50) ? 50'000 : 500'000;
    timespec ts{0, ns};
    nanosleep(&ts, nullptr);
  }
}

void Messenger::abort(const std::string& reason) noexcept {
  // Best effort: where the outgoing stream sits between frames, append an
  // abort frame with the reason, then cut the connection.
  std::vector<uint8_t> frame(kHeaderBytes + kAbortReasonBytes, 0);
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.epoch = epoch_;
  h.kind = FrameKind::kAbort;
  h.payloadBytes = kAbortReasonBytes;
  std::memcpy(frame.data(), &h, kHeaderBytes);
  std::memcpy(frame.data() + kHeaderBytes, reason.data(),
              std::min(reason.size(), kAbortReasonBytes - 1));
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(50);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    PeerState& ps = peers_[p];
    try {
      if (ps.sendQueue.empty() || ps.sendQueue.front()->done == 0) {
        size_t written = 0;
        while (written < frame.size() && Clock::now() < deadline) {
          const size_t w = ps.conn->write(frame.data() + written, frame.size() - written);
          written += w;
          if (w == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
      ps.conn->abort(reason);
    } catch (...) {
    }
  }
}

void Messenger::close(Clock::time_point deadline) noexcept {
  try {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      auto t = std::make_shared<Transfer>();
      t->peer = p;
      t->header.magic = kFrameMagic;
      t->header.epoch = epoch_;
      t->header.kind = FrameKind::kClose;
      peers_[p].sendQueue.push_back(t);
    }
    bool pending = true;
    while (pending && Clock::now() < deadline) {
      pending = false;
      bool moved = false;
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        moved |= progressSend(peers_[p]);
        pending |= !peers_[p].sendQueue.empty();
      }
      if (pending && !moved) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) peers_[p].conn->close();
    }
  } catch (...) {
  }
}

}  // namespace clawcomm
