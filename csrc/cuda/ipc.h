// Collectives between ranks on one host through CUDA IPC (plain C++: no CUDA
// or torch headers, so the torch adapter can hold one).
//
// Every rank cudaMallocs one buffer of its own (never caching-allocator or
// expandable-segment memory, whose IPC handles fail), exports it with
// cudaIpcGetMemHandle, and opens every peer's. Handles travel through the
// group's Store. Before the group is used, an open-write-read probe checks
// that every pair really reaches the other's memory (canAccessPeer alone can
// say yes where IPC fails, e.g. under some sandboxes); usable() is the
// verdict, the same on every rank. Ranks may be on different GPUs or share
// one.
//
// The kernels (cuda/ipc_kernels.cu) synchronise through flags in device
// memory: each block keeps its own epoch counter there, so a captured CUDA
// graph replays correctly, and every spin-wait gives up after the group's
// timeout, printing which rank it waited for, and traps: a dead peer stops
// the GPU with an error instead of hanging it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/dtype.h"
#include "common/store.h"
#include "cuda/kernels.h"

namespace clawcomm {
namespace cuda {

constexpr int kIpcMaxRanks = 8;
constexpr int kIpcMaxBlocks = 128;

enum class IpcAllReduce { kOneShot, kTwoShot };

class IpcGroup {
 public:
  // Collective over the group: every rank calls it with the same `bytes`
  // (the largest message one kernel moves; larger ones go in pieces) on its
  // current device, and the same store `prefix` (unique to the group and
  // device). Store waits give up after `timeoutNs`, as the kernels' spins
  // do. Throws InvalidArgument for more than kIpcMaxRanks ranks.
  static std::unique_ptr<IpcGroup> create(Store& store, const std::string& prefix, int rank,
                                          int size, size_t bytes, int64_t timeoutNs);
  virtual ~IpcGroup() = default;

  // Whether every pair passed the probe; whyNot() says what failed where.
  virtual bool usable() const = 0;
  virtual const std::string& whyNot() const = 0;
  virtual size_t capacity() const = 0;

  // Asynchronous on `stream` (on the group's device). Every rank passes the
  // same counts. `in` and `out` may be the same buffer.
  virtual void allReduce(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                         IpcAllReduce algo, Stream stream) = 0;
  // `out` receives every rank's `countPerRank` elements, rank-major.
  virtual void allGather(const void* in, void* out, size_t countPerRank, DataType type,
                         Stream stream) = 0;
  // `in` holds size x countPerRank elements; `out` this rank's reduced slice.
  virtual void reduceScatter(const void* in, void* out, size_t countPerRank, DataType type,
                             ReduceOp op, Stream stream) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root, Stream stream) = 0;
  // `bytesPerRank` from `in` + p * bytesPerRank go to rank p.
  virtual void allToAll(const void* in, void* out, size_t bytesPerRank, Stream stream) = 0;
};

// Whether this build has the CUDA kernels (false: every cuda:: call throws).
bool built();

}  // namespace cuda
}  // namespace clawcomm
