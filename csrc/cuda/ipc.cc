// The CUDA IPC group (cuda/ipc.h): allocation, handle exchange, the probe,
// and the host side of each collective.
#include "cuda/ipc.h"

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "common/errors.h"
#include "cuda/check.h"
#include "cuda/ipc_kernels.h"

namespace clawcomm {
namespace cuda {
namespace {

constexpr size_t kSignalBytes = (sizeof(IpcSignals) + 4095) & ~size_t(4095);

std::vector<uint8_t> bytesOf(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

std::vector<uint8_t> text(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

uint32_t probeValue(int from, int to) {
  return 0xC1A00000u | uint32_t(from) << 8 | uint32_t(to);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

class Group final : public IpcGroup {
 public:
  Group(Store& store, const std::string& prefix, int rank, int size, size_t bytes,
        int64_t timeoutNs)
      : prefix_(prefix), capacity_((bytes + 255) & ~size_t(255)) {
    const Clock::time_point deadline = Clock::now() + std::chrono::nanoseconds(timeoutNs);
    CLAWCOMM_ARG_CHECK(size >= 1 && size <= kIpcMaxRanks, "clawcomm: CUDA IPC groups hold up to ",
                       kIpcMaxRanks, " ranks, not ", size);
    peers_ = {};
    peers_.rank = rank;
    peers_.size = size;
    peers_.timeoutNs = uint64_t(timeoutNs);
    CLAWCOMM_CUDA_CHECK(cudaGetDevice(&device_));

    // 1. Our buffer: signals (zeroed before anyone can signal), input, result.
    CLAWCOMM_CUDA_CHECK(cudaMalloc(&base_, kSignalBytes + 2 * capacity_));
    CLAWCOMM_CUDA_CHECK(cudaMemset(base_, 0, kSignalBytes));
    CLAWCOMM_CUDA_CHECK(cudaDeviceSynchronize());
    map(rank, base_);
    cudaIpcMemHandle_t handle;
    CLAWCOMM_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base_));
    store.set(key("handle", rank), bytesOf(&handle, sizeof(handle)));

    // 2. Open every peer's buffer and write our probe value into its mailbox.
    std::string problem;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const std::vector<uint8_t> h = store.get(key("handle", p), deadline);
      CLAWCOMM_CHECK_EQ(h.size(), sizeof(cudaIpcMemHandle_t));
      cudaIpcMemHandle_t theirs;
      std::memcpy(&theirs, h.data(), sizeof(theirs));
      void* ptr = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&ptr, theirs, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();  // clear it: the probe's verdict reports it
        problem += CLAWCOMM_CONCAT("rank ", rank, " cannot open rank ", p,
                                   "'s buffer: ", cudaGetErrorString(e), "; ");
        continue;
      }
      opened_.push_back(ptr);
      map(p, static_cast<char*>(ptr));
      const uint32_t v = probeValue(rank, p);
      if (cudaMemcpy(&peers_.signals[p]->probe[rank], &v, sizeof(v), cudaMemcpyHostToDevice) !=
          cudaSuccess) {
        cudaGetLastError();
        problem += CLAWCOMM_CONCAT("rank ", rank, " cannot write to rank ", p, "'s buffer; ");
      }
    }
    CLAWCOMM_CUDA_CHECK(cudaDeviceSynchronize());
    store.set(key("wrote", rank), text("1"));
    for (int p = 0; p < size; ++p) {
      if (p != rank) store.get(key("wrote", p), deadline);
    }

    // 3. Read our mailbox: every peer's value must have arrived.
    uint32_t got[kIpcMaxRanks] = {0};
    CLAWCOMM_CUDA_CHECK(
        cudaMemcpy(got, peers_.signals[rank]->probe, sizeof(got), cudaMemcpyDeviceToHost));
    for (int p = 0; p < size; ++p) {
      if (p != rank && got[p] != probeValue(p, rank)) {
        problem += CLAWCOMM_CONCAT("rank ", p, "'s write did not reach rank ", rank, "; ");
      }
    }
    store.set(key("verdict", rank), text(problem.empty() ? "ok" : problem));
    for (int p = 0; p < size; ++p) {
      const std::vector<uint8_t> v = p == rank ? text(problem.empty() ? "ok" : problem)
                                               : store.get(key("verdict", p), deadline);
      const std::string s(v.begin(), v.end());
      if (s != "ok") why_ += s;
    }
  }

  ~Group() override {
    for (void* p : opened_) cudaIpcCloseMemHandle(p);
    if (base_) cudaFree(base_);
  }

  bool usable() const override { return why_.empty(); }
  const std::string& whyNot() const override { return why_; }
  size_t capacity() const override { return capacity_; }

  void allReduce(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                 IpcAllReduce algo, Stream stream) override {
    const size_t es = elementSize(type);
    const size_t per = capacity_ / es;
    for (size_t at = 0; at < count; at += per) {
      const size_t n = std::min(per, count - at);
      const char* i = static_cast<const char*>(in) + at * es;
      char* o = static_cast<char*>(out) + at * es;
      const bool direct = aligned16(i) && aligned16(o) && (n * es) % 16 == 0;
      if (!direct) copy(peers_.input[peers_.rank], i, n * es, stream);
      launchAllReduce(peers_, i, o, n, type, op, algo, direct, stream);
      if (!direct) copy(o, peers_.result[peers_.rank], n * es, stream);
    }
  }

  void allGather(const void* in, void* out, size_t countPerRank, DataType type,
                 Stream stream) override {
    const size_t bytes = countPerRank * elementSize(type);
    checkFits("all_gather", roundUp(bytes) * peers_.size);
    const bool direct = aligned16(in) && aligned16(out) && bytes % 16 == 0;
    if (!direct) copy(peers_.input[peers_.rank], in, bytes, stream);
    launchAllGather(peers_, in, out, bytes, direct, stream);
    if (!direct) {
      for (int q = 0; q < peers_.size; ++q) {
        copy(static_cast<char*>(out) + q * bytes, peers_.result[peers_.rank] + q * roundUp(bytes),
             bytes, stream);
      }
    }
  }

  void reduceScatter(const void* in, void* out, size_t countPerRank, DataType type, ReduceOp op,
                     Stream stream) override {
    const size_t bytes = countPerRank * elementSize(type);
    checkFits("reduce_scatter", roundUp(bytes) * peers_.size);
    const bool direct = aligned16(in) && aligned16(out) && bytes % 16 == 0;
    if (!direct) {
      for (int q = 0; q < peers_.size; ++q) {
        copy(peers_.input[peers_.rank] + q * roundUp(bytes),
             static_cast<const char*>(in) + q * bytes, bytes, stream);
      }
    }
    launchReduceScatter(peers_, in, out, countPerRank, type, op, direct, stream);
    if (!direct) copy(out, peers_.result[peers_.rank], bytes, stream);
  }

  void broadcast(void* buf, size_t bytes, int root, Stream stream) override {
    checkFits("broadcast", bytes);
    const bool direct = aligned16(buf) && bytes % 16 == 0;
    if (!direct && peers_.rank == root) copy(peers_.input[root], buf, bytes, stream);
    launchBroadcast(peers_, buf, bytes, root, direct, stream);
    if (!direct && peers_.rank != root) copy(buf, peers_.result[peers_.rank], bytes, stream);
  }

  void allToAll(const void* in, void* out, size_t bytesPerRank, Stream stream) override {
    checkFits("all_to_all", roundUp(bytesPerRank) * peers_.size);
    const bool direct = aligned16(in) && aligned16(out) && bytesPerRank % 16 == 0;
    if (!direct) {
      for (int q = 0; q < peers_.size; ++q) {
        copy(peers_.input[peers_.rank] + q * roundUp(bytesPerRank),
             static_cast<const char*>(in) + q * bytesPerRank, bytesPerRank, stream);
      }
    }
    launchAllToAll(peers_, in, out, bytesPerRank, direct, stream);
    if (!direct) {
      for (int q = 0; q < peers_.size; ++q) {
        copy(static_cast<char*>(out) + q * bytesPerRank,
             peers_.result[peers_.rank] + q * roundUp(bytesPerRank), bytesPerRank, stream);
      }
    }
  }

 private:
  std::string key(const char* what, int rank) const {
    return CLAWCOMM_CONCAT(prefix_, what, "/", rank);
  }
  static size_t roundUp(size_t b) { return (b + 15) & ~size_t(15); }

  void map(int r, char* base) {
    peers_.signals[r] = reinterpret_cast<IpcSignals*>(base);
    peers_.input[r] = base + kSignalBytes;
    peers_.result[r] = base + kSignalBytes + capacity_;
  }

  void checkFits(const char* op, size_t bytes) const {
    CLAWCOMM_ARG_CHECK(bytes <= capacity_, "clawcomm::", op, ": ", bytes,
                       " bytes exceed the CUDA IPC buffer of ", capacity_,
                       " bytes (CLAWCOMM_CUDA_IPC_BYTES)");
  }

  static void copy(void* dst, const void* src, size_t bytes, Stream stream) {
    if (bytes) {
      CLAWCOMM_CUDA_CHECK(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, asStream(stream)));
    }
  }

  std::string prefix_;
  size_t capacity_;
  int device_ = 0;
  char* base_ = nullptr;
  std::vector<void*> opened_;
  IpcPeers peers_;
  std::string why_;
};

}  // namespace

std::unique_ptr<IpcGroup> IpcGroup::create(Store& store, const std::string& prefix, int rank,
                                           int size, size_t bytes, int64_t timeoutNs) {
  return std::make_unique<Group>(store, prefix, rank, size, bytes, timeoutNs);
}

bool built() {
  return true;
}

}  // namespace cuda
}  // namespace clawcomm
