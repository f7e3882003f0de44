// The adapter's CUDA IPC path (included by process_group.cc alone): c10d's
// stream rules around device::DeviceComm, which owns the device collectives
// (routing, sequence numbers, flight record, bytes, abort; see
// device/device_comm.h).
//
//   1. Routing is DeviceComm's, from what every rank shares. A tensor's own
//      layout never decides it: a non-contiguous tensor goes through a
//      contiguous copy made on the caller's stream and copied back after.
//   2. An asynchronous call (async_op=True) waits for the caller's current
//      stream and runs on the communicator's stream for the device, and
//      every tensor it touches is recorded on that stream for the caching
//      allocator. A synchronous one (async_op=False: the caller waits for
//      it at once), and one issued while the caller's stream is being
//      captured into a CUDA graph, run on the caller's stream itself, as
//      NCCL does: no events between streams, no allocator records.
//      Sends and receives through CUDA IPC (CLAWCOMM_CUDA_P2P_BYTES) run on a
//      stream of their own for each peer and direction, so a receive that
//      waits for its message never holds up a send, nor a message from
//      another rank.
//   3. Work::wait() makes the caller's current stream wait (the host does
//      not; nothing to do when the call ran on that stream), and with a
//      timeout the host too, at most that long; synchronize() makes the
//      host wait. Both, and isSuccess() and
//      exception(), report a launch that gave up (a timeout, an abort) as
//      an error, and abort the communicator so every rank learns.
#pragma once

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include "cuda/kernels.h"
#include "device/device_comm.h"
#include "torch/adapter_helpers.h"
#include "torch/work.h"

namespace clawcomm {
namespace adapter {

class DeviceWork : public c10d::Work {
 public:
  // Made before its launch, so that torch.profiler's span for the op
  // ("clawcomm:allreduce", as the CPU path's ClawcommWork opens it) covers
  // it; attach() hands it the launch's ticket.
  DeviceWork(int rank, OpType type, TensorList outputs, c10::Device device, c10::Stream ranOn)
      : DeviceWork(rank, type, std::move(outputs), device, ranOn, at::hasCallbacks()) {}

  // The launch was issued: the span ends here, as ProcessGroupNCCL's does
  // (its future completes once the kernels are queued); the GPU's time is
  // the kernels' own in the trace.
  void attach(device::TicketPtr ticket) {
    ticket_ = std::move(ticket);
    if (recordFunctionEndCallback_) std::exchange(recordFunctionEndCallback_, nullptr)();
  }

  bool isCompleted() override { return ticket_->done(); }
  bool isSuccess() const override { return !ticket_->error(); }
  std::exception_ptr exception() const override { return ticket_->error(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  void synchronize() override {
    ticket_->waitHost();
    throwIfFailed();
  }
  // Makes the caller's current stream wait (the host does not). With a
  // timeout, the host also waits, at most that long, as the CPU path's
  // Work and ProcessGroupNCCL's do, and an op still running then is an
  // error.
  bool wait(std::chrono::milliseconds timeout) override {
    ticket_->start();  // a receive through the rings launches when it is needed
    throwIfFailed();
    if (timeout != kNoTimeout && !ticket_->waitHostFor(timeout)) throwWaitTimedOut(timeout);
    throwIfFailed();
    c10::impl::VirtualGuardImpl impl(device_.type());
    const c10::Stream current = impl.getStream(device_);
    if (current != ranOn_) ticket_->waitOn(current.native_handle());
    return true;
  }
  // Made on demand: most callers wait() and never ask, and a CUDA-aware
  // future records an event of its own.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (!future_) {
      ticket_->start();
      future_ = makeFuture({device_});
      if (auto e = ticket_->error()) {
        future_->setError(e);
      } else {
        c10::StreamGuard onStream(ranOn_);
        future_->markCompleted(c10::IValue(outputs_));
      }
    }
    return future_;
  }

 private:
  void throwIfFailed() const {
    if (auto e = ticket_->error()) rethrowForTorch(e);
  }

  DeviceWork(int rank, OpType type, TensorList outputs, c10::Device device, c10::Stream ranOn,
             bool profiled)
      : Work(rank, type, profiled ? profilingTitle(type) : nullptr,
             profiled ? std::optional<TensorList>(outputs) : std::nullopt),
        outputs_(std::move(outputs)),
        device_(device),
        ranOn_(ranOn) {}

  TensorList outputs_;
  device::TicketPtr ticket_;
  c10::Device device_;
  c10::Stream ranOn_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class DevicePath {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  DevicePath(std::shared_ptr<Communicator> comm, int rank) : comm_(std::move(comm)), rank_(rank) {}

  // Each returns the Work of a call that goes through CUDA IPC, or null
  // where the caller must stage it through host memory. The tensors are
  // checked (dtype, device, sizes) by the caller.
  WorkPtr allReduce(const at::Tensor& t, DataType dt, ReduceOp op, bool async) {
    Route r = route(t, OpType::ALLREDUCE, size_t(t.nbytes()), async);
    if (!r.dev) return {};
    at::Tensor buf = t.contiguous();
    return launch(r, OpType::ALLREDUCE, {t}, {buf}, copiesBack(buf, t), [&](auto s) {
      return r.dev->allReduce(buf.data_ptr(), size_t(buf.numel()), dt, op, s);
    });
  }
  WorkPtr broadcast(const at::Tensor& t, DataType dt, int root, bool async) {
    Route r = route(t, OpType::BROADCAST, size_t(t.nbytes()), async);
    if (!r.dev) return {};
    at::Tensor buf = t.contiguous();
    return launch(r, OpType::BROADCAST, {t}, {buf}, copiesBack(buf, t), [&](auto s) {
      return r.dev->broadcast(buf.data_ptr(), size_t(buf.numel()), dt, root, s);
    });
  }
  WorkPtr allGather(const at::Tensor& out, const at::Tensor& in, DataType dt, bool async) {
    Route r = route(out, OpType::_ALLGATHER_BASE, size_t(in.nbytes()), async);
    if (!r.dev) return {};
    at::Tensor src = in.contiguous(), dst = contiguousOutput(out);
    return launch(r, OpType::_ALLGATHER_BASE, {out}, {src, dst}, copiesBack(dst, out), [&](auto s) {
      return r.dev->allGather(src.data_ptr(), dst.data_ptr(), size_t(src.numel()), dt, s);
    });
  }
  WorkPtr reduceScatter(const at::Tensor& out, const at::Tensor& in, DataType dt, ReduceOp op,
                        bool async) {
    Route r = route(out, OpType::_REDUCE_SCATTER_BASE, size_t(out.nbytes()), async);
    if (!r.dev) return {};
    at::Tensor src = in.contiguous(), dst = contiguousOutput(out);
    return launch(r, OpType::_REDUCE_SCATTER_BASE, {out}, {src, dst}, copiesBack(dst, out),
                  [&](auto s) {
                    return r.dev->reduceScatter(src.data_ptr(), dst.data_ptr(), size_t(dst.numel()),
                                                dt, op, s);
                  });
  }
  // Even splits only (the caller stages uneven ones).
  WorkPtr allToAll(const at::Tensor& out, const at::Tensor& in, DataType dt, bool async) {
    const size_t n = size_t(comm_->size());
    Route r = route(out, OpType::ALLTOALL_BASE, size_t(in.nbytes()) / n, async);
    if (!r.dev) return {};
    at::Tensor src = in.contiguous(), dst = contiguousOutput(out);
    return launch(r, OpType::ALLTOALL_BASE, {out}, {src, dst}, copiesBack(dst, out), [&](auto s) {
      return r.dev->allToAll(src.data_ptr(), dst.data_ptr(), size_t(src.numel()) / n, dt, s);
    });
  }

  // Point-to-point through the IPC rings (c10d's send and recv are
  // asynchronous): the tensor is sent, or received into, as a flat
  // contiguous buffer.
  WorkPtr send(const at::Tensor& t, int peer, uint64_t tag) {
    if (comm_->settings().cudaP2pBytes == 0) return {};
    Route r = route(t, OpType::SEND, size_t(t.nbytes()), true, p2pStream(t, peer, true));
    if (!r.dev) return {};
    at::Tensor buf = t.contiguous();
    return launch(r, OpType::SEND, {t}, {buf}, nullptr, [&](auto s) {
      return r.dev->send(buf.data_ptr(), size_t(buf.nbytes()), peer, tag, s);
    });
  }
  WorkPtr recv(const at::Tensor& t, int peer, uint64_t tag) {
    if (comm_->settings().cudaP2pBytes == 0) return {};
    Route r = route(t, OpType::RECV, size_t(t.nbytes()), true, p2pStream(t, peer, false));
    if (!r.dev) return {};
    at::Tensor buf = contiguousOutput(t);
    // Launched when it is first waited for (DeviceComm::recv): its tensors
    // live until then.
    r.streams.keep = std::make_shared<TensorList>(TensorList{t, buf});
    return launch(r, OpType::RECV, {t}, {buf}, copiesBack(buf, t), [&](auto s) {
      return r.dev->recv(buf.data_ptr(), size_t(buf.nbytes()), peer, tag, s);
    });
  }

  // Per CUDA device used so far: "ok", why its calls are staged, or the
  // failure that stopped them.
  std::map<int, std::string> status() const {
    std::map<int, std::string> out;
    for (const auto& [index, dev] : devices_) out[index] = dev->status();
    return out;
  }

  // The communicator's stream on `device` (one per device, from torch's pool).
  c10::Stream streamFor(c10::Device device) {
    std::lock_guard<std::mutex> lock(streamsMutex_);
    auto it = streams_.find(device.index());
    if (it == streams_.end()) {
      c10::impl::VirtualGuardImpl impl(device.type());
      it = streams_.emplace(device.index(), impl.getStreamFromGlobalPool(device)).first;
    }
    return it->second;
  }

 private:
  // A call through CUDA IPC: the device's collectives and the streams.
  struct Route {
    device::DeviceComm* dev = nullptr;  // null: staged
    device::DeviceComm::Streams streams;
    c10::Stream caller{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
    c10::Stream ranOn{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  };

  // The stream of the sends to `peer` (or receives from it) on t's device.
  std::optional<c10::Stream> p2pStream(const at::Tensor& t, int peer, bool sending) {
    if (!t.is_cuda() || !cuda::built()) return {};
    std::lock_guard<std::mutex> lock(streamsMutex_);
    const auto key = std::make_tuple(t.device().index(), peer, sending);
    auto it = p2pStreams_.find(key);
    if (it == p2pStreams_.end()) {
      c10::impl::VirtualGuardImpl impl(t.device().type());
      it = p2pStreams_.emplace(key, impl.getStreamFromGlobalPool(t.device())).first;
    }
    return it->second;
  }

  // `t`'s device collectives, when this call goes through CUDA IPC, and the
  // stream it runs on (rule 2; `own`: a send's or receive's). The first call
  // on a device sets its IPC group up (collective: every rank issues the
  // same calls in the same order).
  Route route(const at::Tensor& t, OpType type, size_t bytesPerRank, bool async,
              std::optional<c10::Stream> own = {}) {
    Route r;
    // Estimating (torch's _time_estimator): nothing moves, not even here.
    if (!t.is_cuda() || !cuda::built() || comm_->estimating()) return r;
    r.caller = c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
    const int index = t.device().index();
    auto it = devices_.find(index);
    bool first = false;
    if (it == devices_.end()) {
      try {
        it = devices_
                 .emplace(index, std::make_unique<device::DeviceComm>(
                                     comm_, device::makeCudaRuntime(index)))
                 .first;
      } catch (...) {
        rethrowForTorch(std::current_exception());
      }
      first = true;
    }
    device::DeviceComm& dev = *it->second;
    void* caller = r.caller.native_handle();
    const bool captured = dev.runtime().capturing(caller);
    r.ranOn = !async || captured ? r.caller : own ? *own : streamFor(t.device());
    r.streams = {caller, r.ranOn.native_handle(), captured};
    bool ipc = false;
    try {
      ipc = dev.ipc(engineOp(type), bytesPerRank, r.streams);
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
    const std::string status = dev.status();
    if (first && status != "ok" && status != "not set up" && comm_->settings().cudaIpc) {
      TORCH_WARN("clawcomm: CUDA IPC is not used on ", t.device(), ": ", status);
    }
    if (ipc) r.dev = &dev;
    return r;
  }

  static clawcomm::OpType engineOp(OpType type) {
    switch (type) {
      case OpType::ALLREDUCE: return clawcomm::OpType::kAllReduce;
      case OpType::BROADCAST: return clawcomm::OpType::kBroadcast;
      case OpType::_ALLGATHER_BASE: return clawcomm::OpType::kAllGather;
      case OpType::_REDUCE_SCATTER_BASE: return clawcomm::OpType::kReduceScatter;
      case OpType::SEND: return clawcomm::OpType::kSend;
      case OpType::RECV: return clawcomm::OpType::kRecv;
      default: return clawcomm::OpType::kAllToAll;
    }
  }

  // The output itself when contiguous, else a contiguous buffer of its shape.
  static at::Tensor contiguousOutput(const at::Tensor& out) {
    return out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
  }
  // Copies `buf` into `target` when they differ (run on the call's stream).
  static std::function<void()> copiesBack(const at::Tensor& buf, const at::Tensor& target) {
    if (buf.is_same(target)) return nullptr;
    return [buf, target] { target.copy_(buf); };
  }

  // Runs the call; `after` (a copy back into a non-contiguous tensor) runs on
  // the same stream before the call's completion is recorded.
  template <typename Run>
  WorkPtr launch(Route& r, OpType type, TensorList outputs, TensorList touched,
                 std::function<void()> after, Run run) {
    const c10::Device device = outputs[0].device();
    const c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream caller = r.caller;
    const c10::Stream ranOn = r.ranOn;
    auto work = c10::make_intrusive<DeviceWork>(rank_, type, outputs, device, ranOn);
    try {
      if (after) {
        // By value: a receive runs it when it is launched, after this returns.
        r.streams.then = [ranOn, after = std::move(after)] {
          const at::NoGradGuard noGrad;  // any thread; a copy into the caller's tensor
          c10::StreamGuard onStream(ranOn);
          after();
        };
      }
      work->attach(run(r.streams));
      if (ranOn != caller) {
        // Once per storage: an in-place call touches its tensor twice.
        std::vector<const void*> seen;
        for (const auto* list : {&touched, &outputs}) {
          for (const auto& t : *list) {
            const c10::DataPtr& p = t.storage().data_ptr();
            if (std::find(seen.begin(), seen.end(), p.get()) != seen.end()) continue;
            seen.push_back(p.get());
            impl.recordDataPtrOnStream(p, ranOn);
          }
        }
      }
    } catch (...) {
      rethrowForTorch(std::current_exception());
    }
    return work;
  }

  std::shared_ptr<Communicator> comm_;
  int rank_;
  // Per device; created and used on the caller's thread. Destroyed before
  // comm_ (declared after it): each waits for its calls in flight.
  std::map<int, std::unique_ptr<device::DeviceComm>> devices_;
  std::mutex streamsMutex_;
  std::map<c10::DeviceIndex, c10::Stream> streams_;
  std::map<std::tuple<c10::DeviceIndex, int, bool>, c10::Stream> p2pStreams_;
};

}  // namespace adapter
}  // namespace clawcomm
