// The adapter's Work types and the CUDA staging (included by
// process_group.cc alone): ClawcommWork completes with the engine, its
// CUDA-aware future after the copy back to the device; CoalescedWork joins
// several. (A CUDA IPC call's Work is torch/device_path.h's DeviceWork.)
#pragma once

#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <mutex>

#include "torch/adapter_helpers.h"

namespace clawcomm {
namespace adapter {

// ---------------------------------------------------------------------------
// CUDA tensors through pinned host memory.
//
// The engine moves host bytes, so a CUDA tensor is staged, as
// ProcessGroupGloo does: c10d's stream rules are kept with events only,
// through c10's device-generic interfaces, so this file builds against a CPU
// torch as well (where no CUDA tensor can reach it).
//   1. On the caller's thread: each engine buffer the op reads is copied
//      into a pinned host mirror on the caller's current stream, so it
//      follows the kernels that produced it; the thread waits for those
//      copies (an event), then queues the engine op on the mirrors.
//   2. On the progress thread, when the engine is done: the communicator's
//      own stream waits for the caller's stream, copies every mirror the op
//      wrote back to the device, and runs the op's device-side finalize
//      (split, copy back) there; the device buffers are recorded on that
//      stream for the caching allocator.
//   3. The future is CUDA-aware: completed on the communicator's stream, it
//      carries an event, and Work::wait() or future.wait() make the
//      caller's current stream wait for it.

enum class Access { kRead, kWrite, kReadWrite };

// A tensor the engine reads or writes, as passed to launch().
struct EngineBuffer {
  at::Tensor* tensor;
  Access access;
};
inline EngineBuffer reads(at::Tensor& t) {
  return {&t, Access::kRead};
}
inline EngineBuffer writes(at::Tensor& t) {
  return {&t, Access::kWrite};
}
inline EngineBuffer updates(at::Tensor& t) {
  return {&t, Access::kReadWrite};
}

class DeviceStaging {
 public:
  DeviceStaging(c10::Device device, c10::Stream stream)
      : device_(device), stream_(stream), ready_(device.type()) {}

  const c10::Stream& stream() const { return stream_; }

  // The pinned host buffer the engine works on instead of `dev`.
  at::Tensor mirror(const at::Tensor& dev, Access access) {
    at::Tensor host = at::empty(dev.sizes(), dev.options().device(at::kCPU).pinned_memory(true));
    if (access != Access::kWrite) host.copy_(dev, /*non_blocking=*/true);
    if (access != Access::kRead) writeBack_.push_back({host, dev});
    touched_.push_back(dev);
    return host;
  }

  // Keeps `t` (an output) safe from the caching allocator until the
  // communicator's stream is done with it.
  void touches(const at::Tensor& t) { touched_.push_back(t); }

  // Step 1: the caller's stream has issued every copy to host; wait for them.
  void fetch() {
    c10::impl::VirtualGuardImpl impl(device_.type());
    ready_.record(impl.getStream(device_));
    ready_.synchronize();
  }

  // Step 2, on the progress thread, inside a StreamGuard on stream().
  void store() {
    ready_.block(stream_);
    for (auto& [host, dev] : writeBack_) dev.copy_(host, /*non_blocking=*/true);
  }

  // After the device-side finalize, still on stream().
  void release() {
    c10::impl::VirtualGuardImpl impl(device_.type());
    for (const auto& t : touched_) {
      if (t.defined() && t.device() == device_) {
        impl.recordDataPtrOnStream(t.storage().data_ptr(), stream_);
      }
    }
    touched_.clear();
    writeBack_.clear();
  }

 private:
  c10::Device device_;
  c10::Stream stream_;
  c10::Event ready_;
  std::vector<std::pair<at::Tensor, at::Tensor>> writeBack_;  // (host mirror, device buffer)
  TensorList touched_;
};

// ---------------------------------------------------------------------------
// Work.

inline c10::intrusive_ptr<c10::ivalue::Future> makeFuture(std::vector<c10::Device> devices = {}) {
  static const c10::TypePtr kTensors = c10::ListType::create(c10::TensorType::get());  // one type
  return c10::make_intrusive<c10::ivalue::Future>(kTensors, std::move(devices));
}

// What completes when the engine finishes: shared by the Work and the engine
// callback, so that neither keeps the other alive.
//
// The future: a CUDA op's is made at launch (it completes on the
// communicator's stream, with an event); a CPU op's only when someone asks
// for it (getFuture), completed at once if the op is done by then. A
// blocking CPU call that nobody asks the future of never makes one: making,
// completing and freeing it was a fifth of the adapter's instructions per
// small call (callgrind, issue 62).
struct Completion {
  TensorList outputs;                      // what the future yields
  std::function<void()> finalize;          // copies results back into the caller's tensors
  TensorList keepAlive;                    // staging buffers the engine reads or writes
  std::function<void()> profilingEnd;      // closes the op's torch.profiler span
  std::shared_ptr<DeviceStaging> staging;  // CUDA ops only

  explicit Completion(std::vector<c10::Device> devices) {
    if (!devices.empty()) future_ = makeFuture(std::move(devices));
  }

  // The engine's callback, once: the outcome, and the future completed if
  // one was made.
  void complete(std::exception_ptr error) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = error;
      done_.store(true, std::memory_order_release);
      future = future_;
    }
    if (future) settle(*future);
  }

  bool done() const { return done_.load(std::memory_order_acquire); }

  // The op's error, once it is done (null before, or on success).
  std::exception_ptr error() const {
    if (!done()) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> future() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = makeFuture();
      if (done()) settle(*future_);
    }
    return future_;
  }

 private:
  void settle(c10::ivalue::Future& f) {
    if (error_) {
      f.setError(error_);
    } else {
      f.markCompleted(c10::IValue(outputs));
    }
  }

  mutable std::mutex mutex_;  // future_ (made lazily) and error_
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::exception_ptr error_;
  std::atomic<bool> done_{false};
};

// The span torch.profiler shows for an op ("clawcomm:allreduce"): c10d's
// Work keeps the pointer, so these are string literals.
inline const char* profilingTitle(OpType type) {
  switch (type) {
    case OpType::BROADCAST: return "clawcomm:broadcast";
    case OpType::ALLREDUCE: return "clawcomm:allreduce";
    case OpType::ALLREDUCE_COALESCED: return "clawcomm:allreduce_coalesced";
    case OpType::REDUCE: return "clawcomm:reduce";
    case OpType::ALLGATHER: return "clawcomm:all_gather";
    case OpType::_ALLGATHER_BASE: return "clawcomm:_allgather_base";
    case OpType::ALLGATHER_COALESCED: return "clawcomm:allgather_coalesced";
    case OpType::GATHER: return "clawcomm:gather";
    case OpType::SCATTER: return "clawcomm:scatter";
    case OpType::REDUCE_SCATTER: return "clawcomm:reduce_scatter";
    case OpType::_REDUCE_SCATTER_BASE: return "clawcomm:_reduce_scatter_base";
    case OpType::ALLTOALL_BASE: return "clawcomm:alltoall_base";
    case OpType::ALLTOALL: return "clawcomm:alltoall";
    case OpType::SEND: return "clawcomm:send";
    case OpType::RECV: return "clawcomm:recv";
    case OpType::RECVANYSOURCE: return "clawcomm:recvAnySource";
    case OpType::BARRIER: return "clawcomm:barrier";
    case OpType::COALESCED: return "clawcomm:coalesced";
    default: return "clawcomm:op";
  }
}

// Work::wait(timeout) on an op still running when `timeout` passed (every
// Work of the adapter says it so).
[[noreturn]] inline void throwWaitTimedOut(std::chrono::milliseconds timeout) {
  C10_THROW_ERROR(DistBackendError,
                  c10::str("clawcomm: Work::wait timed out after ", timeout.count(),
                           " ms; the operation is still running"));
}

class ClawcommWork : public c10d::Work {
 public:
  // With torch.profiler on (`profiled`: at::hasCallbacks()), c10d's Work
  // opens a span titled profilingTitle(type) here; profilingEnd() closes it
  // when the engine is done. (Without a profiler's callbacks there is no
  // span to open: c10d's Work would still build a RecordFunction and copy
  // the inputs to find that out.)
  ClawcommWork(int rank, OpType type, std::shared_ptr<Completion> completion,
               const TensorList& inputs, bool profiled)
      : Work(rank, type, profiled ? profilingTitle(type) : nullptr,
             profiled ? std::optional<TensorList>(inputs) : std::nullopt),
        completion_(std::move(completion)) {}

  // The profiler's end-of-span callback (empty when not profiling), handed
  // to the engine's completion callback.
  std::function<void()> takeProfilingEnd() { return std::move(recordFunctionEndCallback_); }

  void attach(RequestPtr request) { request_ = std::move(request); }
  // A send or receive: wait() first lets the engine drive it on the
  // waiting thread (Communicator::drive).
  void drivenBy(std::weak_ptr<Communicator> comm) { driver_ = std::move(comm); }

  // The completion is recorded inside the engine's completion callback, where
  // the request is already done (comm/request.h: its callbacks may ask, and
  // wait); other threads see the request done a moment after the completion:
  // a completed Completion (and its future) is a completed Work.
  bool isCompleted() override { return isDone(); }
  bool isSuccess() const override { return isDone() && !exception(); }
  std::exception_ptr exception() const override {
    if (auto e = completion_->error()) return e;
    return request_->exception();
  }
  int sourceRank() const override { return request_->sourceRank(); }
  std::vector<at::Tensor> result() override { return completion_->outputs; }
  void synchronize() override {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (auto comm = driver_.lock()) {
      comm->drive(*request_,
                  timeout == kNoTimeout ? Clock::time_point::max() : Clock::now() + timeout);
    }
    const bool done =
        request_->waitFor(timeout == kNoTimeout ? std::chrono::milliseconds(-1) : timeout);
    if (!done) throwWaitTimedOut(timeout);
    if (auto e = request_->exception()) rethrowForTorch(e);
    // CUDA: the caller's current stream waits for the copies back to the
    // device (an event on the communicator's stream); the host does not.
    if (completion_->staging) completion_->future()->wait();
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return completion_->future(); }

 private:
  bool isDone() const { return request_->isCompleted() || completion_->done(); }

  std::shared_ptr<Completion> completion_;
  RequestPtr request_;
  std::weak_ptr<Communicator> driver_;
};

// A blocking CPU call's Work (async_op=False, outside a coalesced group,
// not profiled), made once the operation has ended: the caller waited for
// it inside the call (the engine ran it inline, or launch() waited). It
// holds the outcome and nothing shared: no request, no Completion, and no
// future until one is asked for. torch's Python API waits on it and drops
// it without handing it out, and drops it without the GIL, so its outputs
// are held weakly: dropping the last C++ reference to a tensor that has a
// Python object takes the GIL back (c10's PyObject preservation), a fifth
// of a small call's instructions (issue 62). result() and the future give
// the output tensors that are still alive elsewhere (undefined ones if the
// caller has dropped them meanwhile).
class FinishedWork : public c10d::Work {
 public:
  FinishedWork(int rank, OpType type, c10::ArrayRef<at::Tensor> outputs, std::exception_ptr error,
               int source)
      : Work(rank, type), error_(std::move(error)), source_(source) {
    for (const auto& t : outputs) outputs_.emplace_back(t.getIntrusivePtr());
  }

  bool isCompleted() override { return true; }
  bool isSuccess() const override { return !error_; }
  std::exception_ptr exception() const override { return error_; }
  int sourceRank() const override { return source_; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (const auto& w : outputs_) {
      auto strong = w.lock();
      out.push_back(strong ? at::Tensor(std::move(strong)) : at::Tensor());
    }
    return out;
  }
  bool wait(std::chrono::milliseconds) override {
    if (error_) rethrowForTorch(error_);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = makeFuture();
    if (error_) {
      future->setError(error_);
    } else {
      future->markCompleted(c10::IValue(result()));
    }
    return future;
  }

 private:
  std::exception_ptr error_;
  int source_;
  c10::SmallVector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>, 1> outputs_;
};

// Completes when every child does (coalesced point-to-point and collectives).
class CoalescedWork : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> children)
      : Work(rank, OpType::COALESCED), children_(std::move(children)), future_(makeFuture()) {
    if (children_.empty()) {
      future_->markCompleted(c10::IValue(TensorList{}));
      return;
    }
    auto remaining = std::make_shared<std::atomic<size_t>>(children_.size());
    auto future = future_;
    for (auto& child : children_) {
      child->getFuture()->addCallback([remaining, future](c10::ivalue::Future& f) {
        if (f.hasError()) {
          if (!future->completed()) future->setErrorIfNeeded(f.exception_ptr());
        } else if (--*remaining == 0 && !future->completed()) {
          future->markCompleted(c10::IValue(TensorList{}));
        }
      });
    }
  }

  bool isCompleted() override {
    for (auto& c : children_) {
      if (!c->isCompleted()) return false;
    }
    return true;
  }
  bool isSuccess() const override {
    for (auto& c : children_) {
      if (!c->isSuccess()) return false;
    }
    return true;
  }
  std::exception_ptr exception() const override {
    for (auto& c : children_) {
      if (auto e = c->exception()) return e;
    }
    return nullptr;
  }
  // One timeout for all the children, not one each; throws when it passes.
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == kNoTimeout) {
      for (auto& c : children_) c->wait(timeout);
      return true;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& c : children_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      // kNoTimeout is 0 ms: what is left is never less than 1 ms.
      c->wait(std::max(left, std::chrono::milliseconds(1)));
    }
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> children_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace adapter
}  // namespace clawcomm
