// The messenger's waiting and ending (messenger.h): waits that spin, yield
// and sleep on the doorbell or in poll(), the peer health checks and the
// deadline on the way, a cancel from another thread, and the abort and close
// frames at the end. Framing, matching and progress are in messenger.cc.
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
#include "messenger/messenger.h"
#include "transport/doorbell.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CLAWCOMM_CPU_RELAX() _mm_pause()
#else
#define CLAWCOMM_CPU_RELAX() ((void)0)
#endif

namespace clawcomm {
namespace {

constexpr size_t kHeaderBytes = sizeof(FrameHeader);
// How often a sleeping wait wakes to check that its peers are alive.
constexpr auto kHealthCheckInterval = std::chrono::milliseconds(10);
// A wait idle this long looks at its links (setStallWatch), this often: a
// link that gets no ACK for a second looks cut (Connection::stall).
constexpr auto kStallCheckAfter = std::chrono::seconds(1);
constexpr auto kStallCheckInterval = std::chrono::milliseconds(100);

}  // namespace

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

std::string Messenger::whatWasAwaited(int peer, const std::vector<TransferPtr>& waitingOn) const {
  // What this rank waited for from a peer that died, and a frame of the
  // peer's read but not yet claimed by a receive: the facts a lost message
  // would be traced by.
  std::string what;
  for (const auto& t : waitingOn) {
    if (!t->complete && t->peer == peer) {
      what = CLAWCOMM_CONCAT(" while rank ", rank_, " waits for ", describeWait(*t));
      break;
    }
  }
  const PeerState& ps = peers_[peer];
  if (ps.headerFill == kHeaderBytes && !ps.target) {
    FrameHeader h;
    std::memcpy(&h, ps.header, kHeaderBytes);
    what += CLAWCOMM_CONCAT(" (its frame ", h.step, " of ", signatureOf(h).describe(),
                            " read, no receive posted for it)");
  }
  return what;
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
      if (needed[p]) failures += whatWasAwaited(p, waitingOn);
    }
  }
  if (!failures.empty()) throw PeerError(failures);
}

std::vector<std::pair<int, std::string>> Messenger::stalledLinks() const {
  std::vector<std::pair<int, std::string>> out;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || !peers_[p].conn) continue;
    std::string why = peers_[p].conn->stall();
    if (!why.empty()) out.emplace_back(p, std::move(why));
  }
  return out;
}

int64_t Messenger::readSpinMicros(const std::vector<TransferPtr>& waitingOn) const {
  // A send by reference completes when its reader has copied the payload,
  // which takes the copy's time, not a peer's reaction time: a 1 MiB read
  // takes 45-50 us here, just past the 50 us spin, and the sender then
  // slept and paid a wake-up of 30-40 us on top (a 2-rank 1 MiB broadcast
  // by reference: 93-102 us, 65 with a 200 us spin). So the spin also
  // covers the reads this wait needs at kReadBytesPerMicro, up to
  // kMaxReadSpinMicros, past which a wake-up is a small part of the copy.
  // Not where ranks outnumber cores: there the spin would take the
  // reader's core.
  if (!spinForReads_) return 0;
  uint64_t bytes = 0;
  for (const auto& t : waitingOn) {
    if (!t->complete && t->mode == Transfer::Mode::kSend && t->header.byReference) {
      bytes += t->bytes;
    }
  }
  return std::min<int64_t>(int64_t(bytes / kReadBytesPerMicro), kMaxReadSpinMicros);
}

void Messenger::pause(Clock::time_point idleSince, Clock::time_point deadline,
                      const std::vector<TransferPtr>& waitingOn) {
  Clock::time_point now = Clock::now();
  const auto idle = std::chrono::duration_cast<std::chrono::microseconds>(now - idleSince);
  // The reads' extra spin is only looked up once the plain spin is over:
  // this runs between every two polls of a wait.
  if (idle.count() < spinMicros_ || idle.count() < spinMicros_ + readSpinMicros(waitingOn)) {
    // A few pause instructions between polls: one takes about 30 ns on
    // this AMD EPYC (and up to 140 cycles on recent Intel cores), so the 64
    // here before polled every 2 us, longer than the whole exchange of a
    // small all-reduce at 2 ranks (raw engine at 8 B: 1.42x OpenMPI's time
    // with 64, 1.26x with 4, two interleaved runs each).
    for (int i = 0; i < 4; ++i) CLAWCOMM_CPU_RELAX();
    return;
  }
  if (idle.count() < spinMicros_ + yieldMicros_ && now < nextHealthCheck_) {
    sched_yield();
    return;
  }
  if (now >= nextHealthCheck_) {
    nextHealthCheck_ = now + kHealthCheckInterval;
    checkPeers(waitingOn);
    if (stallWatch_ && idle >= kStallCheckAfter && now >= nextStallCheck_) {
      nextStallCheck_ = now + kStallCheckInterval;
      for (const auto& [peer, why] : stalledLinks()) stallWatch_(peer);
    }
    if (now >= deadline) {
      const Transfer* first = nullptr;
      for (const auto& t : waitingOn) {
        if (!t->complete) {
          first = t.get();
          break;
        }
      }
      timedOutOn_ = first ? first->peer : -1;
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
