#include "transport/shm/connection.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "common/errors.h"
#include "common/process.h"
#include "transport/doorbell.h"
#include "transport/shm/ring_pages.h"

namespace clawcomm {
namespace {

constexpr uint64_t kSegmentMagic = 0x636c6177'73686d31ull;  // "claw" "shm1"
constexpr size_t kHeaderBytes = 128;
constexpr size_t kReasonBytes = 384;

// kClosed: the writer shut down cleanly; what it wrote stays readable.
enum RingState : uint32_t { kOpen = 0, kAborted = 1, kClosed = 2 };
// The reader's verdict on single copy for one ring (RingControl::attach).
enum Attach : uint32_t { kAttachUnknown = 0, kAttachYes = 1, kAttachNo = 2 };

// Control block of one ring. head and tail live on their own cache lines so
// the producer and the consumer never write the same line.
struct alignas(64) RingControl {
  std::atomic<uint64_t> head;  // bytes ever written, by the producer
  char pad0[56];
  std::atomic<uint64_t> tail;  // bytes ever consumed, by the consumer
  char pad1[56];
  std::atomic<uint32_t> producerState;
  std::atomic<uint32_t> consumerState;
  char pad2[56];
  // Single copy, written by the consumer: whether it can read the
  // producer's memory (Attach), and the references it has read, each in
  // slot seq % kReferenceWindow.
  std::atomic<uint32_t> attach;
  // Set before attach: the smallest payload the reader takes by
  // reference, in KiB (measureReads); 0: the sender's setting decides.
  std::atomic<uint32_t> readMinKiB;
  char pad3[56];
  std::atomic<uint64_t> referenceDone[Connection::kReferenceWindow];
  char producerReason[kReasonBytes];
  char consumerReason[kReasonBytes];
};
static_assert(sizeof(RingControl) % 64 == 0, "ring control must be cache aligned");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free atomics in shm");

struct SegmentHeader {
  uint64_t magic;
  int32_t pid;
  int32_t rank;
  int32_t size;
  int32_t rings;  // one per shared-memory peer of this rank
  uint64_t ringBytes;
  // Where this header lies in its owner's address space: the single-copy
  // probe reads it from there.
  uint64_t ownAddress;
  // Rung by every peer that writes into this segment's rings or frees space
  // in the rings this rank writes to (see transport/doorbell.h).
  Doorbell doorbell;
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes, "segment header fits its slot");

size_t segmentBytes(size_t rings, size_t ringBytes) {
  return kHeaderBytes + rings * (sizeof(RingControl) + ringBytes);
}

// Where rank `writer`'s ring lies in the segment of a rank whose
// shared-memory peers are `peers` (ascending).
int slotOf(const std::vector<int>& peers, int writer) {
  const auto it = std::lower_bound(peers.begin(), peers.end(), writer);
  CLAWCOMM_CHECK(it != peers.end() && *it == writer, "rank ", writer,
                 " has no ring in a segment whose peers do not include it");
  return int(it - peers.begin());
}

}  // namespace

bool peerLeftNothing(const std::function<bool()>& gone, const std::function<bool()>& closed,
                     const std::function<bool()>& unread) {
  // The process first, then the ring. The other way round, a peer that
  // wrote its last frame and exited between the two looks (a few system
  // calls apart, more where this rank is preempted between them, as with 4
  // ranks on 2 cores) seemed to have died with nothing written. Once it is
  // gone it writes nothing more, so what the ring holds then is final.
  if (!gone()) return false;
  return !closed() && !unread();
}

namespace {

void writeReason(char* dst, const std::string& reason) {
  std::snprintf(dst, kReasonBytes, "%s", reason.c_str());
}

// Copies `n` bytes at `address` in process `pid` to `dst`; returns 0, or the
// errno of the failure.
int readProcess(int pid, uint64_t address, void* dst, size_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  while (n > 0) {
    iovec local{out, n};
    iovec remote{reinterpret_cast<void*>(address), n};
    const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? errno : EFAULT;
    out += got;
    address += uint64_t(got);
    n -= size_t(got);
  }
  return 0;
}

// From which payload size this reader takes a peer's frames by single copy:
// kFastSingleCopyBytes where the kernel reads `n` bytes of the peer's pages
// in at most kFastReadRatio times a plain copy of the same pages (through
// this rank's mapping of them), `fallback` elsewhere. Both best of a few,
// after a first pass that faults the pages in. Why the ratio: where every
// rank sends and receives at once (the operations single copy serves), the
// ring costs each rank two copies of every frame plus a hand-off per 256
// KiB chunk, the single copy one kernel copy. On the 2-core Sapphire Rapids
// VM the read took 1.8x the copy (28.7 against 52 GB/s at 256 KiB), and
// frames of 32 KiB to 1 MiB by reference took 0.35-0.75x the ring's time;
// on the earlier EPYC a 256 KiB read from 4 KiB pages cost more than the
// ring's two copies, so such a machine keeps the 1 MiB.
constexpr double kFastReadRatio = 3.0;
constexpr size_t kProbeReadBytes = size_t(256) << 10;

size_t measureReads(int pid, uint64_t remote, const uint8_t* local, size_t n, size_t fallback) {
  std::vector<uint8_t> dst(n);
  auto best = [](auto&& run) {
    Clock::duration fastest = Clock::duration::max();
    for (int i = 0; i < 12; ++i) {  // 12: with 4 ranks on 2 cores, 6 once caught none unhurried
      const Clock::time_point t0 = Clock::now();
      if (!run()) return Clock::duration::max();
      if (i > 0) fastest = std::min(fastest, Clock::now() - t0);
    }
    return fastest;
  };
  const Clock::duration read = best([&] { return readProcess(pid, remote, dst.data(), n) == 0; });
  const Clock::duration copy = best([&] {
    std::memcpy(dst.data(), local, n);
    asm volatile("" : : "r"(dst.data()) : "memory");
    return true;
  });
  if (read == Clock::duration::max()) return fallback;
  return double(read.count()) <= kFastReadRatio * double(copy.count()) ? kFastSingleCopyBytes
                                                                       : fallback;
}

std::string yamaScope() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  std::string v;
  return f >> v ? v : std::string();
}

}  // namespace

class ShmMapping {
 public:
  ShmMapping(void* base, size_t bytes) : base_(static_cast<uint8_t*>(base)), bytes_(bytes) {}
  ~ShmMapping() { munmap(base_, bytes_); }
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  RingControl* ring(int slot) const {
    return reinterpret_cast<RingControl*>(base_ + kHeaderBytes +
                                          size_t(slot) * (sizeof(RingControl) + ringBytes()));
  }
  uint8_t* ringData(int slot) const { return reinterpret_cast<uint8_t*>(ring(slot) + 1); }
  size_t ringBytes() const { return header()->ringBytes; }

 private:
  uint8_t* base_;
  size_t bytes_;
};

namespace {

class ShmConnection : public Connection {
 public:
  // `inSlot`: the peer's ring in this rank's segment; `outSlot`: this
  // rank's ring in the peer's.
  ShmConnection(int rank, int peer, std::shared_ptr<ShmMapping> own,
                std::shared_ptr<ShmMapping> remote, int inSlot, int outSlot,
                SingleCopyPolicy policy)
      : rank_(rank),
        peer_(peer),
        peerPid_(remote->header()->pid),
        own_(std::move(own)),
        remote_(std::move(remote)),
        in_(own_->ring(inSlot)),
        inData_(own_->ringData(inSlot)),
        out_(remote_->ring(outSlot)),
        outData_(remote_->ringData(outSlot)),
        cap_(own_->ringBytes()),
        policy_(policy) {}

  // Producer side: copy into the peer's ring, wrapping at its end.
  size_t write(const void* data, size_t n) override {
    const uint64_t head = out_->head.load(std::memory_order_relaxed);
    const uint64_t tail = out_->tail.load(std::memory_order_acquire);
    n = std::min<size_t>(n, cap_ - size_t(head - tail));
    if (n == 0) return 0;
    const size_t off = size_t(head % cap_);
    const size_t first = std::min(n, cap_ - off);
    std::memcpy(outData_ + off, data, first);
    if (n > first) std::memcpy(outData_, static_cast<const uint8_t*>(data) + first, n - first);
    out_->head.store(head + n, std::memory_order_release);
    ringDoorbell(remote_->header()->doorbell);
    return n;
  }

  Readable peek() override {
    const uint64_t head = in_->head.load(std::memory_order_acquire);
    const uint64_t tail = in_->tail.load(std::memory_order_relaxed);
    const size_t off = size_t(tail % cap_);
    return Readable{inData_ + off, std::min<size_t>(size_t(head - tail), cap_ - off)};
  }

  void consume(size_t n) override {
    in_->tail.store(in_->tail.load(std::memory_order_relaxed) + n, std::memory_order_release);
    ringDoorbell(remote_->header()->doorbell);  // the writer may wait for space
  }

  Doorbell* doorbell() override { return &own_->header()->doorbell; }

  size_t ringBytes() const override { return cap_; }
  size_t ringResidentBytes() const override { return residentBytes(inData_, cap_); }
  void releaseRing() override { releasePages(inData_, cap_); }
  void reserveRing() override { reservePages(inData_, cap_, peer_); }

  void checkPeer(bool waitingOnIt) override {
    if (in_->producerState.load(std::memory_order_acquire) == kAborted) {
      throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " aborted: ", in_->producerReason));
    }
    if (out_->consumerState.load(std::memory_order_acquire) == kAborted) {
      throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " aborted: ", out_->consumerReason));
    }
    if (!waitingOnIt) return;
    // A peer that exited after its last send (without shutting the
    // communicator down) is only a failure once what it wrote is consumed.
    const bool died = peerLeftNothing(
        [&] { return processGone(peerPid_); },
        [&] { return in_->producerState.load(std::memory_order_acquire) == kClosed; },
        [&] {
          return in_->head.load(std::memory_order_acquire) !=
                 in_->tail.load(std::memory_order_relaxed);
        });
    if (died) throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " (pid ", peerPid_, ") died"));
  }

  void abort(const std::string& reason) override {
    writeReason(out_->producerReason, reason);
    out_->producerState.store(kAborted, std::memory_order_release);
    writeReason(in_->consumerReason, reason);
    in_->consumerState.store(kAborted, std::memory_order_release);
    ringDoorbell(remote_->header()->doorbell);
  }

  void close() override {
    uint32_t open = kOpen;
    out_->producerState.compare_exchange_strong(open, kClosed, std::memory_order_release);
    ringDoorbell(remote_->header()->doorbell);
  }

  const char* kind() const override { return "shm"; }

  size_t referenceMinBytes() const override {
    if (out_->attach.load(std::memory_order_acquire) != kAttachYes) return SIZE_MAX;
    const uint32_t kib = out_->readMinKiB.load(std::memory_order_relaxed);
    return kib ? size_t(kib) << 10 : policy_.minBytes;
  }

  bool referencesForEveryOp() const override { return policy_.everyOp; }

  void readPeer(uint64_t address, void* dst, size_t n) override {
    const int err = readProcess(peerPid_, address, dst, n);
    if (err == 0) return;
    throw PeerError(CLAWCOMM_CONCAT(
        "rank ", rank_, " could not read ", n, " bytes from rank ", peer_, " (pid ", peerPid_,
        ") by single copy: ", std::strerror(err),
        err == ESRCH    ? " (the rank died)"
        : err == EFAULT ? " (its buffer is gone: the rank died or freed it before the receive)"
                        : ""));
  }

  void referenceRead(uint64_t seq) override {
    in_->referenceDone[seq % kReferenceWindow].store(seq, std::memory_order_release);
    ringDoorbell(remote_->header()->doorbell);
  }

  bool referenceWasRead(uint64_t seq) const override {
    return out_->referenceDone[seq % kReferenceWindow].load(std::memory_order_acquire) == seq;
  }

 private:
  int rank_;
  int peer_;
  int peerPid_;
  std::shared_ptr<ShmMapping> own_;
  std::shared_ptr<ShmMapping> remote_;
  RingControl* in_;
  uint8_t* inData_;
  RingControl* out_;
  uint8_t* outData_;
  size_t cap_;
  SingleCopyPolicy policy_;
};

std::shared_ptr<ShmMapping> mapSegment(int fd, size_t bytes, const std::string& name) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    throw Error(CLAWCOMM_CONCAT("clawcomm shm: mmap of ", name, " (", bytes,
                                " bytes) failed: ", std::strerror(errno)));
  }
  return std::make_shared<ShmMapping>(base, bytes);
}

std::string segmentName(const std::string& jobToken, int rank) {
  return "/clawcomm-" + jobToken + "-" + std::to_string(rank);
}

}  // namespace

ShmEndpoint::ShmEndpoint(const std::string& jobToken, int rank, int size, size_t ringBytes,
                         std::vector<std::vector<int>> peersOf, SingleCopyPolicy singleCopy)
    : jobToken_(jobToken),
      name_(segmentName(jobToken, rank)),
      rank_(rank),
      size_(size),
      ringBytes_(ringBytes),
      peersOf_(std::move(peersOf)),
      singleCopy_(singleCopy) {
  const size_t rings = peersOf_.at(size_t(rank)).size();
  CLAWCOMM_CHECK(ringBytes % 64 == 0, "ring bytes ", ringBytes);
  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw Error(CLAWCOMM_CONCAT("clawcomm shm: cannot create ", name_, ": ", std::strerror(errno)));
  }
  const size_t bytes = segmentBytes(rings, ringBytes);
  if (ftruncate(fd, off_t(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    shm_unlink(name_.c_str());
    throw Error(CLAWCOMM_CONCAT("clawcomm shm: cannot size ", name_, " to ", bytes,
                                " bytes: ", std::strerror(err),
                                " (is /dev/shm large enough? lower CLAWCOMM_SHM_RING_BYTES)"));
  }
  // tmpfs gives pages only when they are first touched: without reserving
  // them now, a /dev/shm too small (Docker's default is 64 MB) would show up
  // later as SIGBUS on the first write into a ring.
  const int reserved = posix_fallocate(fd, 0, off_t(bytes));
  if (reserved != 0 && reserved != EOPNOTSUPP && reserved != EINVAL) {
    ::close(fd);
    shm_unlink(name_.c_str());
    throw Error(CLAWCOMM_CONCAT(
        "clawcomm shm: /dev/shm has no room for rank ", rank, "'s ", bytes, " bytes (", rings,
        " rings of CLAWCOMM_SHM_RING_BYTES=", ringBytes, "): ", std::strerror(reserved),
        "; every local rank needs as much: give /dev/shm more room (Docker: --shm-size) or "
        "lower CLAWCOMM_SHM_RING_BYTES"));
  }
  try {
    own_ = mapSegment(fd, bytes, name_);
  } catch (...) {
    ::close(fd);
    shm_unlink(name_.c_str());
    throw;
  }
  ::close(fd);
  SegmentHeader* h = own_->header();
  h->pid = int32_t(getpid());
  h->rank = rank;
  h->size = size;
  h->rings = int32_t(rings);
  h->ringBytes = ringBytes;
  h->ownAddress = reinterpret_cast<uint64_t>(h);
  // Yama's "restricted" ptrace (scope 1) lets a process read only its
  // descendants' memory, and sibling ranks are not: name the launcher, so
  // that processes under it (the other ranks) may. Scopes 2 and 3 allow no
  // such exception; the probe then fails and the ring carries everything.
  if (singleCopy_.probe && yamaScope() == "1") prctl(PR_SET_PTRACER, getppid(), 0, 0, 0);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kSegmentMagic;
}

ShmEndpoint::~ShmEndpoint() {
  finishSetup();
}

std::unique_ptr<Connection> ShmEndpoint::connect(int peer, const std::string& peerAddress,
                                                 Clock::time_point deadline) {
  int fd = -1;
  while ((fd = shm_open(peerAddress.c_str(), O_RDWR, 0600)) < 0) {
    if (errno != ENOENT || Clock::now() > deadline) {
      throw PeerError(CLAWCOMM_CONCAT("clawcomm shm: rank ", rank_, " cannot open rank ", peer,
                                      "'s segment ", peerAddress, ": ", std::strerror(errno)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const std::vector<int>& theirs = peersOf_.at(size_t(peer));
  auto remote = mapSegment(fd, segmentBytes(theirs.size(), ringBytes_), peerAddress);
  ::close(fd);
  const SegmentHeader* h = remote->header();
  if (h->magic != kSegmentMagic || h->size != size_ || h->rank != peer ||
      h->ringBytes != ringBytes_ || size_t(h->rings) != theirs.size()) {
    throw Error(CLAWCOMM_CONCAT("clawcomm shm: segment ", peerAddress, " holds rank ", h->rank,
                                " of ", h->size, " with ", h->ringBytes, "-byte rings; rank ",
                                rank_, " expected rank ", peer, " of ", size_, " with ", ringBytes_,
                                "-byte rings (is CLAWCOMM_SHM_RING_BYTES the same everywhere?)"));
  }
  const int inSlot = slotOf(peersOf_[size_t(rank_)], peer);
  if (singleCopy_.probe) {
    // Reads the peer's header out of its own address space: the bytes must
    // be what the shared mapping shows.
    SegmentHeader seen{};
    const int err = readProcess(h->pid, h->ownAddress, &seen, offsetof(SegmentHeader, doorbell));
    const bool ok = err == 0 && std::memcmp(&seen, h, offsetof(SegmentHeader, doorbell)) == 0;
    if (!ok && singleCopy_.required) {
      const std::string scope = yamaScope();
      throw Error(CLAWCOMM_CONCAT(
          "clawcomm shm: CLAWCOMM_SINGLE_COPY=cma, but rank ", rank_, " cannot read rank ", peer,
          "'s memory (pid ", h->pid,
          ") with process_vm_readv: ", err ? std::strerror(err) : "it read other bytes",
          scope.empty() ? "" : CLAWCOMM_CONCAT(" (kernel.yama.ptrace_scope=", scope, ")"),
          "; a container's seccomp profile or a ptrace policy can forbid it. "
          "CLAWCOMM_SINGLE_COPY=auto falls back to the ring"));
    }
    RingControl* in = own_->ring(inSlot);
    if (ok && singleCopy_.measure) {
      // The peer's first ring: mapped in its address space and in this
      // rank's, the same pages.
      const size_t n = std::min(kProbeReadBytes, ringBytes_);
      const uint64_t offset = kHeaderBytes + sizeof(RingControl);
      const size_t from = measureReads(h->pid, h->ownAddress + offset, remote->ringData(0), n,
                                       singleCopy_.minBytes);
      in->readMinKiB.store(uint32_t(from >> 10), std::memory_order_relaxed);
    }
    in->attach.store(ok ? kAttachYes : kAttachNo, std::memory_order_release);
  }
  return std::make_unique<ShmConnection>(rank_, peer, own_, std::move(remote), inSlot,
                                         slotOf(theirs, rank_), singleCopy_);
}

void ShmEndpoint::finishSetup() {
  if (unlinked_) return;
  unlinked_ = true;
  for (int p = 0; p < size_; ++p) shm_unlink(segmentName(jobToken_, p).c_str());  // ENOENT: fine
}

}  // namespace clawcomm
