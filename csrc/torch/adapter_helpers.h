// The adapter's shared helpers (included by process_group.cc alone, the one
// translation unit that includes torch): the store wrapper, the error
// translation, the argument checks every op uses (each message names the op),
// and the flat-buffer layout helpers.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/extension.h>

#include <atomic>
#include <functional>
#include <memory>
#include <numeric>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/communicator.h"
#include "common/errors.h"

namespace clawcomm {
namespace adapter {

using c10d::OpType;
using TensorList = std::vector<at::Tensor>;

// Whether the caller asked for an asynchronous call (async_op=True). torch
// 2.8 and later pass it down as opts.asyncOp; before that every call counts
// as asynchronous.
template <typename Opts>
auto isAsyncOf(const Opts& opts, int) -> decltype(bool(opts.asyncOp)) {
  return opts.asyncOp;
}
template <typename Opts>
bool isAsyncOf(const Opts&, long) {
  return true;
}
template <typename Opts>
bool isAsync(const Opts& opts) {
  return isAsyncOf(opts, 0);
}

class StoreAdapter : public Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    store_->set(key, value);
  }
  // Polls check() rather than calling wait(): FileStore's wait overshoots
  // its timeout by about a second (torch 2.13), far past a group's deadline.
  std::vector<uint8_t> get(const std::string& key, Clock::time_point deadline) override {
    const auto start = Clock::now();
    auto nap = std::chrono::microseconds(500);
    while (!store_->check({key})) {
      if (Clock::now() >= deadline) {
        throw TimeoutError(CLAWCOMM_CONCAT(
            "store key ", key, " did not appear within ",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count(),
            " ms"));
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(20000));
    }
    return store_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool compareSet(const std::string& key, const std::string& expected,
                  const std::string& desired) override {
    const std::vector<uint8_t> want(desired.begin(), desired.end());
    return store_->compareSet(key, std::vector<uint8_t>(expected.begin(), expected.end()), want) ==
           want;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// Engine errors become torch.distributed.DistBackendError in Python; argument
// errors become ValueError.
[[noreturn]] inline void rethrowForTorch(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const InvalidArgument& x) {
    TORCH_CHECK_VALUE(false, x.what());
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& x) {
    C10_THROW_ERROR(DistBackendError, x.what());
  }
  C10_THROW_ERROR(DistBackendError, "clawcomm: unknown error");
}

// ---------------------------------------------------------------------------
// Argument checks shared by every op.

inline DataType toDataType(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool: return DataType::kBool;
    default:
      TORCH_CHECK_VALUE(false, "clawcomm::", op, ": dtype ", t,
                        " is not supported (float32, float64, float16, bfloat16, int8, uint8, "
                        "int32, int64, bool are)");
  }
}

inline ReduceOp toReduceOp(const char* op, const c10d::ReduceOp& r) {
  switch (r.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::kProduct;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    case c10d::ReduceOp::BAND: return ReduceOp::kBand;
    case c10d::ReduceOp::BOR: return ReduceOp::kBor;
    case c10d::ReduceOp::BXOR: return ReduceOp::kBxor;
    default:
      TORCH_CHECK_VALUE(false, "clawcomm does not support reduce op ", int(r.op_), " in ", op,
                        " (PREMUL_SUM is not implemented)");
  }
}

inline void checkTensor(const char* op, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), "clawcomm::", op, ": got an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "clawcomm::", op, ": got a ", t.layout(),
                    " tensor; clawcomm handles dense (strided) tensors, and sparse COO ones in "
                    "all_reduce");
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "clawcomm::", op,
                    ": got a tensor on ", t.device(),
                    "; the clawcomm backend handles cpu and cuda tensors");
}

inline void checkSameDevice(const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "clawcomm::", op, ": tensors on ", a.device(),
                    " and ", b.device(),
                    " in one call; every tensor of a call must be on one device");
}

// Checks every tensor and that they share one dtype; returns it.
inline DataType checkTensors(const char* op, const TensorList& ts) {
  TORCH_CHECK_VALUE(!ts.empty(), "clawcomm::", op, ": got an empty tensor list");
  for (const auto& t : ts) {
    checkTensor(op, t);
    TORCH_CHECK_VALUE(t.scalar_type() == ts[0].scalar_type(), "clawcomm::", op,
                      ": tensors mix dtypes ", ts[0].scalar_type(), " and ", t.scalar_type());
    checkSameDevice(op, ts[0], t);
  }
  return toDataType(op, ts[0].scalar_type());
}

inline const at::Tensor& single(const char* op, const TensorList& ts) {
  TORCH_CHECK_VALUE(ts.size() == 1, "clawcomm::", op, ": expects one tensor per call, got ",
                    ts.size());
  return ts[0];
}

inline void checkNumel(const char* op, const char* what, int64_t got, int64_t expected) {
  TORCH_CHECK_VALUE(got == expected, "clawcomm::", op, ": ", what, " has ", got,
                    " elements, expected ", expected);
}

inline void checkSameDtype(const char* op, const at::Tensor& a, const at::Tensor& b) {
  checkSameDevice(op, a, b);
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "clawcomm::", op,
                    ": input and output dtypes differ (", a.scalar_type(), " vs ", b.scalar_type(),
                    ")");
}

// `t`'s values as one contiguous buffer for the engine, which reads numel()
// values from data_ptr(): `t` itself when it is contiguous, else a
// contiguous copy. (Not a flat view: a view is a new TensorImpl with
// autograd's view bookkeeping, about a microsecond a call.)
inline at::Tensor asBuffer(const at::Tensor& t) {
  return t.contiguous();
}

// Flattens a list into one new contiguous buffer.
inline at::Tensor concat(const TensorList& ts) {
  if (ts.empty()) return at::empty({0});
  TensorList flats;
  for (const auto& t : ts) flats.push_back(t.reshape({-1}));
  return at::cat(flats);
}

// Copies consecutive slices of `buffer` into each tensor of `outs`.
inline void splitInto(const at::Tensor& buffer, const TensorList& outs) {
  int64_t offset = 0;
  for (const auto& o : outs) {
    o.copy_(buffer.narrow(0, offset, o.numel()).view(o.sizes()));
    offset += o.numel();
  }
}

inline std::vector<size_t> numels(const TensorList& ts) {
  std::vector<size_t> out;
  for (const auto& t : ts) out.push_back(size_t(t.numel()));
  return out;
}

}  // namespace adapter
}  // namespace clawcomm
