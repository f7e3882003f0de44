// The device collectives' protocol: the shared memory layout, the per-block
// epoch flags and the rules for giving up, written once for two executors, a
// CUDA thread block (cuda/ipc_kernels.cu) and a host thread standing in for
// one (device/host_runtime.cc). Both compile this header and the algorithms
// over it (device/ipc_algorithms.h), so the CPU suite runs the flags, epochs,
// slot reuse, timeouts and abort checks that the GPU runs, as reduce/ops.h
// shares the per-element math.
//
// Memory. Every rank owns one shared buffer (IpcSignals, then an input area
// and a result area of `capacity` bytes each) that every peer maps; a block
// reads peers' areas through those mappings and writes only its own rank's
// areas and its peers' signal slots.
//
// Synchronisation. Every kernel splits its 16-byte packs among its blocks
// the same way on every rank, and block b of a rank only ever waits for
// block b of its peers, so one block's flags are all the synchronisation it
// needs (no grid-wide barrier):
//   barrier(phase): the block stores its epoch into every peer's
//   slot[phase][block][me] (release, system scope, after a system fence),
//   then waits until its own slot[phase][block][p] reaches the epoch for
//   every p (acquire). The epoch is counter[block], incremented by the kernel
//   itself in device memory, so a CUDA graph that replays the kernel counts
//   on. Eager launches and graph-captured ones use separate counters and
//   slots (channels), so a graph replayed on one stream never shares a slot
//   with an eager call on another.
//   The start barrier also carries the call: each block stores its call's
//   IpcCall (op, element type, reduce op, root, count, sequence number, as
//   the CPU path's frames carry its OpSignature) into every peer's
//   call[block][me] before its epoch, and after the wait compares every
//   peer's with its own: two ranks that called different collectives (of
//   the same size, which would otherwise pair up silently) give up on both
//   sides with kIpcCallMismatch before any byte moves between them.
// Point-to-point (sends and receives between two ranks, in the order each
// pair issues them). Rank s keeps a ring for each peer d in its buffer; its
// k-th message to d goes at an offset both ranks compute alike on the host
// (device/p2p_ring.h), behind a 16-byte header (tag, bytes). The bytes are
// copied by the stream (a copy engine) between one-thread kernels:
//   send: [space: wait until d took the messages this one overwrites]
//         copy in; post: the header, a system fence, then posted[s] = k + 1
//         in d's signals
//   recv: arrive: wait until posted[s] reaches k + 1, check the header
//         against this receive's tag and size; copy out; take: taken[d] =
//         k + 1 in s's signals
// A send waits only when its ring is full of messages d has not taken.
// Giving up. A waiting block stops when its wait outlives the group's
// timeout, when the host sets this rank's abort flag (host-mapped memory),
// or when the peer it waits for, or another block of its own rank, has
// failed (the `failed` word in that rank's signals). It then marks its own
// rank failed, so its peers stop too, reports once (the first failing block
// claims the host-mapped status), and the kernel returns: no trap, the CUDA
// context survives, and the host turns the status into an error.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/hd.h"

namespace clawcomm {
namespace device {

constexpr int kIpcMaxRanks = 8;
// Blocks per launch, each of which may spin. Capped so that the blocks of
// eight ranks sharing one GPU stay resident together (a block waiting for a
// peer's block that cannot be scheduled would wait forever) and so that a
// collective overlapping backward leaves it most SMs (vLLM caps at 36,
// SymmetricMemory at 24).
constexpr int kIpcMaxBlocks = 32;

enum IpcPhase { kIpcStart = 0, kIpcMiddle = 1, kIpcEnd = 2, kIpcPhases = 3 };
enum IpcChannel { kIpcEager = 0, kIpcGraph = 1, kIpcChannels = 2 };

// Why a launch gave up (IpcStatus::state).
enum IpcFailure : uint32_t {
  kIpcOk = 0,
  kIpcTimedOut = 1,      // the peer never came
  kIpcAborted = 2,       // this rank's host called abort()
  kIpcPeerFailed = 3,    // the peer (or another block of this rank) gave up first
  kIpcMismatch = 4,      // a receive met a message of another tag or size
  kIpcCallMismatch = 5,  // a peer's collective is not this rank's (see IpcCall)
};

// The waits of point-to-point calls, as a status's phase names them (after
// the collectives' IpcPhase values).
constexpr int kIpcPhaseSpace = 3;  // a send waiting for room in its ring
constexpr int kIpcPhaseData = 4;   // a receive waiting for its message

struct alignas(16) Pack {
  uint32_t w[4];
};

// What every rank must agree on for one collective launch (built from the
// call's OpSignature by device/device_comm.cc): the element count (low,
// high word), the communicator's sequence number (low 32 bits), the root
// (-1: none), then OpType | DataType << 8 | ReduceOp << 16 | Algorithm << 24.
// Zero words: not checked (the probe, point-to-point).
struct IpcCall {
  uint32_t w[6];
};

// The head of every rank's buffer.
struct IpcSignals {
  struct Channel {
    uint32_t counter[kIpcMaxBlocks];                         // each block's epoch
    uint32_t slot[kIpcPhases][kIpcMaxBlocks][kIpcMaxRanks];  // written by rank [from]
    IpcCall call[kIpcMaxBlocks][kIpcMaxRanks];               // written by rank [from]
  } channel[kIpcChannels];
  uint32_t hello;                 // set at setup; the probe's loads read it
  uint32_t probe[kIpcMaxRanks];   // the probe's mailbox: rank p stores into probe[p]
  uint32_t loaded[kIpcMaxRanks];  // what this rank's probe loaded from rank p's hello
  uint32_t failed;                // non-zero once a block of this rank gave up
  uint32_t failClaim;             // the first block to give up reports the status
  uint32_t posted[kIpcMaxRanks];  // messages rank [from] has posted to this rank
  uint32_t taken[kIpcMaxRanks];   // messages of this rank's that rank [from] has taken
};

// What heads each message in a ring (one Pack).
struct IpcMessageHeader {
  uint64_t tag;
  uint64_t bytes;
};
static_assert(sizeof(IpcMessageHeader) == 16, "a header is one Pack");

// What a launch reports when it gives up: in host-mapped memory, read by the
// host after (or while) the kernel runs. `state` is written last.
struct IpcStatus {
  volatile uint32_t state;  // IpcFailure
  int32_t block;
  int32_t waitedFor;
  int32_t phase;
  uint32_t epoch;
  uint32_t channel;
  uint64_t waitedNs;
  IpcMessageHeader expected;  // kIpcMismatch: what the receive expected,
  IpcMessageHeader found;     // and the header it found
  IpcCall ours;               // kIpcCallMismatch: this rank's call,
  IpcCall theirs;             // and rank waitedFor's
};

// Every rank's buffer as this rank maps it, and the launch's settings.
struct IpcPeers {
  IpcSignals* signals[kIpcMaxRanks];
  char* input[kIpcMaxRanks];
  char* result[kIpcMaxRanks];
  char* rings[kIpcMaxRanks];           // rank r's rings, one per peer: rings[r] + peer * ringBytes
  uint64_t ringBytes;                  // 0: no point-to-point through IPC
  const volatile uint32_t* abortFlag;  // host-mapped: this rank's host aborted
  IpcStatus* status;                   // host-mapped
  int rank;
  int size;
  int channel;  // IpcChannel
  uint64_t timeoutNs;
};

enum class IpcKernel {
  kOneShot,
  kTwoShot,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kAllToAll,
  kProbe,
  kP2pSpace,  // point-to-point, one thread each (see above)
  kP2pPost,
  kP2pArrive,
  kP2pTake
};

// A point-to-point launch: the peer, the message count the wait is for or
// the post announces, and the message's header and place in the ring.
struct IpcP2p {
  int peer = -1;
  uint32_t count = 0;
  IpcMessageHeader header{};
  uint64_t offset = 0;
};

// One launch. `in`/`out` are the caller's buffers when `direct` (16-byte
// aligned, whole packs), else null: the host has copied the input into this
// rank's input area and copies the result out of its result area.
struct IpcLaunch {
  IpcKernel kernel = IpcKernel::kProbe;
  IpcPeers peers{};
  const Pack* in = nullptr;
  Pack* out = nullptr;
  size_t packs = 0;  // all-reduce: the message; others: one rank's piece
  DataType type = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  int blocks = 1;
  IpcP2p p2p{};
  IpcCall call{};  // collectives: compared with every peer's at the start barrier
};

CLAWCOMM_HD uint32_t probeValue(int from, int to) {
  return 0xC1A00000u | uint32_t(from) << 8 | uint32_t(to);
}
CLAWCOMM_HD uint32_t helloValue(int rank) {
  return 0x4E110000u | uint32_t(rank);
}

// Blocks for `packs` packs of work: the same on every rank (it depends on the
// size alone), at most `maxBlocks`.
inline int blocksFor(size_t packs, int maxBlocks) {
  const size_t want = (packs + 1023) / 1024;
  return int(want < 1 ? 1 : (want > size_t(maxBlocks) ? size_t(maxBlocks) : want));
}

// ---------------------------------------------------------------------------
// The executor X that runs the bodies below provides:
//   int thread(), threads(), block()        this thread, the block's threads, the block
//   void sync()                             __syncthreads()
//   uint32_t* shared()                      two words shared by the block
//   uint64_t nowNs()                        a clock in nanoseconds
//   void pause(uint32_t spins)              between polls of a spin-wait
//   static void storeRelease(uint32_t*, uint32_t), uint32_t loadAcquire(const uint32_t*)
//                                           system-scope atomics on mapped memory
//   static void fenceSystem()
//   static bool claim(uint32_t*)            0 -> 1, true for the one caller that swaps
//   static Pack load(const Pack*), loadPeer(const Pack*); static void store(Pack*, Pack)

template <class X>
CLAWCOMM_DEVICE void giveUp(const X& x, const IpcPeers& P, uint32_t why, int peer, int phase,
                            uint32_t epoch, uint64_t waited,
                            const IpcMessageHeader* expected = nullptr,
                            const IpcMessageHeader* found = nullptr, const IpcCall* ours = nullptr,
                            const IpcCall* theirs = nullptr) {
  X::storeRelease(&P.signals[P.rank]->failed, 1);
  if (X::claim(&P.signals[P.rank]->failClaim)) {
    P.status->block = x.block();
    P.status->waitedFor = peer;
    P.status->phase = phase;
    P.status->epoch = epoch;
    P.status->channel = uint32_t(P.channel);
    P.status->waitedNs = waited;
    if (expected) P.status->expected = *expected;
    if (found) P.status->found = *found;
    if (ours) P.status->ours = *ours;
    if (theirs) P.status->theirs = *theirs;
    X::fenceSystem();
    P.status->state = why;
    X::fenceSystem();
  }
}

// This block's epoch for this launch (and the block's "gave up" word cleared).
template <class X>
CLAWCOMM_DEVICE uint32_t beginOp(const X& x, const IpcPeers& P) {
  if (x.thread() == 0) {
    x.shared()[0] = ++P.signals[P.rank]->channel[P.channel].counter[x.block()];
    x.shared()[1] = 0;
  }
  x.sync();
  return x.shared()[0];
}

// One thread's wait until `*word` reaches `target` (wrap-safe), which `peer`
// stores. Returns kIpcOk, or why it stopped after giving up (status written,
// this rank marked failed): an abort, a failed rank, or the timeout.
template <class X>
CLAWCOMM_DEVICE uint32_t waitAtLeast(const X& x, const IpcPeers& P, const uint32_t* word,
                                     uint32_t target, int peer, int phase) {
  const uint64_t start = x.nowNs();
  for (uint32_t spins = 1; int32_t(X::loadAcquire(word) - target) < 0; ++spins) {
    if ((spins & 63) == 0) {  // the rarer reasons to stop, every 64 polls
      uint32_t why = kIpcOk;
      const uint64_t waited = x.nowNs() - start;
      if (*P.abortFlag) {
        why = kIpcAborted;
      } else if (X::loadAcquire(&P.signals[peer]->failed) ||
                 X::loadAcquire(&P.signals[P.rank]->failed)) {
        why = kIpcPeerFailed;
      } else if (waited > P.timeoutNs) {
        why = kIpcTimedOut;
      }
      if (why != kIpcOk) {
        giveUp(x, P, why, peer, phase, target, waited);
        return why;
      }
    }
    x.pause(spins);
  }
  return kIpcOk;
}

// See the header. `call` (the start barrier of a collective): published to
// every peer with the epoch and compared with theirs. Returns false when
// this block gave up (the kernel returns).
template <class X>
CLAWCOMM_DEVICE bool barrier(const X& x, const IpcPeers& P, int phase, uint32_t epoch,
                             const IpcCall* call = nullptr) {
  constexpr int kWords = int(sizeof(IpcCall) / sizeof(uint32_t));
  x.sync();
  const int b = x.block();
  for (int p = x.thread(); p < P.size; p += x.threads()) {
    if (call) {
      uint32_t* theirs = P.signals[p]->channel[P.channel].call[b][P.rank].w;
      for (int i = 0; i < kWords; ++i) X::storeRelease(theirs + i, call->w[i]);
    }
    X::fenceSystem();
    X::storeRelease(&P.signals[p]->channel[P.channel].slot[phase][b][P.rank], epoch);
  }
  for (int p = x.thread(); p < P.size; p += x.threads()) {
    const uint32_t* heard = &P.signals[P.rank]->channel[P.channel].slot[phase][b][p];
    if (waitAtLeast(x, P, heard, epoch, p, phase) != kIpcOk) {
      x.shared()[1] = 1;
      break;
    }
    if (!call || p == P.rank) continue;
    IpcCall theirs;
    bool same = true;
    for (int i = 0; i < kWords; ++i) {
      theirs.w[i] = X::loadAcquire(P.signals[P.rank]->channel[P.channel].call[b][p].w + i);
      same = same && theirs.w[i] == call->w[i];
    }
    if (!same) {
      giveUp(x, P, kIpcCallMismatch, p, phase, epoch, 0, nullptr, nullptr, call, &theirs);
      x.shared()[1] = 1;
      break;
    }
  }
  x.sync();
  return x.shared()[1] == 0;
}

}  // namespace device
}  // namespace clawcomm
