// An IPC group: every rank of one host maps every other rank's device
// buffer, and the kernels of device/ipc_algorithms.h move data between them.
// Runtime-agnostic (device/runtime.h): the same code drives the GPU and the
// host implementation the CPU tests use.
//
// Setup is collective and always agrees: every rank ends with the same
// usable() verdict, whatever fails where.
//   1. Each rank allocates its buffer (never caching-allocator or
//      expandable-segment memory, whose IPC handles fail), zeroes its
//      signals, writes its hello word and exports a handle; it posts the
//      handle and its device index, or the reason it could not.
//   2. Each rank opens every peer's handle.
//   3. The probe kernel, with the loads and stores the collectives use,
//      stores into every peer's mailbox and loads every peer's hello word
//      (canAccessPeer alone can say yes where IPC fails, e.g. in some
//      sandboxes); after a store-side barrier each rank checks its mailbox.
//   4. Each rank posts its verdict ("ok" or what failed on it) and reads
//      everybody's: the group is usable only if every verdict is ok, and a
//      rank that failed early posts every key it still owed, so nobody waits
//      for it. An unusable group frees everything at once.
// Keys live under a prefix the communicator hands out per setup, so a retry
// never reads a failed attempt's keys.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/store.h"
#include "device/p2p_ring.h"
#include "device/runtime.h"

namespace clawcomm {
namespace device {

// The memory a group maps: this rank's buffer, the peers' it opened, and the
// host-mapped abort flag and status. Shared with every CUDA graph that
// captured a launch over it, so a replay never reads freed memory.
//
// Each rank's buffer: the signals, then for each channel (eager, graph) an
// input area and a result area of that channel's capacity, then a ring of
// `ringBytes` per rank of the group for point-to-point messages to it (none
// when ringBytes is 0). Eager calls and graph replays have flags and areas
// of their own, so a graph replayed on one stream and an eager call on
// another can run at the same time.
struct IpcMapping {
  IpcMapping(std::shared_ptr<DeviceRuntime> runtime, size_t eagerBytes, size_t graphBytes,
             size_t ringBytes, int ranks);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  std::shared_ptr<DeviceRuntime> runtime;
  size_t capacity[kIpcChannels];
  size_t ringBytes;
  int ranks;
  void* base = nullptr;  // this rank's buffer
  std::vector<void*> opened;
  void* hostWords = nullptr;  // abort flag, then the status
  IpcPeers peers[kIpcChannels];

  size_t bufferBytes() const;
  void map(int rank, void* buffer);
  uint32_t* abortFlag() const { return static_cast<uint32_t*>(hostWords); }
  IpcStatus* status() const;
};

class IpcGroup {
 public:
  // `eagerBytes` and `graphBytes`: each channel's input and result areas
  // (the largest piece one launch moves); `p2pBytes`: the rings for
  // point-to-point messages, split among the peers (0: none).
  IpcGroup(std::shared_ptr<DeviceRuntime> runtime, Store& store, const std::string& prefix,
           int rank, int size, size_t eagerBytes, size_t graphBytes, size_t p2pBytes,
           Clock::time_point deadline);

  bool usable() const { return why_.empty(); }
  // Why the group is not usable: every rank's problem, the same text on every rank.
  const std::string& whyNot() const { return why_; }
  size_t capacity(int channel) const { return capacity_[channel]; }
  // Each ring's bytes: a message goes through IPC if P2pRing::footprint of
  // its size fits.
  size_t ringBytes() const { return ringBytes_; }
  // Each rank's device index, as it posted it.
  const std::vector<int>& devices() const { return devices_; }
  std::shared_ptr<IpcMapping> mapping() const { return map_; }

  // What a launch reported when it gave up (state kIpcOk: nothing).
  IpcStatus status() const;
  // Sets this rank's abort flag (its spinning blocks stop) and its `failed`
  // word (its peers' blocks stop waiting for it).
  void abort();

  // The host side of each collective, asynchronous on `s`: pieces of at
  // most the channel's capacity, and the caller's buffers read and written by the
  // kernel itself when 16-byte aligned (else copied through this rank's
  // areas). Every rank passes the same counts. `in` may equal `out`.
  struct Launch {
    Stream stream;
    int channel;  // IpcChannel
    uint64_t timeoutNs;
    IpcCall call;  // what every rank compares at the start barrier (collectives)
  };
  void allReduce(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                 IpcKernel algo, const Launch& how);
  void allGather(const void* in, void* out, size_t bytesPerRank, const Launch& how);
  void reduceScatter(const void* in, void* out, size_t countPerRank, DataType type, ReduceOp op,
                     const Launch& how);
  void broadcast(void* buf, size_t bytes, int root, const Launch& how);
  void allToAll(const void* in, void* out, size_t bytesPerRank, const Launch& how);
  // Point-to-point, eager channel only; both ends issue the pair's messages
  // in the same order with the same sizes and tags (a receive that meets
  // another tag or size reports kIpcMismatch).
  void send(const void* in, size_t bytes, int peer, uint64_t tag, const Launch& how);
  // A receive takes its place among the pair's messages when it is issued
  // (placeRecv, in issue order) and may be launched later (recv), each
  // peer's in the order they were placed.
  P2pRing::Slot placeRecv(size_t bytes, int peer);
  void recv(const P2pRing::Slot& at, void* out, size_t bytes, int peer, uint64_t tag,
            const Launch& how);

  // The bytes of the areas a piece of `bytesPerRank` per rank takes.
  static size_t areaBytes(size_t bytesPerRank, int size) { return roundUp(bytesPerRank) * size; }

 private:
  static size_t roundUp(size_t b) { return (b + 15) & ~size_t(15); }
  void setUp(Store& store, const std::string& prefix, Clock::time_point deadline);
  IpcLaunch launchOf(IpcKernel kernel, const void* in, void* out, size_t packs, const Launch& how,
                     bool direct) const;
  void launchP2p(IpcKernel kernel, int peer, uint32_t count, uint64_t tag, uint64_t bytes,
                 uint64_t offset, const Launch& how) const;
  char* ringFor(int from, int to) const;
  const IpcPeers& peers(const Launch& how) const { return map_->peers[how.channel]; }
  void copy(void* dst, const void* src, size_t bytes, Stream s) const;
  // The size pieces of `bytesPerRank` between a caller's buffer (packed) and
  // this rank's input / result area (each piece at a 16-byte boundary).
  void piecesIn(const void* in, size_t bytesPerRank, const Launch& how) const;
  void piecesOut(void* out, size_t bytesPerRank, const Launch& how) const;

  std::shared_ptr<DeviceRuntime> runtime_;
  int rank_;
  int size_;
  size_t capacity_[kIpcChannels];
  size_t ringBytes_;
  std::shared_ptr<IpcMapping> map_;
  std::vector<P2pRing> sent_;      // per peer: where this rank's messages to it go
  std::vector<P2pRing> received_;  // per peer: where its messages to this rank are
  std::vector<int> devices_;
  std::string why_;
};

}  // namespace device
}  // namespace clawcomm
