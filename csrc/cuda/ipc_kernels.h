// What the IPC kernels (ipc_kernels.cu) see of a group, and their launchers.
// Internal to csrc/cuda/: the group itself is cuda/ipc.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "cuda/ipc.h"

namespace clawcomm {
namespace cuda {

enum IpcPhase { kIpcStart = 0, kIpcMiddle = 1, kIpcEnd = 2, kIpcPhases = 3 };

// The head of every rank's buffer. slot[phase][block][from] is written by
// rank `from` (through its IPC mapping) when its block passes `phase`;
// counter[block] is the block's epoch, kept here so that graph replays
// count on. probe[] is the setup probe's mailbox.
struct IpcSignals {
  uint32_t counter[kIpcMaxBlocks];
  uint32_t slot[kIpcPhases][kIpcMaxBlocks][kIpcMaxRanks];
  uint32_t probe[kIpcMaxRanks];
};

// Every rank's buffer as this rank maps it: signals, then the input area,
// then the result area, `capacity` bytes each.
struct IpcPeers {
  IpcSignals* signals[kIpcMaxRanks];
  char* input[kIpcMaxRanks];
  char* result[kIpcMaxRanks];
  int rank;
  int size;
  uint64_t timeoutNs;
};

// `direct`: `in`/`out` are 16-byte aligned and the byte counts multiples of
// 16, so kernels read and write them themselves; otherwise the caller has
// copied the input into this rank's input area, passes null, and copies the
// result out of this rank's result area afterwards.
void launchAllReduce(const IpcPeers& p, const void* in, void* out, size_t count, DataType type,
                     ReduceOp op, IpcAllReduce algo, bool direct, Stream stream);
void launchAllGather(const IpcPeers& p, const void* in, void* out, size_t bytesPerRank, bool direct,
                     Stream stream);
void launchReduceScatter(const IpcPeers& p, const void* in, void* out, size_t countPerRank,
                         DataType type, ReduceOp op, bool direct, Stream stream);
void launchBroadcast(const IpcPeers& p, void* buf, size_t bytes, int root, bool direct,
                     Stream stream);
void launchAllToAll(const IpcPeers& p, const void* in, void* out, size_t bytesPerRank, bool direct,
                    Stream stream);

}  // namespace cuda
}  // namespace clawcomm
