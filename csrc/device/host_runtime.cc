#include "device/host_runtime.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/errors.h"
#include "device/ipc_algorithms.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {
namespace device {
namespace {

// One block of a launch, run by one host thread: the executor that
// device/protocol.h describes, with a block of one thread.
class HostBlock {
 public:
  explicit HostBlock(int block) : block_(block) {}
  int thread() const { return 0; }
  int threads() const { return 1; }
  int block() const { return block_; }
  void sync() const {}
  uint32_t* shared() const { return shared_; }
  uint64_t nowNs() const {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
  }
  // Ranks outnumber cores in the tests (nine ranks of two blocks on two
  // cores): give the core away soon, and sleep on a long wait.
  void pause(uint32_t spins) const {
    if (spins < 256) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  static void storeRelease(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  static uint32_t loadAcquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  static void fenceSystem() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
  static bool claim(uint32_t* p) {
    uint32_t zero = 0;
    return __atomic_compare_exchange_n(p, &zero, 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  }
  static Pack load(const Pack* p) { return *p; }
  static Pack loadPeer(const Pack* p) { return *p; }
  static void store(Pack* p, Pack v) { *p = v; }

 private:
  int block_;
  mutable uint32_t shared_[2] = {0, 0};
};

// Runs every block of `L`, block 0 on this thread.
void execute(const IpcLaunch& L) {
  dispatchKernel(L, [&](auto body, auto element, auto op) {
    constexpr int K = decltype(body)::value;
    using E = typename decltype(element)::type;
    using Op = decltype(op);
    std::vector<std::thread> others;
    for (int b = 1; b < L.blocks; ++b) {
      others.emplace_back([&L, b] { runBody<K, E, Op>(HostBlock(b), L); });
    }
    runBody<K, E, Op>(HostBlock(0), L);
    for (auto& t : others) t.join();
  });
}

std::string segmentName() {
  static std::atomic<uint64_t> next{0};
  return CLAWCOMM_CONCAT("/clawcomm-dev-", getpid(), "-", next++);
}

std::string errnoText() {
  return std::strerror(errno);
}

// An event: done once `stream` has finished its first `at` steps.
struct HostEvent {
  Stream stream;
  uint64_t at;
};

const HostEvent& eventOf(DeviceRuntime::Event e) {
  return *static_cast<const HostEvent*>(e);
}

}  // namespace

HostFault hostFaultNamed(const std::string& name) {
  if (name == "none") return HostFault::kNone;
  if (name == "alloc") return HostFault::kAlloc;
  if (name == "open") return HostFault::kOpen;
  if (name == "probe") return HostFault::kProbe;
  throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: unknown host-runtime fault '", name,
                                        "' (none, alloc, open, probe)"));
}

void HostGraph::replay() {
  for (auto& step : steps_) step();
}

HostRuntime::HostRuntime(int device, HostFault fault) : device_(device), fault_(fault) {}

HostRuntime::~HostRuntime() {
  for (auto& t : holders_) t.join();  // holds end, and what they held runs
  for (auto& [p, s] : segments_) {
    ::munmap(p, s.bytes);
    if (s.owner && !s.unlinked) ::shm_unlink(s.name.c_str());
  }
}

void* HostRuntime::allocShared(size_t bytes) {
  CLAWCOMM_CHECK(fault_ != HostFault::kAlloc, "allocating ", bytes,
                 " bytes of device memory failed: out of memory (injected fault)");
  const std::string name = segmentName();
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  CLAWCOMM_CHECK(fd >= 0, "shm_open(", name, ") failed: ", errnoText());
  void* p = MAP_FAILED;
  if (::ftruncate(fd, off_t(bytes)) == 0) {
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const std::string why = errnoText();
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    CLAWCOMM_CHECK(false, "mapping ", bytes, " bytes of shared memory failed: ", why);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  segments_[p] = {name, bytes, true, false};
  return p;
}

void HostRuntime::freeShared(void* p) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(p);
  if (it == segments_.end()) return;
  ::munmap(p, it->second.bytes);
  if (!it->second.unlinked) ::shm_unlink(it->second.name.c_str());
  segments_.erase(it);
}

std::vector<uint8_t> HostRuntime::exportHandle(void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Segment& s = segments_.at(p);
  return std::vector<uint8_t>(s.name.begin(), s.name.end());
}

void* HostRuntime::openHandle(const std::vector<uint8_t>& handle) {
  const std::string name(handle.begin(), handle.end());
  CLAWCOMM_CHECK(fault_ != HostFault::kOpen, "opening ", name,
                 ": IPC is not supported here (injected fault)");
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  CLAWCOMM_CHECK(fd >= 0, "shm_open(", name, ") failed: ", errnoText());
  struct stat st;
  void* p = MAP_FAILED;
  if (::fstat(fd, &st) == 0) {
    // A private mapping reads the peer's memory but keeps its own writes:
    // what an IPC mapping that does not really reach the peer looks like.
    const int flags = fault_ == HostFault::kProbe ? MAP_PRIVATE : MAP_SHARED;
    p = ::mmap(nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, flags, fd, 0);
  }
  const std::string why = errnoText();
  ::close(fd);
  CLAWCOMM_CHECK(p != MAP_FAILED, "mapping ", name, " failed: ", why);
  std::lock_guard<std::mutex> lock(mutex_);
  segments_[p] = {name, size_t(st.st_size), false, true};
  return p;
}

void HostRuntime::closeHandle(void* p) noexcept {
  freeShared(p);
}

void HostRuntime::setupDone(void* p) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(p);
  if (it == segments_.end() || it->second.unlinked) return;
  ::shm_unlink(it->second.name.c_str());
  it->second.unlinked = true;
}

void* HostRuntime::allocMapped(size_t bytes, void** onDevice) {
  void* p = std::aligned_alloc(64, (bytes + 63) & ~size_t(63));
  CLAWCOMM_CHECK(p != nullptr, "allocating ", bytes, " bytes of host-mapped memory failed");
  std::memset(p, 0, bytes);
  *onDevice = p;
  return p;
}

void HostRuntime::freeMapped(void* host) noexcept {
  std::free(host);
}

void HostRuntime::fill(void* dst, int byte, size_t bytes) {
  std::memset(dst, byte, bytes);
}

void HostRuntime::toHost(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}

void HostRuntime::toDevice(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}

void HostRuntime::writeWordNow(uint32_t* dst, uint32_t value) {
  __atomic_store_n(dst, value, __ATOMIC_SEQ_CST);
}

void HostRuntime::run(Stream s, std::function<void()> step) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = s ? graphs_.find(s) : graphs_.end();
    if (it != graphs_.end()) {
      it->second->steps_.push_back(std::move(step));
      return;
    }
  }
  if (!s) {
    step();
    return;
  }
  std::unique_lock<std::mutex> lock(streamMutex_);
  HostStream& st = streams_[s];
  ++st.issued;
  st.queue.push_back({std::move(step)});
  drain(lock);  // runs it now, unless something is queued before it
}

bool HostRuntime::finishedLocked(Stream s, uint64_t upTo) {
  if (!s) return true;
  auto it = streams_.find(s);
  return it == streams_.end() || it->second.finished >= upTo;
}

void HostRuntime::drain(std::unique_lock<std::mutex>& lock) {
  // std::map keeps its nodes where they are while other threads add
  // streams, so `st` stays valid across the unlocked calls.
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (auto& [stream, st] : streams_) {
      while (!st.running && st.holds == 0 && !st.queue.empty()) {
        Step& head = st.queue.front();
        if (!head.call) {
          if (!finishedLocked(head.waitFor, head.upTo)) break;
          st.queue.pop_front();
          ++st.finished;
          progressed = true;
          continue;
        }
        std::function<void()> call = std::move(head.call);
        st.queue.pop_front();
        st.running = true;
        lock.unlock();
        std::exception_ptr failed;
        try {
          call();
        } catch (...) {
          failed = std::current_exception();
        }
        lock.lock();
        st.running = false;
        ++st.finished;
        progressed = true;
        streamsChanged_.notify_all();
        if (failed) std::rethrow_exception(failed);
      }
    }
  }
  streamsChanged_.notify_all();
}

void HostRuntime::streamWaitStream(Stream waiter, Stream producer) {
  if (!producer || waiter == producer) return;
  Event e = record(producer);
  streamWait(waiter, e);
  release(e);
}

DeviceRuntime::Event HostRuntime::record(Stream s) {
  std::lock_guard<std::mutex> lock(streamMutex_);
  return new HostEvent{s, s ? streams_[s].issued : 0};
}

bool HostRuntime::done(Event e) {
  refuseWhileCapturing("an event query");
  std::lock_guard<std::mutex> lock(streamMutex_);
  return finishedLocked(eventOf(e).stream, eventOf(e).at);
}

void HostRuntime::streamWait(Stream s, Event e) {
  const HostEvent& ev = eventOf(e);
  if (!s) {  // the null stream runs at once: the host waits
    waitHost(e);
    return;
  }
  std::unique_lock<std::mutex> lock(streamMutex_);
  if (s == ev.stream || finishedLocked(ev.stream, ev.at)) return;
  HostStream& st = streams_[s];
  ++st.issued;
  st.queue.push_back({nullptr, ev.stream, ev.at});
}

void HostRuntime::waitHost(Event e) {
  refuseWhileCapturing("an event wait");
  const HostEvent& ev = eventOf(e);
  std::unique_lock<std::mutex> lock(streamMutex_);
  streamsChanged_.wait(lock, [&] { return finishedLocked(ev.stream, ev.at); });
}

void HostRuntime::release(Event e) noexcept {
  delete static_cast<HostEvent*>(e);
}

void HostRuntime::synchronize() {
  std::unique_lock<std::mutex> lock(streamMutex_);
  streamsChanged_.wait(lock, [&] {
    for (const auto& [stream, st] : streams_) {
      if (st.running || !st.queue.empty()) return false;
    }
    return true;
  });
}

void HostRuntime::hold(Stream s, int forMs) {
  CLAWCOMM_ARG_CHECK(s != nullptr, "clawcomm: the null stream runs at once and cannot be held");
  std::lock_guard<std::mutex> lock(streamMutex_);
  ++streams_[s].holds;
  holders_.emplace_back([this, s, forMs] {
    std::this_thread::sleep_for(std::chrono::milliseconds(forMs));
    std::unique_lock<std::mutex> held(streamMutex_);
    --streams_[s].holds;
    try {
      drain(held);
    } catch (...) {  // a launch that fails here reports through its group's status
    }
  });
}

void HostRuntime::copy(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) run(s, [=] { std::memmove(dst, src, bytes); });
}

void HostRuntime::launch(const IpcLaunch& launch, Stream s) {
  run(s, [launch] { execute(launch); });
}

void HostRuntime::divide(DataType type, void* buf, size_t count, double divisor, Stream s) {
  run(s, [=] { divideInPlace(type, buf, count, divisor); });
}

void HostRuntime::refuseWhileCapturing(const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  CLAWCOMM_CHECK(graphs_.empty(), what,
                 " while a stream captures a graph (CUDA: operation not permitted when stream "
                 "is capturing)");
}

bool HostRuntime::capturing(Stream s) {
  std::lock_guard<std::mutex> lock(mutex_);
  return s && graphs_.count(s);
}

void HostRuntime::keepWithGraph(Stream s, std::shared_ptr<void> keep) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = graphs_.find(s);
  CLAWCOMM_CHECK(it != graphs_.end(), "keepWithGraph on a stream that is not capturing");
  it->second->keep_.push_back(std::move(keep));
}

void HostRuntime::beginCapture(Stream s) {
  CLAWCOMM_ARG_CHECK(s != nullptr, "clawcomm: capture needs a stream other than the default");
  std::lock_guard<std::mutex> lock(mutex_);
  CLAWCOMM_ARG_CHECK(!graphs_.count(s), "clawcomm: this stream is already capturing");
  graphs_[s] = std::make_shared<HostGraph>();
}

std::shared_ptr<HostGraph> HostRuntime::endCapture(Stream s) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = graphs_.find(s);
  CLAWCOMM_ARG_CHECK(it != graphs_.end(), "clawcomm: this stream is not capturing");
  auto graph = std::move(it->second);
  graphs_.erase(it);
  return graph;
}

}  // namespace device
}  // namespace clawcomm
