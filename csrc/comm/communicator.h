// A communicator: one group of ranks, its connections, and the progress
// thread that runs its operations.
//
// Every public operation checks its arguments on the calling thread (so a
// bad call fails before any byte is sent), fills one queue entry and returns
// a Request at once. (Small collectives issued while the queue is empty run
// to completion on the caller's thread instead: see inlineMaxBytes.) The progress thread runs
// collectives one at a time in issue order — the order that matches them across ranks — while sends
// and receives only post their transfers and complete whenever the bytes have moved, so `irecv`
// before `isend` on both sides of a pair never deadlocks.
//
// After the first failure (a dead peer, a timeout, a mismatch) the
// communicator aborts: peers are told, and every pending and later operation
// fails with the same error, naming what went wrong.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "algorithms/topology.h"
#include "comm/recorder.h"
#include "comm/rendezvous.h"
#include "comm/request.h"
#include "comm/status_pages.h"
#include "common/dtype.h"
#include "common/op.h"
#include "common/scratch.h"
#include "common/settings.h"
#include "common/store.h"
#include "common/traffic.h"

namespace clawcomm {

class Channel;
struct ChannelMemory;
class Messenger;
struct AllReduceAlgorithm;

class Communicator {
 public:
  using Callback = Request::Callback;

  // A scope in which the calling thread waits for each collective it issues
  // (torch's async_op=False, the engine's Python calls). There a collective
  // of any size runs on the calling thread when nothing is queued ahead of
  // it, as small ones always do (CLAWCOMM_INLINE_BYTES), instead of going
  // to the progress thread and back: on 2 ranks of a 2-core host the two
  // hand-offs cost 20-40 us a call, and the woken threads can land on the
  // core where the peer's copy runs. Scopes nest; the innermost one counts.
  class Blocking {
   public:
    explicit Blocking(bool on = true) : saved_(active_) { active_ = on; }
    ~Blocking() { active_ = saved_; }
    Blocking(const Blocking&) = delete;
    Blocking& operator=(const Blocking&) = delete;
    static bool active() { return active_; }

   private:
    bool saved_;
    static thread_local bool active_;
  };

  // Connects to every rank of the group through `store` (blocking).
  Communicator(std::shared_ptr<Store> store, int rank, int size, std::chrono::milliseconds timeout,
               Settings settings = Settings::fromEnv());
  // The same, shared: whoever drops the last reference, even a completion
  // callback on the communicator's own progress thread (which cannot join
  // itself), the communicator is shut down safely. Front ends hold it so.
  static std::shared_ptr<Communicator> create(std::shared_ptr<Store> store, int rank, int size,
                                              std::chrono::milliseconds timeout,
                                              Settings settings = Settings::fromEnv());
  // How a group splits (split()).
  struct SplitOptions {
    // For the new group's setup and its operations; zero: this group's.
    std::chrono::milliseconds timeout{0};
    // Where the new group's setups key (the CUDA IPC group's); null: this
    // group's store.
    std::shared_ptr<Store> store;
    // If not empty: the ranks of this group the new one must have, in its
    // rank order (torch's split names them); a split that gives this rank
    // another group fails, on every rank.
    std::vector<int> members;
  };
  static constexpr int kNoColor = -1;

  // Splits this group, as MPI_Comm_split and ncclCommSplit do: every rank of
  // it calls split, in the same order among its collectives; the ranks that
  // pass the same color >= 0 form a new group, ordered by `key` (ties by
  // their rank here), and a rank that passes kNoColor joins none and gets
  // null. No store round trips: the new group's members swap their
  // addresses and settle their setup over this group's connections, and
  // take its hosts, settings and token from it (comm/split.cc says more).
  // Blocks; a failure on any rank fails it on every rank.
  std::shared_ptr<Communicator> split(int color, int key, SplitOptions options);
  std::shared_ptr<Communicator> split(int color, int key) { return split(color, key, {}); }

  // How a group shrinks (shrink()).
  struct ShrinkOptions {
    // Abort this group first (torch's SHRINK_ABORT): what it has in flight
    // fails at once, on every rank, instead of waiting on an excluded rank.
    bool abortFirst = false;
    // For the new group's setup and its operations; zero: this group's.
    std::chrono::milliseconds timeout{0};
    // Where the new group's later setups key; null: this group's store.
    std::shared_ptr<Store> store;
  };

  // A group of this one's ranks but `excluded`, which may be dead or stuck
  // in a collective (torch's shrink_group, ncclCommShrink). Only the ranks
  // that stay call it, each with the same ranks to exclude, in the same
  // order among their shrinks; they keep this group's order. It connects
  // them afresh through the store, with this group's hosts, settings and
  // global ranks, and never waits on this group's connections
  // (comm/shrink.cc says why). This group is left as it is, aborted first
  // with options.abortFirst; without it, what it has in flight still waits
  // on the excluded ranks. Blocks until every member has connected; fails
  // on every member, naming the rank, if one does not come.
  std::shared_ptr<Communicator> shrink(const std::vector<int>& excluded, ShrinkOptions options);

  // Time estimates (torch's _time_estimator, NCCL's simulated groups):
  // between startEstimate() and endEstimate() this communicator's operations
  // move nothing and touch no buffer. Each is checked as usual, then
  // completes at once, adding the cost model's prediction for it: the
  // algorithm it would have run over this group's links
  // (algorithms.h: operationCost, pointToPointCost), with the numbers
  // CLAWCOMM_COST_MODEL calibrated if it is set. No sequence number is
  // taken, so the ranks need not estimate the same operations.
  // endEstimate() returns the sum, in seconds.
  void startEstimate();
  double endEstimate();
  bool estimating() const { return estimating_.load(std::memory_order_acquire); }

  // What this communicator holds in memory (torch's memory_stats): the
  // shared-memory rings this rank reads (their size, and how much of it is
  // in memory now), the collectives' working memory, and its CUDA IPC
  // buffers (deviceBytes()).
  struct MemoryStats {
    size_t ringBytes = 0;
    size_t ringResidentBytes = 0;
    size_t scratchBytes = 0;
    int64_t deviceIpcBytes = 0;
    bool suspended = false;
  };
  MemoryStats memoryStats() const;
  // Between phases of a job (torch's suspend and resume): suspend() frees
  // the rings' pages and the working memory, keeping every mapping and
  // connection. Every rank of the group calls it, with no operation in
  // flight; it blocks until all have (comm/suspend.cc says why). Until
  // resume() (local: nothing to set up again) every operation is refused.
  void suspend();
  void resume();

  // Calls shutdown(); on the progress thread it would have to join itself,
  // so there it reports the misuse and ends the process (use create()).
  ~Communicator();

  // Finishes queued operations, says goodbye to the peers, and joins the
  // progress thread. Idempotent. Must not be called from the progress thread
  // (see onProgressThread()).
  void shutdown();
  bool onProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Whether the calling thread is running a small collective inline (its
  // completion callback included).
  bool runningInlineHere() const { return inlineThread_.load() == std::this_thread::get_id(); }

  // Aborts from any thread (a watchdog, a signal handler's helper, an
  // elastic agent): the op in flight and every pending and later one fail
  // through their requests with "rank R aborted: <reason>", waiters wake at
  // once instead of at their timeout, and the peers are told, so their
  // waits fail too. Idempotent; the process keeps running, and shutdown()
  // afterwards returns promptly.
  void abort(const std::string& reason);

  // Shuts down every communicator still alive in this process: called at
  // interpreter exit, before Python finalization stops threads that touch it.
  static void shutdownAll();

  // What a group's creation checks of the settings (Settings::fromEnv has
  // read and range-checked each) before it connects: the transport and the
  // algorithm names. Throws InvalidArgument naming the setting.
  static void checkSettings(const Settings& settings);

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The job's (global) rank of each rank of this group, as the launcher
  // numbers them (torch: global_ranks_in_group); a split group gets its
  // members' from its parent. Errors and flight records then name global
  // ranks first: "rank 2 (group rank 1, pid 42) died". Unknown (empty) or
  // the identity leaves them as they are. Call it before any operation.
  void setGlobalRanks(std::vector<int> ranks);
  int globalRank(int groupRank) const {
    return globalRanks_.empty() ? groupRank : globalRanks_[size_t(groupRank)];
  }
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeoutMs_); }
  // Applies to operations that start after the call.
  void setTimeout(std::chrono::milliseconds timeout) { timeoutMs_ = timeout.count(); }
  const Settings& settings() const { return settings_; }
  // The prefix of this group's store keys (a new one per group generation):
  // what else sets up over the same store (the CUDA IPC group) keys under it.
  const std::string& storeNamespace() const { return storeNamespace_; }
  // "shm", "tcp" or "self": how this rank reaches `peer`.
  std::string transportOf(int peer) const;
  // The smallest payload this rank sends to `peer` by single copy
  // (SIZE_MAX: none goes so): CLAWCOMM_SINGLE_COPY_BYTES, or what the peer
  // measured at setup (transport/shm/connection.h).
  size_t singleCopyFrom(int peer) const;
  // How many collectives this rank has issued: the same on every rank that
  // issued the same ones, which is what torch's desync checks compare.
  uint64_t collectivesIssued() {
    std::lock_guard<std::mutex> lock(mutex_);
    return nextSeq_;
  }
  // Bytes on the wire and calls so far, per operation type (see
  // common/traffic.h). Calls are counted when issued, even if rejected later.
  const Traffic& traffic() const;
  // Counts the bytes of an operation that moved them outside the messenger
  // (CUDA IPC kernels; beginExternal counted the call): `sent` bytes that
  // peers read from this rank's buffers and `received` bytes it read from
  // theirs (payload only).
  void countExternal(OpType type, uint64_t sent, uint64_t received);

  // The flight record (comm/recorder.h) as JSON: the last operations, oldest
  // first, with their state. Any thread; fields may be mid-update.
  std::string flightRecord(const std::string& why = "requested") const;
  // Where this communicator writes it if it fails: under its job's folder
  // (flightJobFolder: the token of the first group made while none was
  // alive in this process), in a folder of its own unless it is that group.
  std::string flightRecordPath() const;
  std::string flightJobFolder() const;

  // --- Operations that move their bytes outside the messenger -------------
  // (device/device_comm.h: device collectives through CUDA IPC.) They belong
  // to this group all the same: numbered in its collective sequence, in its
  // flight record, counted in its traffic, refused once it has failed, and
  // told when it aborts.

  // The group's store, and a fresh key prefix under this group's namespace
  // for a setup the ranks do together: each call returns the next one, so
  // ranks that make the same calls agree, and a retry never reads the keys
  // of an attempt that failed.
  Store& store() { return *store_; }
  std::string setupNamespace(const std::string& what);
  // Gives `sig` the next sequence number (a collective; sends and receives
  // take none, as the messenger's do) and records it in the flight
  // recorder, started, with this rank's `bytes` and `peer`; returns the
  // record's id. Throws PeerError naming why if the communicator has failed
  // or aborted, InvalidArgument if it is shutting down.
  uint64_t beginExternal(OpSignature& sig, uint64_t bytes, int peer = -1);
  void endExternal(uint64_t record, bool ok);
  // Device memory those operations hold for this group on this rank (the
  // CUDA IPC buffer each device's DeviceComm allocates; the host runtime's
  // shared memory in the CPU tests): added at setup, taken off when freed.
  // Any thread.
  void addDeviceBytes(int64_t delta) { deviceBytes_.fetch_add(delta, std::memory_order_relaxed); }
  int64_t deviceBytes() const { return deviceBytes_.load(std::memory_order_relaxed); }
  // Why this communicator can run no more operations (abort(), or its first
  // failure), or "" while it can; failed() is the quick check.
  std::string failure();
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // `f(reason)` runs once when the communicator aborts or fails, on the
  // thread that noticed; it must be quick and must not call back in.
  // Returns an id for removeFailureListener (which waits for a call in
  // progress to return).
  int addFailureListener(std::function<void(const std::string&)> f);
  void removeFailureListener(int id);

  // Which host each rank runs on (hosts numbered by first rank).
  const Topology& topology() const { return topology_; }
  // "ring", "tree" or "hierarchical": what all_reduce of `bytes` would use.
  std::string allReduceAlgorithm(size_t bytes) const;

  // Buffers must stay valid until the request completes.
  RequestPtr allReduce(void* buf, size_t count, DataType dtype, ReduceOp op, Callback cb = {});
  // Sum of float32 `buf` over every rank with 16-bit values on the wire
  // (`wire` is kFloat16 or kBFloat16) and float32 accumulation at every step
  // (algorithms/ring_all_reduce_16bit.cc). Each rank's values are multiplied
  // by `prescale` first (1/size for a mean that cannot overflow float16), and
  // the result by `postscale` (size, to turn that mean back into a sum).
  RequestPtr allReduce16BitWire(float* buf, size_t count, DataType wire, float prescale,
                                float postscale = 1.0f, Callback cb = {});
  // The reduce-scatter of the same ring: `count` a multiple of the group's
  // size, rank r's part (count / size values, summed in float32) into `out`;
  // `buf` is the partial sums' scratch (overwritten).
  RequestPtr reduceScatter16BitWire(float* buf, float* out, size_t count, DataType wire,
                                    float prescale, float postscale, Callback cb = {});
  // `in` holds counts[r] elements for each rank r, back to back; `out`
  // receives this rank's counts[rank] reduced elements.
  RequestPtr reduceScatter(const void* in, void* out, std::vector<size_t> counts, DataType dtype,
                           ReduceOp op, Callback cb = {});
  // `in` holds counts[rank] elements; `out` receives every rank's, back to back.
  RequestPtr allGather(const void* in, void* out, std::vector<size_t> counts, DataType dtype,
                       Callback cb = {});
  RequestPtr broadcast(void* buf, size_t count, DataType dtype, int root, Callback cb = {});
  // The result lands in `buf` on root; other ranks' `buf` is left unchanged.
  RequestPtr reduce(void* buf, size_t count, DataType dtype, ReduceOp op, int root,
                    Callback cb = {});
  // `out` (root only) receives `count` elements per rank.
  RequestPtr gather(const void* in, void* out, size_t count, DataType dtype, int root,
                    Callback cb = {});
  // `in` (root only) holds `count` elements per rank.
  RequestPtr scatter(const void* in, void* out, size_t count, DataType dtype, int root,
                     Callback cb = {});
  // sendCounts[p] elements go to rank p, recvCounts[p] come from rank p.
  RequestPtr allToAll(const void* in, std::vector<size_t> sendCounts, void* out,
                      std::vector<size_t> recvCounts, DataType dtype, Callback cb = {});
  RequestPtr barrier(Callback cb = {});
  // A send or receive issued while the messenger is idle (nothing queued,
  // no collective running) is started on the caller's thread, and left to
  // it: drive() then moves its bytes when the caller waits. The progress
  // thread takes over those that no caller drives for kCallerGrace.
  RequestPtr send(const void* buf, size_t bytes, int peer, uint64_t tag, Callback cb = {});
  // peer == -1 receives from any rank; Request::sourceRank() tells which.
  RequestPtr recv(void* buf, size_t bytes, int peer, uint64_t tag, Callback cb = {});
  // The calling thread is about to wait for `request`: if it is a send or
  // receive in flight and no other thread drives the messenger, drive it
  // here until it completes, other work is queued, or `until` passes. The
  // caller then waits on the request as usual. A point-to-point transfer
  // handed to the progress thread and back costs two thread wake-ups (on 2
  // ranks of a 2-core host about half a 64 KiB send/recv pair's time), and
  // the progress thread runs at CLAWCOMM_PROGRESS_NICE.
  void drive(const Request& request, Clock::time_point until = Clock::time_point::max());

 private:
  struct Op;

  // Checks the arguments and connects a new group through `store`.
  static Connections connectThrough(Store& store, int rank, int size,
                                    std::chrono::milliseconds timeout, const Settings& settings);
  // A group over connections already made (the public constructor's, or a
  // split's).
  Communicator(std::shared_ptr<Store> store, int rank, int size, std::chrono::milliseconds timeout,
               Settings settings, Connections conns);
  // Shared ownership with the safe deleter (create() says why).
  static std::shared_ptr<Communicator> own(Communicator* c);

  // `bytes`: the op's payload on this rank, which decides whether it may run
  // inline on the caller's thread (Settings::inlineMaxBytes).
  RequestPtr enqueueCollective(const OpSignature& sig, size_t bytes,
                               std::function<void(Channel&)> run, Callback cb);
  RequestPtr enqueuePointToPoint(bool isSend, void* buf, size_t bytes, int peer, uint64_t tag,
                                 Callback cb);
  // Under mutex_: throws, naming `type`, unless the communicator takes new
  // operations (not shutting down, not suspended).
  void checkAcceptingLocked(OpType type) const;
  // Under mutex_: if `allowed` and nothing is queued or running, claims the
  // messenger for the calling thread (inlineBusy_) and returns true; else
  // queues `op` for the progress thread and returns false.
  bool runHereOrQueueLocked(bool allowed, std::unique_ptr<Op>& op);
  // An operation issued while estimating: adds `seconds` and completes.
  RequestPtr estimateOnly(double seconds, Callback cb);
  // `peer`, or for a receive from any rank (-1) the one it is priced from.
  int farthestFrom(int peer) const;
  // Under mutex_: the spare op, or a new one; a request for `cb`, the spare
  // one if nobody else holds it (see spareOp_).
  std::unique_ptr<Op> takeOpLocked();
  RequestPtr takeRequestLocked(Callback cb);
  // chooseAlgorithm's answer for `op` on `bytes`, remembered: the cost model
  // walks every rank of the layout, and a training loop asks for the same
  // few sizes on every step.
  Algorithm algorithmFor(OpType op, size_t bytes) const;
  void checkRoot(OpType op, int root) const;
  void checkCounts(OpType op, const std::vector<size_t>& counts, const char* what) const;
  // InvalidArgument under CLAWCOMM_DETERMINISTIC=1, naming `op` and `wire`.
  void checkNotDeterministic16BitWire(OpType op, DataType wire) const;
  // The scheduler (scheduler.cc): the progress thread's loop and its steps.
  void progressLoop();
  // The next work under one lock: a collective, or the sends and receives
  // at the queue's head; false once stopping with nothing in flight.
  // (`ops`: the last work's, emptied, for spareOp_.)
  bool nextWork(std::vector<std::unique_ptr<Op>>& ops, std::string& abortNow,
                Clock::time_point& stopDeadline);
  void idleSpin(std::unique_lock<std::mutex>& lock);
  void runCollective(Op& op);
  void startPointToPoint(std::unique_ptr<Op> op);
  void progressPointToPoint(bool startedOne, Clock::time_point& idleSince,
                            Clock::time_point stopDeadline);
  // Gives back the messenger a caller drove (drive, enqueuePointToPoint).
  void releaseDrive();
  bool completeIfBroken(Op& op);
  std::exception_ptr withFlightRecord(std::exception_ptr error);
  // `error` (a timeout or a mismatch in collective `sig`) with the ranks
  // that hold the group up named (comm/culprit.h), kept for the flight
  // record. `late`: seconds past its deadline the timeout was seen.
  std::exception_ptr withCulprits(std::exception_ptr error, const OpSignature& sig, bool timedOut,
                                  double late);
  void fail(std::exception_ptr error);
  void notifyFailure(const std::string& reason);
  std::string dumpFlightRecord(const std::string& why) noexcept;

  std::shared_ptr<Store> store_;
  int rank_;
  int size_;
  std::atomic<int64_t> timeoutMs_;  // set by users, read by the progress thread
  Settings settings_;
  std::unique_ptr<Messenger> messenger_;
  std::vector<std::string> transports_;
  Topology topology_;
  std::vector<std::string> hosts_;  // each rank's host identity, for split()
  mutable std::mutex choiceMutex_;
  mutable std::map<std::pair<OpType, size_t>, Algorithm> choices_;  // guarded by it
  mutable std::atomic<uint64_t> lastChoice_{0};  // the last of them (algorithmFor)
  std::string jobToken_;
  std::vector<int> globalRanks_;  // empty: the group ranks are the global ones
  // `text` with each "rank N" of this group as "rank G (group rank N)".
  std::string inGlobalRanks(const std::string& text) const;
  std::string storeNamespace_;
  Recorder recorder_;
  std::unique_ptr<StatusPages> status_;  // this rank's status page (null: a group of one)
  std::string culprit_;                  // guarded by mutex_: withCulprits' verdict, if any
  // Device collectives in flight (beginExternal's record -> its sequence
  // number), for their completion on the status page.
  std::mutex externalMutex_;
  std::unordered_map<uint64_t, uint64_t> externalSeqs_;
  Scratch scratch_;  // the collectives' working memory (one collective runs at a time)
  std::unique_ptr<ChannelMemory> channelMemory_;  // their channels' (the same)

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  // Kept for the next collective (guarded by mutex_), so that a run of
  // blocking calls allocates neither (issue 62): the op of the last one
  // that finished, emptied (Op() again), and the last request made, reused
  // once the communicator holds the only reference to it.
  std::unique_ptr<Op> spareOp_;
  RequestPtr spareRequest_;
  bool stopping_ = false;
  uint64_t nextSeq_ = 0;  // guarded by mutex_
  // Who drives the messenger (guarded by mutex_): the progress thread while
  // it runs an op or has sends/receives in flight, or a caller running a
  // small collective inline. Never both.
  // Sends and receives in flight while neither is set were started by a
  // caller (enqueuePointToPoint) and are left to their waiters: the
  // progress thread takes them over kCallerGrace after a caller last drove
  // them (callerDrove_), so a caller that does not wait still sees them done.
  bool threadBusy_ = false;
  bool inlineBusy_ = false;
  Clock::time_point callerDrove_{};
  // Whether callers post and drive their sends and receives: not where the
  // host runs more ranks than cores (set once, in the constructor).
  bool callersDrive_ = true;
  static constexpr auto kCallerGrace = std::chrono::microseconds(200);
  // How long after a caller last drove the progress thread keeps looking
  // every kCallerGrace rather than sleeping until notified.
  static constexpr auto kCallerWatch = std::chrono::milliseconds(10);
  bool threadWatching_ = false;
  std::atomic<uint64_t> enqueued_{0};  // operations ever queued: the idle progress thread polls it
  std::atomic<std::thread::id> inlineThread_{};  // who runs the inline op (set with inlineBusy_)
  // abort(): requested by any thread, handled by the one driving the
  // messenger (guarded by mutex_).
  bool abortRequested_ = false;
  bool abortHandled_ = false;
  std::string abortReason_;
  std::string failure_;              // guarded by mutex_: abortReason_ or the first failure
  std::atomic<bool> failed_{false};  // !failure_.empty()
  std::atomic<int64_t> deviceBytes_{0};
  uint64_t setups_ = 0;                  // guarded by mutex_: setupNamespace() calls so far
  uint64_t splits_ = 0;                  // guarded by mutex_: split() calls so far
  uint64_t shrinks_ = 0;                 // guarded by mutex_: shrink() calls so far
  std::atomic<bool> estimating_{false};  // between startEstimate() and endEstimate()
  double estimated_ = 0;                 // guarded by mutex_: their sum so far, in seconds
  bool suspended_ = false;               // guarded by mutex_: between suspend() and resume()

  std::mutex listenersMutex_;  // held while listeners run
  std::map<int, std::function<void(const std::string&)>> listeners_;
  int nextListener_ = 0;
  bool notified_ = false;  // guarded by listenersMutex_

  // Owned by whichever thread drives the messenger.
  std::vector<std::unique_ptr<Op>> pointToPoint_;
  // Owned by whichever thread drives the messenger.
  std::exception_ptr broken_;
  std::thread thread_;
  std::once_flag shutdownOnce_;
};

}  // namespace clawcomm
