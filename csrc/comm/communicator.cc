#include "comm/communicator.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>

#include "algorithms/algorithms.h"
#include "algorithms/channel.h"
#include "comm/rendezvous.h"
#include "common/errors.h"
#include "messenger/messenger.h"
#include "reduce/reduce_kernels.h"
#include "transport/registry.h"

namespace clawcomm {

struct Communicator::Op {
  OpSignature sig;
  std::function<void(Channel&)> run;  // collectives
  RequestPtr request;
  // Point-to-point.
  bool pointToPoint = false;
  bool isSend = false;
  void* buf = nullptr;
  size_t bytes = 0;
  int peer = -1;
  uint64_t tag = 0;
  TransferPtr transfer;
  Clock::time_point deadline;
  uint64_t record = 0;  // its flight-recorder id
};

namespace {

// The same error type as `e`, with `prefix` before its text and `suffix`
// after it.
std::exception_ptr rewrapped(std::exception_ptr e, const std::string& prefix,
                             const std::string& suffix) {
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError& x) {
    return std::make_exception_ptr(TimeoutError(prefix + x.what() + suffix));
  } catch (const PeerError& x) {
    return std::make_exception_ptr(PeerError(prefix + x.what() + suffix));
  } catch (const MismatchError& x) {
    return std::make_exception_ptr(MismatchError(prefix + x.what() + suffix));
  } catch (const InvalidArgument& x) {
    return std::make_exception_ptr(InvalidArgument(prefix + x.what() + suffix));
  } catch (const std::exception& x) {
    return std::make_exception_ptr(Error(prefix + x.what() + suffix));
  } catch (...) {
    return std::make_exception_ptr(Error(prefix + "unknown error" + suffix));
  }
}

std::exception_ptr withContext(std::exception_ptr e, const std::string& message) {
  return rewrapped(e, message, "");
}

std::exception_ptr withSuffix(std::exception_ptr e, const std::string& suffix) {
  return rewrapped(e, "", suffix);
}

std::string errorText(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

std::string opPrefix(OpType t) {
  return CLAWCOMM_CONCAT("clawcomm::", opTypeName(t), ": ");
}

void checkDataType(OpType op, DataType dtype) {
  CLAWCOMM_ARG_CHECK(dtype < DataType::kNumTypes, opPrefix(op), "unsupported dtype code ",
                     int(dtype));
}

void checkReduceOp(OpType op, DataType dtype, ReduceOp redop) {
  checkDataType(op, dtype);
  CLAWCOMM_ARG_CHECK(reduceOpSupported(dtype, redop), opPrefix(op), "reduce op ",
                     reduceOpName(redop), " is not defined on ", dataTypeName(dtype),
                     redop == ReduceOp::kAvg ? " (avg needs a floating point dtype)"
                                             : " (bitwise ops need an integer or bool dtype)");
}

}  // namespace

namespace {
// Every live communicator, for shutdownAll().
std::mutex registryMutex;
std::set<Communicator*>& registry() {
  static auto* live = new std::set<Communicator*>();  // never destroyed: used at exit
  return *live;
}
}  // namespace

Communicator::Communicator(std::shared_ptr<Store> store, int rank, int size,
                           std::chrono::milliseconds timeout, Settings settings)
    : rank_(rank),
      size_(size),
      timeoutMs_(timeout.count()),
      settings_(std::move(settings)),
      recorder_(settings_.recorderEntries) {
  CLAWCOMM_ARG_CHECK(size >= 1 && rank >= 0 && rank < size, "clawcomm: rank ", rank,
                     " is not in a group of ", size, " ranks");
  checkTransportSetting(settings_.transport);
  checkAlgorithmSetting(settings_.algo);
  Connections conns = rendezvous(*store, rank, size, settings_, Clock::now() + this->timeout());
  jobToken_ = conns.jobToken;
  storeNamespace_ = conns.storeNamespace;
  topology_ = Topology(conns.hostOf);
  transports_.resize(size_t(size));
  for (int p = 0; p < size; ++p) transports_[p] = p == rank ? "self" : conns.toRank[p]->kind();
  const int localRanks = conns.sameHostRanks;
  cpu_set_t cpus;
  const int cores = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  const bool oversubscribed = localRanks > cores;
  if (settings_.spinMicros < 0) settings_.spinMicros = oversubscribed ? 5 : 50;
  if (settings_.yieldMicros < 0) settings_.yieldMicros = oversubscribed ? 1000 : 0;
  messenger_ = std::make_unique<Messenger>(rank, size, std::move(conns.toRank),
                                           settings_.spinMicros, settings_.yieldMicros);
  // The group's epoch: its random token's low bits, new for every group (a
  // rebuilt one included).
  messenger_->setEpoch(uint32_t(std::stoull(jobToken_.empty() ? "0" : jobToken_, nullptr, 16)));
  thread_ = std::thread([this] { progressLoop(); });
  std::lock_guard<std::mutex> lock(registryMutex);
  registry().insert(this);
}

std::shared_ptr<Communicator> Communicator::create(std::shared_ptr<Store> store, int rank, int size,
                                                   std::chrono::milliseconds timeout,
                                                   Settings settings) {
  return std::shared_ptr<Communicator>(
      new Communicator(std::move(store), rank, size, timeout, std::move(settings)),
      [](Communicator* c) {
        if (c->onProgressThread() || c->runningInlineHere()) {
          // The last reference went away inside a completion callback, on
          // the progress thread (which cannot join itself) or on a caller
          // running a small op inline (whose op is not finished): let
          // another thread shut down once the callback has returned.
          std::thread([c] { delete c; }).detach();
        } else {
          delete c;
        }
      });
}

Communicator::~Communicator() {
  if (onProgressThread()) {
    std::fprintf(stderr,
                 "clawcomm: a communicator was destroyed on its own progress thread; hold it "
                 "through Communicator::create()\n");
    std::abort();
  }
  shutdown();
  std::lock_guard<std::mutex> lock(registryMutex);
  registry().erase(this);
}

void Communicator::shutdown() {
  CLAWCOMM_CHECK(!onProgressThread(), "shutdown() called from the progress thread");
  std::call_once(shutdownOnce_, [this] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (!broken_) messenger_->close(Clock::now() + std::chrono::seconds(2));
  });
}

void Communicator::shutdownAll() {
  std::vector<Communicator*> live;
  {
    std::lock_guard<std::mutex> lock(registryMutex);
    live.assign(registry().begin(), registry().end());
  }
  for (Communicator* c : live) c->shutdown();
}

std::string Communicator::transportOf(int peer) const {
  CLAWCOMM_ARG_CHECK(peer >= 0 && peer < size_, "clawcomm: rank ", peer, " is not in a group of ",
                     size_, " ranks");
  return transports_[peer];
}

const Traffic& Communicator::traffic() const {
  return messenger_->traffic();
}

void Communicator::countExternal(OpType type, uint64_t sent, uint64_t received) {
  OpTraffic& t = messenger_->traffic().of(type);
  Traffic::add(t.calls, 1);
  Traffic::add(t.bytesSent, sent);
  Traffic::add(t.payloadSent, sent);
  Traffic::add(t.bytesReceived, received);
  Traffic::add(t.payloadReceived, received);
}

const AllReduceAlgorithm& Communicator::allReduceChoice(size_t bytes) const {
  std::lock_guard<std::mutex> lock(choiceMutex_);
  auto it = choices_.find(bytes);
  if (it != choices_.end()) return *it->second;
  if (choices_.size() >= 4096) choices_.clear();  // sizes that keep changing: stay bounded
  const AllReduceAlgorithm& algo = chooseAllReduce(bytes, topology_, settings_);
  choices_.emplace(bytes, &algo);
  return algo;
}

std::string Communicator::allReduceAlgorithm(size_t bytes) const {
  return allReduceChoice(bytes).name;
}

void Communicator::checkRoot(OpType op, int root) const {
  CLAWCOMM_ARG_CHECK(root >= 0 && root < size_, opPrefix(op), "root ", root,
                     " is out of range for a group of ", size_, " ranks");
}

void Communicator::checkCounts(OpType op, const std::vector<size_t>& counts,
                               const char* what) const {
  CLAWCOMM_ARG_CHECK(counts.size() == size_t(size_), opPrefix(op), what, " has ", counts.size(),
                     " entries for a group of ", size_, " ranks");
}

// ---------------------------------------------------------------------------
// Public operations: check arguments here, on the caller's thread, then hand
// one closure to the progress thread.

RequestPtr Communicator::allReduce(void* buf, size_t count, DataType dtype, ReduceOp op,
                                   Callback cb) {
  checkReduceOp(OpType::kAllReduce, dtype, op);
  const AllReduceAlgorithm& algo = allReduceChoice(count * elementSize(dtype));
  OpSignature sig{OpType::kAllReduce, dtype, op, -1, count};
  sig.algo = algo.id;
  const int n = size_;
  return enqueueCollective(
      sig, count * elementSize(dtype),
      [=](Channel& ch) {
        algo.run(ch, buf, count);
        if (op == ReduceOp::kAvg) divideInPlace(dtype, buf, count, n);
      },
      std::move(cb));
}

RequestPtr Communicator::allReduce16BitWire(float* buf, size_t count, DataType wire, float prescale,
                                            float postscale, Callback cb) {
  CLAWCOMM_ARG_CHECK(wire == DataType::kFloat16 || wire == DataType::kBFloat16,
                     "clawcomm::all_reduce: the wire format must be float16 or bfloat16, not ",
                     dataTypeName(wire));
  CLAWCOMM_ARG_CHECK(std::isfinite(prescale) && prescale != 0.0f, "clawcomm::all_reduce: prescale ",
                     prescale, " is not a finite non-zero factor");
  CLAWCOMM_ARG_CHECK(std::isfinite(postscale) && postscale != 0.0f,
                     "clawcomm::all_reduce: postscale ", postscale,
                     " is not a finite non-zero factor");
  OpSignature sig{OpType::kAllReduce, wire, ReduceOp::kSum, -1, count};
  sig.algo = Algorithm::kRing16BitWire;
  return enqueueCollective(
      sig, count * 2,
      [=](Channel& ch) { ringAllReduce16BitWire(ch, buf, count, prescale, postscale); },
      std::move(cb));
}

RequestPtr Communicator::reduceScatter(const void* in, void* out, std::vector<size_t> counts,
                                       DataType dtype, ReduceOp op, Callback cb) {
  checkReduceOp(OpType::kReduceScatter, dtype, op);
  checkCounts(OpType::kReduceScatter, counts, "counts");
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
  OpSignature sig{OpType::kReduceScatter, dtype, op, -1, total};
  const bool hierarchical = useHierarchical(topology_, settings_);
  if (hierarchical) sig.algo = Algorithm::kHierarchical;
  const int r = rank_, n = size_;
  return enqueueCollective(
      sig, total * elementSize(dtype),
      [=](Channel& ch) {
        const size_t es = elementSize(dtype);
        // The ring reduces in place, so it works on a copy of the input.
        std::vector<uint8_t> work(total * es);
        if (total) std::memcpy(work.data(), in, total * es);
        if (hierarchical) {
          hierarchicalReduceScatter(ch, work.data(), counts);
        } else {
          ringReduceScatter(ch, work.data(), counts);
        }
        const size_t offset = std::accumulate(counts.begin(), counts.begin() + r, size_t(0));
        if (counts[r]) std::memcpy(out, work.data() + offset * es, counts[r] * es);
        if (op == ReduceOp::kAvg) divideInPlace(dtype, out, counts[r], n);
      },
      std::move(cb));
}

RequestPtr Communicator::allGather(const void* in, void* out, std::vector<size_t> counts,
                                   DataType dtype, Callback cb) {
  checkDataType(OpType::kAllGather, dtype);
  checkCounts(OpType::kAllGather, counts, "counts");
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
  OpSignature sig{OpType::kAllGather, dtype, ReduceOp::kSum, -1, total};
  const bool hierarchical = useHierarchical(topology_, settings_);
  if (hierarchical) sig.algo = Algorithm::kHierarchical;
  const int r = rank_;
  return enqueueCollective(
      sig, total * elementSize(dtype),
      [=](Channel& ch) {
        const size_t es = elementSize(dtype);
        const size_t offset = std::accumulate(counts.begin(), counts.begin() + r, size_t(0));
        uint8_t* mine = static_cast<uint8_t*>(out) + offset * es;
        if (counts[r] && mine != in) std::memmove(mine, in, counts[r] * es);
        if (hierarchical) {
          hierarchicalAllGather(ch, out, counts);
        } else {
          ringAllGather(ch, out, counts);
        }
      },
      std::move(cb));
}

RequestPtr Communicator::broadcast(void* buf, size_t count, DataType dtype, int root, Callback cb) {
  checkDataType(OpType::kBroadcast, dtype);
  checkRoot(OpType::kBroadcast, root);
  OpSignature sig{OpType::kBroadcast, dtype, ReduceOp::kSum, root, count};
  const size_t bytes = count * elementSize(dtype);
  return enqueueCollective(
      sig, bytes, [=](Channel& ch) { binomialBroadcast(ch, buf, bytes, root); }, std::move(cb));
}

RequestPtr Communicator::reduce(void* buf, size_t count, DataType dtype, ReduceOp op, int root,
                                Callback cb) {
  checkReduceOp(OpType::kReduce, dtype, op);
  checkRoot(OpType::kReduce, root);
  OpSignature sig{OpType::kReduce, dtype, op, root, count};
  const int r = rank_, n = size_;
  return enqueueCollective(
      sig, count * elementSize(dtype),
      [=](Channel& ch) {
        const size_t bytes = count * elementSize(dtype);
        if (r == root) {
          binomialReduce(ch, buf, count, root);
          if (op == ReduceOp::kAvg) divideInPlace(dtype, buf, count, n);
        } else {
          // Non-roots accumulate their subtree in scratch, leaving `buf` as it was.
          std::vector<uint8_t> scratch(bytes);
          if (bytes) std::memcpy(scratch.data(), buf, bytes);
          binomialReduce(ch, scratch.data(), count, root);
        }
      },
      std::move(cb));
}

RequestPtr Communicator::gather(const void* in, void* out, size_t count, DataType dtype, int root,
                                Callback cb) {
  checkDataType(OpType::kGather, dtype);
  checkRoot(OpType::kGather, root);
  OpSignature sig{OpType::kGather, dtype, ReduceOp::kSum, root, count};
  const size_t bytes = count * elementSize(dtype);
  return enqueueCollective(
      sig, bytes * size_t(size_), [=](Channel& ch) { linearGather(ch, in, out, bytes, root); },
      std::move(cb));
}

RequestPtr Communicator::scatter(const void* in, void* out, size_t count, DataType dtype, int root,
                                 Callback cb) {
  checkDataType(OpType::kScatter, dtype);
  checkRoot(OpType::kScatter, root);
  OpSignature sig{OpType::kScatter, dtype, ReduceOp::kSum, root, count};
  const size_t bytes = count * elementSize(dtype);
  return enqueueCollective(
      sig, bytes * size_t(size_), [=](Channel& ch) { linearScatter(ch, in, out, bytes, root); },
      std::move(cb));
}

RequestPtr Communicator::allToAll(const void* in, std::vector<size_t> sendCounts, void* out,
                                  std::vector<size_t> recvCounts, DataType dtype, Callback cb) {
  checkDataType(OpType::kAllToAll, dtype);
  checkCounts(OpType::kAllToAll, sendCounts, "send counts");
  checkCounts(OpType::kAllToAll, recvCounts, "receive counts");
  CLAWCOMM_ARG_CHECK(sendCounts[rank_] == recvCounts[rank_], opPrefix(OpType::kAllToAll), "rank ",
                     rank_, " sends ", sendCounts[rank_], " elements to itself but expects ",
                     recvCounts[rank_]);
  // Per-pair sizes differ by design, so the count is not part of the
  // signature; each frame's byte count is still checked on arrival.
  OpSignature sig{OpType::kAllToAll, dtype, ReduceOp::kSum, -1, 0};
  const size_t es = elementSize(dtype);
  for (auto& c : sendCounts) c *= es;
  for (auto& c : recvCounts) c *= es;
  return enqueueCollective(
      sig, std::accumulate(sendCounts.begin(), sendCounts.end(), size_t(0)),
      [=](Channel& ch) { pairwiseAllToAll(ch, in, sendCounts, out, recvCounts); }, std::move(cb));
}

RequestPtr Communicator::barrier(Callback cb) {
  OpSignature sig{OpType::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0};
  return enqueueCollective(sig, 0, [](Channel& ch) { disseminationBarrier(ch); }, std::move(cb));
}

RequestPtr Communicator::send(const void* buf, size_t bytes, int peer, uint64_t tag, Callback cb) {
  CLAWCOMM_ARG_CHECK(peer >= 0 && peer < size_, "clawcomm::send: destination rank ", peer,
                     " is out of range for a group of ", size_, " ranks");
  CLAWCOMM_ARG_CHECK(peer != rank_, "clawcomm::send: rank ", rank_, " cannot send to itself");
  return enqueuePointToPoint(true, const_cast<void*>(buf), bytes, peer, tag, std::move(cb));
}

RequestPtr Communicator::recv(void* buf, size_t bytes, int peer, uint64_t tag, Callback cb) {
  CLAWCOMM_ARG_CHECK(peer >= -1 && peer < size_, "clawcomm::recv: source rank ", peer,
                     " is out of range for a group of ", size_, " ranks");
  CLAWCOMM_ARG_CHECK(peer != rank_, "clawcomm::recv: rank ", rank_, " cannot receive from itself");
  CLAWCOMM_ARG_CHECK(peer != -1 || size_ > 1,
                     "clawcomm::recv: no other rank to receive from in a group of 1");
  return enqueuePointToPoint(false, buf, bytes, peer, tag, std::move(cb));
}

// ---------------------------------------------------------------------------
// Queue and progress thread.

RequestPtr Communicator::enqueueCollective(const OpSignature& sig, size_t bytes,
                                           std::function<void(Channel&)> run, Callback cb) {
  auto op = std::make_unique<Op>();
  op->sig = sig;
  op->run = std::move(run);
  op->request = std::make_shared<Request>(std::move(cb));
  RequestPtr request = op->request;
  Traffic::add(messenger_->traffic().of(sig.type).calls, 1);
  bool runHere = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CLAWCOMM_ARG_CHECK(!stopping_, opPrefix(sig.type), "the communicator is shutting down");
    op->sig.seq = nextSeq_++;
    op->record = recorder_.queued(op->sig, -1, bytes);
    // Small and nothing ahead of it: run it right here. The progress thread
    // stays parked until it is done (inlineBusy_), so one thread at a time
    // drives the messenger and issue order is kept.
    runHere = bytes <= settings_.inlineMaxBytes && queue_.empty() && !threadBusy_ && !inlineBusy_;
    if (runHere) {
      inlineBusy_ = true;
      inlineThread_ = std::this_thread::get_id();
    } else {
      queue_.push_back(std::move(op));
    }
  }
  if (!runHere) {
    cv_.notify_one();
    messenger_->wake();  // the progress thread may sleep in a point-to-point wait
    return request;
  }
  runCollective(*op);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inlineBusy_ = false;
    inlineThread_ = std::thread::id();
    // Wake the progress thread only if work arrived meanwhile: a wake-up
    // costs a system call here and a core's worth of scheduling on the
    // peer. Under the lock: if the op's callback dropped the last
    // reference, another thread is destroying this communicator as soon
    // as the progress thread sees inlineBusy_ cleared, and nothing of it
    // may be touched after the unlock.
    if (!queue_.empty() || stopping_ || abortRequested_) cv_.notify_one();
  }
  return request;
}

RequestPtr Communicator::enqueuePointToPoint(bool isSend, void* buf, size_t bytes, int peer,
                                             uint64_t tag, Callback cb) {
  auto op = std::make_unique<Op>();
  op->sig.type = isSend ? OpType::kSend : OpType::kRecv;
  op->pointToPoint = true;
  op->isSend = isSend;
  op->buf = buf;
  op->bytes = bytes;
  op->peer = peer;
  op->tag = tag;
  op->request = std::make_shared<Request>(std::move(cb));
  RequestPtr request = op->request;
  Traffic::add(messenger_->traffic().of(op->sig.type).calls, 1);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CLAWCOMM_ARG_CHECK(!stopping_, opPrefix(op->sig.type), "the communicator is shutting down");
    op->record = recorder_.queued(op->sig, peer, bytes);
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
  // The progress thread may be asleep in messenger_->pause(), waiting for
  // earlier transfers (a receive posted ahead): without this, a send queued
  // now would wait for the next health check (10 ms) before it is written.
  messenger_->wake();
  return request;
}

void Communicator::abort(const std::string& reason) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abortRequested_) return;
    abortRequested_ = true;
    abortReason_ = CLAWCOMM_CONCAT("rank ", rank_, " aborted: ", reason);
    why = abortReason_;
  }
  messenger_->cancel(why);  // wakes a wait in progress, on any thread
  cv_.notify_all();         // wakes an idle progress thread
}

void Communicator::fail(std::exception_ptr error) {
  if (!broken_) {
    broken_ = error;
    messenger_->abort(CLAWCOMM_CONCAT("rank ", rank_, " failed: ", errorText(error)));
  }
  for (auto& op : pointToPoint_) {
    recorder_.finished(op->record, false);
    op->request->complete(error);
  }
  pointToPoint_.clear();
}

std::string Communicator::flightRecord(const std::string& why) const {
  return recorder_.dumpJson(rank_, size_, why);
}

std::string Communicator::flightRecordPath() const {
  return CLAWCOMM_CONCAT(settings_.flightDir, "/", jobToken_, "/rank", rank_, ".json");
}

// Writes the flight record where flightRecordPath() says (best effort: a
// failure here must not hide the error being reported). Returns the path,
// or "" if it could not be written.
std::string Communicator::dumpFlightRecord(const std::string& why) noexcept {
  if (!recorder_.enabled() || settings_.flightDir.empty()) return "";
  try {
    const std::string dir = CLAWCOMM_CONCAT(settings_.flightDir, "/", jobToken_);
    ::mkdir(settings_.flightDir.c_str(), 0777);
    ::mkdir(dir.c_str(), 0777);
    const std::string path = flightRecordPath();
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp);
      f << flightRecord(why) << "\n";
      if (!f) return "";
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) return "";
    return path;
  } catch (...) {
    return "";
  }
}

void Communicator::runCollective(Op& op) {
  if (broken_) {
    recorder_.finished(op.record, false);
    op.request->complete(withContext(
        broken_, CLAWCOMM_CONCAT(opPrefix(op.sig.type),
                                 "the communicator was aborted by an earlier error: ")));
    return;
  }
  std::exception_ptr error;
  const Clock::time_point start = Clock::now();
  recorder_.started(op.record, start);
  try {
    Channel ch(*messenger_, op.sig, start + this->timeout(), settings_, topology_);
    op.run(ch);
  } catch (const TimeoutError&) {
    // "clawcomm::all_reduce: timeout after 5 s: rank 0 timed out waiting
    // for rank 1 to send 16 bytes (0 received)"
    error = withContext(std::current_exception(),
                        CLAWCOMM_CONCAT(opPrefix(op.sig.type), "timeout after ",
                                        timeoutMs_.load() / 1000.0, " s: rank ", rank_, " "));
  } catch (...) {
    error = withContext(std::current_exception(), opPrefix(op.sig.type));
  }
  recorder_.finished(op.record, !error);
  if (error) {
    // The first failure leaves a flight record, named in the error.
    if (!broken_) {
      const std::string path = dumpFlightRecord(errorText(error));
      if (!path.empty()) error = withSuffix(error, CLAWCOMM_CONCAT(" (flight record: ", path, ")"));
    }
    fail(error);
  }
  op.request->complete(error);
}

void Communicator::progressLoop() {
  if (settings_.progressNice > 0) {
    // This thread only: on Linux a thread id names one thread here.
    setpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)), settings_.progressNice);
  }
  Clock::time_point idleSince = Clock::now();
  Clock::time_point stopDeadline = Clock::time_point::max();
  while (true) {
    std::unique_ptr<Op> op;
    std::string abortNow;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (queue_.empty() && pointToPoint_.empty()) {
        threadBusy_ = false;
        cv_.wait(lock, [&] {
          return !inlineBusy_ &&
                 (stopping_ || !queue_.empty() || (abortRequested_ && !abortHandled_));
        });
      }
      // Here this thread drives the messenger (no inline op can run: it
      // waited for none, or it has point-to-point work, which keeps
      // threadBusy_ set).
      if (abortRequested_ && !abortHandled_) {
        abortHandled_ = true;
        abortNow = abortReason_;
      }
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
        threadBusy_ = true;
      } else if (stopping_) {
        if (pointToPoint_.empty()) break;
        // Give in-flight sends and receives a grace period, then fail them.
        if (stopDeadline == Clock::time_point::max()) {
          stopDeadline =
              Clock::now() + std::min<Clock::duration>(this->timeout(), std::chrono::seconds(5));
        }
      }
    }

    if (!abortNow.empty()) fail(std::make_exception_ptr(PeerError(abortNow)));
    if (op) {
      idleSince = Clock::now();
      if (!op->pointToPoint) {
        runCollective(*op);
      } else {
        const Clock::time_point start = Clock::now();
        op->deadline = start + this->timeout();
        recorder_.started(op->record, start);
        if (broken_) {
          recorder_.finished(op->record, false);
          op->request->complete(withContext(
              broken_, CLAWCOMM_CONCAT(opPrefix(op->sig.type),
                                       "the communicator was aborted by an earlier error: ")));
          continue;
        }
        try {
          op->transfer = op->isSend
                             ? messenger_->sendPointToPoint(op->peer, op->tag, op->buf, op->bytes)
                             : messenger_->recvPointToPoint(op->peer, op->tag, op->buf, op->bytes);
          pointToPoint_.push_back(std::move(op));
        } catch (...) {
          std::exception_ptr error = withContext(std::current_exception(), opPrefix(op->sig.type));
          fail(error);
          op->request->complete(error);
        }
      }
    }
    if (pointToPoint_.empty()) continue;

    // Move point-to-point bytes and complete what finished.
    try {
      const bool moved = messenger_->progress();
      for (size_t i = 0; i < pointToPoint_.size();) {
        Op& p = *pointToPoint_[i];
        if (p.transfer->complete) {
          recorder_.finished(p.record, true);
          p.request->complete(nullptr, p.transfer->peer);
          pointToPoint_.erase(pointToPoint_.begin() + long(i));
        } else {
          ++i;
        }
      }
      if (moved || op) {
        idleSince = Clock::now();
      } else if (!pointToPoint_.empty()) {
        std::vector<TransferPtr> waiting;
        Clock::time_point deadline = stopDeadline;
        for (auto& p : pointToPoint_) {
          waiting.push_back(p->transfer);
          deadline = std::min(deadline, p->deadline);
        }
        bool empty;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          empty = queue_.empty();
        }
        if (empty) messenger_->pause(idleSince, deadline, waiting);
      }
    } catch (...) {
      const Op& first = *pointToPoint_.front();
      std::exception_ptr error = withContext(std::current_exception(), opPrefix(first.sig.type));
      if (!broken_) {
        const std::string path = dumpFlightRecord(errorText(error));
        if (!path.empty())
          error = withSuffix(error, CLAWCOMM_CONCAT(" (flight record: ", path, ")"));
      }
      fail(error);
    }
  }
}

}  // namespace clawcomm
