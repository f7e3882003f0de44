// Every CLAWCOMM_* environment setting, declared and read in one place.
//
// Settings are read when a communicator is created, so tests can change the
// environment between groups. docs/settings.md's table mirrors this file.
#pragma once

#include <cstddef>
#include <string>

#include "common/cost_model.h"

namespace clawcomm {

// CLAWCOMM_SINGLE_COPY_BYTES's default (Settings::singleCopyMinBytes), which
// the cost model assumes (algorithms/selection.cc).
constexpr size_t kDefaultSingleCopyBytes = size_t(1) << 20;
// Where a reader's kernel copies fast enough (measureReads), frames from
// this size go by single copy instead.
constexpr size_t kFastSingleCopyBytes = size_t(64) << 10;

enum class SimdChoice { kAuto, kAvx512, kAvx2, kPortable };

// CLAWCOMM_SIMD=auto|avx512|avx2|portable: the most the element-wise kernels
// may use (auto: the best this CPU has). Process-wide, read once.
SimdChoice simdChoiceFromEnv();

struct Settings {
  // CLAWCOMM_TRANSPORT=auto or a transport's name (transport/registry.cc:
  // shm, tcp). auto: for each pair, the first transport in the registry
  // that can connect it: shared memory on one host, TCP across hosts.
  // Checked against the registry when a communicator is created.
  std::string transport = "auto";
  // CLAWCOMM_ALGO=auto or an all-reduce algorithm's name
  // (algorithms/selection.cc: ring, tree, hierarchical). auto picks by the
  // cost model in docs/algorithms.md. hierarchical applies to groups on two
  // or more hosts with the same number (two or more) of ranks on each;
  // elsewhere it runs the ring. Checked against the table when a
  // communicator is created.
  std::string algo = "auto";
  // CLAWCOMM_DETERMINISTIC=0|1. 1: every reduction (all-reduce,
  // reduce-scatter, reduce; every operator and dtype) adds its inputs in
  // one canonical order, a fixed binary tree over the ranks
  // (algorithms/deterministic.cc, docs/deterministic.md), whatever the
  // layout, transport, segment size or timing: the result is a function of
  // the inputs and the group size alone, the same bits on every rank. It
  // overrides CLAWCOMM_ALGO for those three operations (the flight record
  // says "deterministic"); the 16-bit-wire reductions are refused, and CUDA
  // tensors' reductions are staged through host memory (not CUDA IPC).
  bool deterministic = false;
  // CLAWCOMM_COST_MODEL: a model file (`clawcomm bench --calibrate` writes
  // one) whose latencies and bandwidths auto chooses by; unset means the
  // defaults in common/cost_model.h.
  std::string costModelPath;
  CostModel costModel;
  // CLAWCOMM_SHM_RING_BYTES: bytes of each one-way shared-memory ring.
  size_t shmRingBytes = size_t(4) << 20;
  // CLAWCOMM_SHM_PEERS=auto|all|sparse: which pairs of ranks on one host get
  // shared-memory rings (with CLAWCOMM_TRANSPORT=auto). all: every pair, so
  // a host of k ranks holds k (k-1) rings. sparse: only the pairs the
  // reducing collectives' schedules use (Topology::frequentPair: about
  // 2 + log2 n per rank); the other pairs of a host talk TCP over loopback.
  // auto: sparse when a host runs more than 16 ranks of the group.
  enum class ShmPeers { kAuto, kAll, kSparse };
  ShmPeers shmPeers = ShmPeers::kAuto;
  // CLAWCOMM_SINGLE_COPY=auto|cma|all|off: how large messages move between
  // ranks of one host. cma: the receiver copies straight out of the
  // sender's memory with one process_vm_readv (cross-memory attach), where
  // the ring takes two copies (into the ring, out of it); each receiver
  // probes at setup whether it may read each peer (a container's seccomp or
  // a ptrace policy can forbid it) and says so in the ring's control block,
  // so each direction of each pair decides by the reader's verdict and every
  // frame says how it travels (transport/shm/connection.h). Only frames of
  // operations where every rank sends and receives at once (send/recv,
  // all-gather, all-to-all, gather, scatter, the direct broadcast) go by
  // single copy; see Messenger::referenceSuits. auto: cma where the probe
  // passes, the ring elsewhere; cma: a failed probe is an error at setup;
  // all: as cma, and the frames of every operation (reductions and
  // broadcast too); off: always the ring.
  enum class SingleCopy { kAuto, kCma, kAll, kOff };
  SingleCopy singleCopy = SingleCopy::kAuto;
  // CLAWCOMM_SINGLE_COPY_BYTES: frames of at least this many payload bytes
  // go by single copy. Smaller ones stay in the ring: their copies hit the
  // cache, while the kernel pins every page it reads (a 256 KiB read from
  // 4 KiB pages costs more than the ring's two copies). From 1 MiB one copy
  // wins (2 ranks, 2 MiB frames of an all-gather: 149 us against the ring's
  // 232; a 2 MiB send/recv pair 155 against 342; docs/benchmarks.md).
  // Unset, each reader measures its kernel's copy at setup and may take
  // frames from kFastSingleCopyBytes (transport/shm/connection.cc,
  // measureReads); the algorithm choice keeps this value, the same on every
  // rank.
  size_t singleCopyMinBytes = kDefaultSingleCopyBytes;
  bool singleCopyMinBytesSet = false;
  // CLAWCOMM_SEGMENT_BYTES: ring algorithms pipeline each chunk in segments of
  // at most this many bytes.
  size_t segmentBytes = size_t(1) << 20;
  // CLAWCOMM_TREE_MAX_BYTES: with algo=auto, all-reduce messages up to this
  // size use the tree (recursive doubling); 0 means "use the cost model".
  size_t treeMaxBytes = 0;
  // CLAWCOMM_SPIN_US: how long a wait spins before it sleeps. Unset (-1)
  // means 50 us, or 5 us when this host runs more ranks of the group than
  // it has cores (spinning would steal the core a peer needs).
  int spinMicros = -1;
  // CLAWCOMM_YIELD_US: after spinning, how long a wait keeps giving its core
  // away (sched_yield) before it sleeps. Unset (-1) means 0, or 1000 us when
  // the host is oversubscribed: there a peer is usually runnable and about
  // to make progress, and yielding hands it the core without the latency
  // of a sleep and wake-up.
  int yieldMicros = -1;
  // CLAWCOMM_INLINE_BYTES: a collective of at most this many bytes, issued
  // while nothing else is queued, runs on the calling thread instead of
  // being handed to the progress thread, which saves two thread wake-ups.
  // Larger ones run on the progress thread, so that the caller can compute
  // while they move, unless the caller waits for them anyway (a blocking
  // call: Communicator::Blocking). 0 disables both. A collective the caller
  // does not wait for runs inline only while its communicator is the only
  // one in the process: with two, running it on the caller's thread would
  // make it wait, and ranks that issue ops of two groups in crossing orders
  // would wait for each other.
  size_t inlineMaxBytes = size_t(1) << 20;
  // CLAWCOMM_PROGRESS_NICE (0..19): the nice value of each communicator's
  // progress thread. A higher value makes the thread give way to the
  // rank's compute threads when both want a core: on a CPU host, a
  // reduction launched during backward then moves bytes while the trainer
  // waits or sleeps, instead of delaying the training thread by a
  // scheduler time slice. Collectives that run inline (CLAWCOMM_INLINE_BYTES)
  // are unaffected.
  int progressNice = 10;
  // CLAWCOMM_SOCKET_ADDR: the IPv4 address this rank publishes for TCP peers.
  // Empty means: CLAWCOMM_SOCKET_IFNAME's address, or else resolve the host
  // name, falling back to 127.0.0.1.
  std::string socketAddr;
  // CLAWCOMM_SOCKET_IFNAME: the network interface (eth0, ib0, ...) whose
  // IPv4 address TCP peers connect to, as NCCL_SOCKET_IFNAME. Checked at
  // setup: an interface with no IPv4 address is an error.
  std::string socketIfname;
  // CLAWCOMM_SOCKETS_PER_PEER (1..64): TCP sockets per pair of ranks, each
  // pair's stream striped over them in 256 KiB units. More than one helps
  // where one TCP stream cannot fill the link (long fat links, per-flow
  // limits, several paths); every rank must use the same number.
  int socketsPerPeer = 1;
  // CLAWCOMM_HOST_ID: the identity that decides which ranks share memory.
  // Empty means host name plus boot id. Set it to tell apart containers on
  // one machine that do not share /dev/shm (or to simulate hosts in tests).
  std::string hostId;
  // CLAWCOMM_DEBUG=1 prints connection and algorithm choices to stderr.
  bool debug = false;
  // CLAWCOMM_RECORDER_ENTRIES: operations each communicator remembers for
  // the flight recorder (comm/recorder.h); 0 turns recording off.
  size_t recorderEntries = 1024;
  // CLAWCOMM_FLIGHT_DIR: where a failing communicator writes its flight
  // record, as <dir>/<job token>/rank<r>.json. Empty means
  // $TMPDIR/clawcomm-flight (/tmp/clawcomm-flight).
  std::string flightDir;
  // CLAWCOMM_FLIGHT_KEEP_DAYS (default 7) and CLAWCOMM_FLIGHT_KEEP (default
  // 50): a dump removes the job folders beside it older than the days, and
  // the oldest beyond the count (comm/recorder.h).
  int flightKeepDays = 7;
  size_t flightKeep = 50;
  // CLAWCOMM_CUDA_IPC=auto|0. auto: CUDA tensors of a group whose ranks all
  // share one host go through CUDA IPC buffers and kernels (cuda/ipc.h)
  // when the setup probe passes; 0, or a failed probe, or ranks on several
  // hosts: they are staged through pinned host memory and the engine.
  bool cudaIpc = true;
  // CLAWCOMM_CUDA_IPC_BYTES: each rank's IPC input and result areas (the
  // largest piece one kernel moves; larger all-reduces go in pieces).
  size_t cudaIpcBytes = size_t(64) << 20;
  // CLAWCOMM_CUDA_GRAPH_BYTES: the input and result areas of calls captured
  // into CUDA graphs (they have areas and flags of their own, so a replay
  // may run beside eager calls). A captured call that does not fit is an
  // error (all-reduces go in pieces and always fit).
  size_t cudaGraphBytes = size_t(8) << 20;
  // CLAWCOMM_CUDA_P2P_BYTES: rings for sends and receives of CUDA tensors
  // between ranks of one host through CUDA IPC, this many bytes in all per
  // rank, split among its peers (device/protocol.h). 0 (the default): they
  // are staged through host memory and matched by tag. Otherwise a message
  // whose size fits a ring goes through it, and the sends and receives of a
  // pair match in the order they are issued, as NCCL's do (a receive that
  // meets another tag or size is an error on both ranks); the first CUDA
  // call of any kind sets the IPC group up, so every rank must reach its
  // first one without waiting for another rank's message.
  size_t cudaP2pBytes = 0;
  // CLAWCOMM_CUDA_ONESHOT_BYTES=auto|N: CUDA IPC all-reduces up to this size
  // use the one-shot kernel (every rank reads every input), larger ones the
  // two-shot (reduce-scatter + all-gather). auto: by the world size, as
  // vLLM's crossovers: always one-shot on 2 ranks, up to 512 KiB on 3-4,
  // up to 256 KiB on 5-8.
  static constexpr size_t kAutoBytes = ~size_t(0);
  size_t cudaOneShotMaxBytes = kAutoBytes;

  // The settings every rank of a group must share, as "NAME=value|..."
  // (compared at rendezvous: ranks that differ would route, size or split
  // their messages differently and wait for each other forever).
  std::string mustMatch() const;

  // Reads the environment; throws InvalidArgument naming a bad value.
  static Settings fromEnv();
};

}  // namespace clawcomm
