// ClawcommBackend: the c10d::Backend over clawcomm::Communicator. Each
// override checks its tensors (one shared set of helpers, every message
// naming the op), lays them out as flat contiguous buffers (staging copies
// for non-contiguous or list arguments, pinned host mirrors for CUDA
// tensors), queues one engine operation (launch) and returns a Work whose
// future completes on the engine's progress thread, after the results have
// been copied back into the caller's tensors. Eligible CUDA collectives on
// one host go through CUDA IPC kernels on the communicator's stream instead
// (device_path.h).
//
// The collectives are defined in collectives.cc; the rest (construction,
// coalescing, send/recv, barrier, launch) here; the Python module in
// process_group.cc.
#pragma once

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <utility>

#include "python/gil.h"
#include "torch/adapter_helpers.h"
#include "torch/device_path.h"
#include "torch/work.h"

namespace clawcomm {
namespace adapter {

// The backend's options: torch's own, copyable. split_group deep-copies the
// parent's options when it is given none, and c10d's base class cannot be.
struct ClawcommOptions : c10d::Backend::Options {
  explicit ClawcommOptions(std::chrono::milliseconds timeout, int progressNice = -1)
      : Options("clawcomm", timeout), progressNice(progressNice) {}
  // The nice value of this group's progress thread (CLAWCOMM_PROGRESS_NICE
  // for this group alone); -1: the environment's. A pipeline's group wants
  // 0: its sends are on the critical path, and a niced thread waits for the
  // sender's compute to end its time slice before it moves them.
  int progressNice = -1;
};

class ClawcommBackend : public c10d::Backend {
 public:
  ClawcommBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout, int progressNice = -1)
      : Backend(rank, size) {
    try {
      Settings settings = Settings::fromEnv();
      if (progressNice > 19 || progressNice < -1) {
        throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: progress_nice ", progressNice,
                                              " is not a nice value in [0, 19]"));
      }
      if (progressNice >= 0) settings.progressNice = progressNice;
      store_ = std::make_shared<StoreAdapter>(store);
      comm_ = Communicator::create(store_, rank, size, timeout, settings);
      device_ = std::make_unique<DevicePath>(comm_, rank);
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
  }

  // A group split from another (split()), over its own communicator.
  ClawcommBackend(std::shared_ptr<StoreAdapter> store, std::shared_ptr<Communicator> comm)
      : Backend(comm->rank(), comm->size()), store_(std::move(store)), comm_(std::move(comm)) {
    device_ = std::make_unique<DevicePath>(comm_, getRank());
  }

  // torch may destroy a backend from Python, holding the GIL: the device
  // calls and the communicator go without it (python/gil.h says why).
  ~ClawcommBackend() override {
    releaseWithoutGil(device_);
    releaseWithoutGil(comm_);
  }

  const std::string getBackendName() const override { return "clawcomm"; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override { comm_->setTimeout(timeout); }
  // torch's _abort_process_group() and elastic agents: from any thread,
  // fails what is pending (through the Works' futures) and tells the peers.
  void abort() override { comm_->abort("abort() was called on its process group"); }
  // Collectives are numbered from 0 in issue order on every rank, so the
  // group's sequence number needs no agreement step.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return comm_->collectivesIssued(); }
  Communicator& communicator() { return *comm_; }
  // The job's rank of each rank of this group (torch's
  // global_ranks_in_group), for errors and flight records.
  void setGlobalRanks(std::vector<int> ranks) { comm_->setGlobalRanks(std::move(ranks)); }

  // torch's split_group (ProcessGroup::splitGroup): every rank of this group
  // calls it, each with the ranks of the group it joins (or of another, if
  // it joins none: then it returns null). The new group is set up over this
  // one's connections, without the store (Communicator::split); `store`
  // keys its later setups (the CUDA IPC group's).
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    const auto it = std::find(ranks.begin(), ranks.end(), getRank());
    const bool member = it != ranks.end();
    Communicator::SplitOptions options;
    if (opts) options.timeout = opts->timeout;
    std::shared_ptr<StoreAdapter> childStore;
    if (member) {
      childStore = std::make_shared<StoreAdapter>(store);
      options.store = childStore;
      options.members = ranks;
    }
    // Ranks of one group agree on its color: the smallest of its ranks.
    const int color =
        member ? *std::min_element(ranks.begin(), ranks.end()) : Communicator::kNoColor;
    std::shared_ptr<Communicator> child;
    try {
      // It blocks on the other ranks: without the GIL, if torch's binding
      // called it with it.
      std::optional<pybind11::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil.emplace();
      child = comm_->split(color, int(it - ranks.begin()), options);
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
    if (!child) return nullptr;
    return c10::make_intrusive<ClawcommBackend>(std::move(childStore), std::move(child));
  }
  // torch's shrink_group: only the ranks that stay call it, each with the
  // same ranks to exclude, which may be dead or stuck in a collective;
  // SHRINK_ABORT (1) aborts this group first, failing what it has in
  // flight. The new group connects afresh through the store
  // (Communicator::shrink); torch then destroys this one. `opts` may set
  // the new group's timeout; it keeps this one's settings otherwise.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude,
                                           int shrinkFlags,
                                           const c10::intrusive_ptr<Options>& opts) override {
    constexpr int kShrinkAbort = 0x01;  // torch.distributed.SHRINK_ABORT
    std::shared_ptr<Communicator> child;
    try {
      if (shrinkFlags & ~kShrinkAbort) {
        throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: shrink: unknown shrink_flags ",
                                              shrinkFlags,
                                              " (SHRINK_DEFAULT 0 or SHRINK_ABORT 1)"));
      }
      Communicator::ShrinkOptions options;
      options.abortFirst = (shrinkFlags & kShrinkAbort) != 0;
      if (opts) options.timeout = opts->timeout;
      const std::vector<int> excluded(ranksToExclude.begin(), ranksToExclude.end());
      // It blocks on the other survivors: without the GIL.
      std::optional<pybind11::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil.emplace();
      child = comm_->shrink(excluded, options);
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
    return c10::make_intrusive<ClawcommBackend>(store_, std::move(child));
  }
  // torch's memory_stats, suspend and resume (Communicator::memoryStats,
  // suspend: every rank suspends, with nothing in flight; the CUDA IPC
  // buffers stay).
  std::unordered_map<std::string, uint64_t> getMemoryStats() override {
    const Communicator::MemoryStats m = comm_->memoryStats();
    return {{"shm_ring_bytes", m.ringBytes},
            {"shm_ring_resident_bytes", m.ringResidentBytes},
            {"scratch_bytes", m.scratchBytes},
            {"device_ipc_bytes", uint64_t(m.deviceIpcBytes)},
            {"suspended", m.suspended ? 1 : 0}};
  }
  void suspend() override {
    try {
      std::optional<pybind11::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil.emplace();
      comm_->suspend();
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
  }
  void resume() override {
    try {
      comm_->resume();
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
  }
  // torch's _time_estimator: between the two calls the group's collectives
  // and sends move nothing; the second returns the cost model's time for
  // them, in microseconds (as NCCL's simulated groups give it).
  bool supportsTimeEstimation() const override { return true; }
  void startTimeEstimate() { comm_->startEstimate(); }
  float endTimeEstimate() {
    try {
      return float(comm_->endEstimate() * 1e6);
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
  }
  // What split_group copies when it is given no options: the name, the
  // timeout and the progress thread's nice value.
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<ClawcommOptions>(comm_->timeout(), comm_->settings().progressNice);
  }
  // Per CUDA device used so far: "ok" where collectives go through CUDA
  // IPC, else why not (they are staged through host memory).
  std::map<int, std::string> cudaIpcStatus() const { return device_->status(); }
  std::shared_ptr<Communicator> sharedCommunicator() { return comm_; }

  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "clawcomm: startCoalescing called twice without endCoalescing");
    coalescing_ = true;
    coalesced_.clear();
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "clawcomm: endCoalescing without startCoalescing");
    coalescing_ = false;
    return c10::make_intrusive<CoalescedWork>(getRank(), std::move(coalesced_));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(TensorList& tensors,
                                           const c10d::AllreduceOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> allreduceSparse(at::Tensor& t, const c10d::AllreduceOptions& opts);

  // Waits for an engine operation issued on this thread (setup steps of
  // composite ops); its errors become torch's.
  static void blockOn(const RequestPtr& request) {
    request->waitFor(std::chrono::milliseconds(-1));
    if (auto error = request->exception()) rethrowForTorch(error);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      TensorList& tensors, const c10d::AllreduceCoalescedOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> reduce(TensorList& tensors,
                                        const c10d::ReduceOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> broadcast(TensorList& tensors,
                                           const c10d::BroadcastOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<TensorList>& outputs, TensorList& inputs,
                                           const c10d::AllgatherOptions&) override;

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      TensorList& outputs, TensorList& inputs, const c10d::AllgatherOptions&) override;

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<TensorList>& outputLists,
                                                     TensorList& inputs,
                                                     const c10d::AllgatherOptions&) override;

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<TensorList>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      TensorList& outputs, TensorList& inputs, const c10d::ReduceScatterOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> alltoall(TensorList& outputs, TensorList& inputs,
                                          const c10d::AllToAllOptions&) override;

  c10::intrusive_ptr<c10d::Work> gather(std::vector<TensorList>& outputs, TensorList& inputs,
                                        const c10d::GatherOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> scatter(TensorList& outputs, std::vector<TensorList>& inputs,
                                         const c10d::ScatterOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> send(TensorList& tensors, int dstRank, int tag) override {
    const char* op = "send";
    checkTensors(op, tensors);
    const at::Tensor& t = single(op, tensors);
    if (auto work = device_->send(t, dstRank, uint64_t(tag))) return track(work);
    at::Tensor buf = asBuffer(t);
    return launch(OpType::SEND, {t}, {reads(buf)}, nullptr, [&](auto cb) {
      return comm_->send(buf.data_ptr(), size_t(buf.nbytes()), dstRank, uint64_t(tag), cb);
    });
  }

  c10::intrusive_ptr<c10d::Work> recv(TensorList& tensors, int srcRank, int tag) override {
    return receive("recv", OpType::RECV, tensors, srcRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(TensorList& tensors, int tag) override {
    return receive("recv_anysource", OpType::RECVANYSOURCE, tensors, -1, tag);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return launch(OpType::BARRIER, {}, {}, nullptr, [&](auto cb) { return comm_->barrier(cb); });
  }

  // torch's monitored barrier (ProcessGroup.monitored_barrier; the Python
  // dist.monitored_barrier admits gloo alone, by name): a barrier under
  // `opts.timeout` whose failure names, on every rank, each rank that did
  // not come and where it is (comm/culprit.h). Every such rank is named, so
  // waitAllRanks changes nothing. As any timeout here, it ends the group.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool /*waitAllRanks*/) override {
    const std::chrono::milliseconds saved = comm_->timeout();
    if (opts.timeout != c10d::kUnsetTimeout) comm_->setTimeout(opts.timeout);
    try {
      barrier(opts)->wait();
    } catch (...) {
      comm_->setTimeout(saved);
      throw;
    }
    comm_->setTimeout(saved);
  }

 private:
  static std::function<void()> copyBack(const at::Tensor& buf, const at::Tensor& target) {
    if (buf.is_same(target)) return nullptr;  // asBuffer() gave the tensor itself
    if (buf.data_ptr() == target.data_ptr() && target.is_contiguous()) return nullptr;
    return [buf, target] { target.copy_(buf.view(target.sizes())); };
  }

  c10::intrusive_ptr<c10d::Work> receive(const char* op, OpType type, TensorList& tensors,
                                         int srcRank, int tag) {
    checkTensors(op, tensors);
    const at::Tensor& t = single(op, tensors);
    if (srcRank >= 0) {
      if (auto work = device_->recv(t, srcRank, uint64_t(tag))) return track(work);
    }
    at::Tensor buf = asBuffer(t);
    return launch(type, {t}, {writes(buf)}, copyBack(buf, t), [&](auto cb) {
      return comm_->recv(buf.data_ptr(), size_t(buf.nbytes()), srcRank, uint64_t(tag), cb);
    });
  }

  // The root as an int, checked before narrowing: torch passes an int64,
  // and 2**32 + 1 must not become rank 1.
  int rootOf(const char* op, int64_t root) const {
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "clawcomm::", op, ": root ", root,
                      " is out of range for a group of ", getSize(), " ranks");
    return int(root);
  }

  // Coalescing collects the Works issued meanwhile.
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> work) {
    if (coalescing_) coalesced_.push_back(work);
    return work;
  }

  // The caller waits for the operation it issues now (async_op=False): a
  // CPU collective may then run on its thread (Communicator::Blocking).
  template <typename Opts>
  static Communicator::Blocking blockingIf(const Opts& opts) {
    return Communicator::Blocking(!isAsync(opts));
  }

  // Queues one engine operation. `outputs` is what the future yields,
  // `buffers` the tensors the engine reads and writes (replaced by pinned
  // host mirrors when they live on a GPU: the `issue` callback reads them
  // after that), `finalize` runs on success before the future completes.
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> launch(OpType type, c10::ArrayRef<at::Tensor> outputs,
                                        c10::ArrayRef<EngineBuffer> buffers,
                                        std::function<void()> finalize, Issue issue) {
    std::vector<c10::Device> devices;
    for (const auto& b : buffers) {
      if (b.tensor->device().is_cuda()) {
        devices = {b.tensor->device()};
        break;
      }
    }
    if (comm_->estimating()) {
      // torch's _time_estimator: the engine prices the call, moves nothing
      // and completes it; no staging, and nothing is written back.
      std::function<void()> none;
      return launchBlocking(type, outputs, none, issue);
    }
    const bool profiled = at::hasCallbacks();
    if (devices.empty() && !coalescing_ && !profiled && Communicator::Blocking::active()) {
      return launchBlocking(type, outputs, finalize, issue);
    }
    auto completion = std::make_shared<Completion>(devices);
    // Inline only on the CPU and outside a coalesced group: a staged CUDA
    // collective leaves the host free while it runs, as before.
    const Communicator::Blocking blocking(Communicator::Blocking::active() && devices.empty() &&
                                          !coalescing_);
    if (!devices.empty()) {
      auto staging = std::make_shared<DeviceStaging>(devices[0], device_->streamFor(devices[0]));
      for (const auto& b : buffers) *b.tensor = staging->mirror(*b.tensor, b.access);
      for (const auto& t : outputs) staging->touches(t);
      staging->fetch();
      completion->staging = std::move(staging);
    }
    completion->outputs = outputs.vec();
    for (const auto& b : buffers) completion->keepAlive.push_back(*b.tensor);
    completion->finalize = std::move(finalize);
    auto work = c10::make_intrusive<ClawcommWork>(getRank(), type, completion, completion->outputs,
                                                  profiled);
    completion->profilingEnd = work->takeProfilingEnd();
    Request::Callback cb = [completion](std::exception_ptr error) {
      // Often on the progress thread, whose grad mode is its own: copies into
      // the caller's tensors (leaves that require grad among them, written
      // under the caller's no_grad) must never go through autograd.
      const at::NoGradGuard noGrad;
      std::optional<c10::StreamGuard> onStream;
      if (completion->staging) onStream.emplace(completion->staging->stream());
      try {
        if (!error && completion->staging) completion->staging->store();
        if (!error && completion->finalize) completion->finalize();
      } catch (...) {
        error = std::current_exception();
      }
      if (completion->staging) completion->staging->release();
      completion->keepAlive.clear();
      if (completion->profilingEnd) std::exchange(completion->profilingEnd, nullptr)();
      completion->complete(error);
      if (error) std::rethrow_exception(error);
    };
    try {
      work->attach(issue(std::move(cb)));
      const bool pointToPoint =
          type == OpType::SEND || type == OpType::RECV || type == OpType::RECVANYSOURCE;
      if (pointToPoint && devices.empty()) work->drivenBy(comm_);
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
    if (coalescing_) coalesced_.push_back(work);
    return work;
  }

  // launch() for a blocking CPU call outside a coalesced group, with no
  // profiler: the caller waits for it before it looks at the Work, so it
  // is waited for here (it has usually run inline already: a small one
  // always does when nothing is queued ahead of it), and its Work is made
  // with the outcome (FinishedWork). Nothing outlives the call but that
  // Work: the engine's callback captures one pointer into this frame, which
  // std::function keeps without an allocation, and the buffers stay the
  // caller's. A small call used to allocate a Completion, two callbacks'
  // captures and a future, and to free its tensors under the GIL when its
  // Work went (issue 62).
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> launchBlocking(OpType type, c10::ArrayRef<at::Tensor> outputs,
                                                std::function<void()>& finalize, Issue& issue) {
    Request::Callback cb = [&finalize](std::exception_ptr error) {
      if (error || !finalize) return;
      // No autograd on the copies into the caller's tensors (launch() says why).
      const at::NoGradGuard noGrad;
      finalize();  // a throw becomes the operation's error (comm/request.h)
    };
    RequestPtr request;
    try {
      request = issue(std::move(cb));
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
    std::exception_ptr error;
    int source = -1;
    if (!request->completedWith(error, source)) {
      // Queued behind other work: wait without the GIL, which that work's
      // completions may need (torch's binding has released it already).
      std::optional<pybind11::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil.emplace();
      request->waitFor(std::chrono::milliseconds(-1));
      request->completedWith(error, source);
    }
    return c10::make_intrusive<FinishedWork>(getRank(), type, outputs, std::move(error), source);
  }

  std::shared_ptr<StoreAdapter> store_;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<DevicePath> device_;  // after comm_: destroyed before it
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
};

}  // namespace adapter
}  // namespace clawcomm
