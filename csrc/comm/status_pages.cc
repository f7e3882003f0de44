#include "comm/status_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <new>

namespace clawcomm {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;
constexpr uint32_t kCalledAny = 1, kCompletedAny = 2, kFailed = 4;

int64_t coarseNowNs() {
  // The coarse clock: a few nanoseconds a read, against 20 for the precise
  // one, and its millisecond grain is plenty for "idle for 3.2 s".
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

// One rank's page: 64 bytes, a cache line of its own, written only by its
// rank. `version` is odd while a write is under way.
struct alignas(64) StatusPages::Slot {
  std::atomic<uint32_t> version{0};
  std::atomic<int32_t> pid{0};
  std::atomic<uint32_t> flags{0};
  std::atomic<int32_t> root{-1};
  std::atomic<uint64_t> called{0};
  std::atomic<uint64_t> completed{0};
  std::atomic<int64_t> sinceNs{0};
  std::atomic<uint64_t> count{0};
  std::atomic<uint8_t> type{0};
  std::atomic<uint8_t> dtype{0};
  std::atomic<uint8_t> redop{0};
  std::atomic<uint8_t> algo{0};
  std::atomic<int32_t> stalledPeer{0};  // peer + 1 (0: none)
  // The owner's writers on two threads (a call, and an earlier op's
  // completion) take turns here; readers never touch it.
  std::atomic<bool> writing{false};
};

std::string StatusPages::nameFor(const std::string& tokenHex) {
  return "/clawcomm-" + tokenHex + "-status";
}

StatusPages::StatusPages(const std::string& tokenHex, int rank, int size)
    : name_(nameFor(tokenHex)), rank_(rank), size_(size) {
  static_assert(sizeof(Slot) == 64, "a status page is one cache line");
  bytes_ = sizeof(Slot) * size_t(size);
  // No O_EXCL: every rank of the machine opens the same table, the first
  // makes it, and each sets the same size.
  const int fd = shm_open(name_.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd >= 0) {
    if (ftruncate(fd, off_t(bytes_)) == 0) {
      void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        base_ = p;
        shared_ = true;
      }
    }
    close(fd);
  }
  if (fd < 0) unlinked_ = true;  // no name was made
  if (!shared_) {
    base_ = ::operator new(bytes_, std::align_val_t(64));
    std::memset(base_, 0, bytes_);
  }
  Slot* mine = slot(rank_);
  mine->sinceNs.store(coarseNowNs(), kRelaxed);
  mine->pid.store(int32_t(getpid()), std::memory_order_release);
}

StatusPages::~StatusPages() {
  unlink();
  if (shared_) {
    munmap(base_, bytes_);
  } else {
    ::operator delete(base_, std::align_val_t(64));
  }
}

void StatusPages::unlink() noexcept {
  if (unlinked_) return;
  unlinked_ = true;
  shm_unlink(name_.c_str());  // ENOENT (a peer was first): fine
}

StatusPages::Slot* StatusPages::slot(int rank) const {
  return static_cast<Slot*>(base_) + rank;
}

void StatusPages::called(const OpSignature& sig) noexcept {
  Slot& s = *slot(rank_);
  while (s.writing.exchange(true, std::memory_order_acquire)) {
  }
  const uint32_t v = s.version.load(kRelaxed);
  s.version.store(v + 1, kRelaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.called.store(sig.seq, kRelaxed);
  s.type.store(uint8_t(sig.type), kRelaxed);
  s.dtype.store(uint8_t(sig.dtype), kRelaxed);
  s.redop.store(uint8_t(sig.redop), kRelaxed);
  s.algo.store(uint8_t(sig.algo), kRelaxed);
  s.root.store(sig.root, kRelaxed);
  s.count.store(sig.count, kRelaxed);
  s.stalledPeer.store(0, kRelaxed);  // a link found cut in an earlier wait is old news
  s.flags.store(s.flags.load(kRelaxed) | kCalledAny, kRelaxed);
  s.sinceNs.store(coarseNowNs(), kRelaxed);
  s.version.store(v + 2, std::memory_order_release);
  s.writing.store(false, std::memory_order_release);
}

void StatusPages::completed(uint64_t seq, bool ok) noexcept {
  Slot& s = *slot(rank_);
  while (s.writing.exchange(true, std::memory_order_acquire)) {
  }
  const uint32_t v = s.version.load(kRelaxed);
  s.version.store(v + 1, kRelaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.completed.store(seq, kRelaxed);
  s.flags.store(s.flags.load(kRelaxed) | kCompletedAny | (ok ? 0 : kFailed), kRelaxed);
  s.sinceNs.store(coarseNowNs(), kRelaxed);
  s.version.store(v + 2, std::memory_order_release);
  s.writing.store(false, std::memory_order_release);
}

void StatusPages::stalled(int peer) noexcept {
  // One word, read on its own: no sequence count needed.
  slot(rank_)->stalledPeer.store(peer + 1, std::memory_order_relaxed);
}

StatusPage StatusPages::read(int rank) const noexcept {
  StatusPage out;
  if (rank < 0 || rank >= size_ || (!shared_ && rank != rank_)) return out;
  const Slot& s = *slot(rank);
  // A writer stopped mid-write (SIGSTOP between two stores) leaves the
  // count odd for good: after a few tries take what is there.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint32_t v1 = s.version.load(std::memory_order_acquire);
    out.pid = s.pid.load(kRelaxed);
    const uint32_t flags = s.flags.load(kRelaxed);
    out.calledAny = flags & kCalledAny;
    out.completedAny = flags & kCompletedAny;
    out.failed = flags & kFailed;
    out.called = s.called.load(kRelaxed);
    out.completed = s.completed.load(kRelaxed);
    out.sinceNs = s.sinceNs.load(kRelaxed);
    out.last.seq = out.called;
    out.last.type = OpType(s.type.load(kRelaxed));
    out.last.dtype = DataType(s.dtype.load(kRelaxed));
    out.last.redop = ReduceOp(s.redop.load(kRelaxed));
    out.last.algo = Algorithm(s.algo.load(kRelaxed));
    out.last.root = s.root.load(kRelaxed);
    out.last.count = s.count.load(kRelaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if ((v1 & 1) == 0 && s.version.load(kRelaxed) == v1) break;
  }
  out.stalledPeer = s.stalledPeer.load(kRelaxed) - 1;
  out.visible = out.pid != 0;
  return out;
}

int64_t statusClockNs() {
  return coarseNowNs();
}

}  // namespace clawcomm
