#include "comm/communicator.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <numeric>
#include <set>

#include "algorithms/algorithms.h"
#include "algorithms/channel.h"
#include "comm/op.h"
#include "comm/rendezvous.h"
#include "common/errors.h"
#include "messenger/messenger.h"
#include "reduce/reduce_kernels.h"
#include "transport/registry.h"

namespace clawcomm {

namespace {
// Every live communicator, for shutdownAll().
std::mutex registryMutex;
std::set<Communicator*>& registry() {
  static auto* live = new std::set<Communicator*>();  // never destroyed: used at exit
  return *live;
}
// How many communicators are alive: asked by every collective, so not the
// registry's lock (Settings::inlineMaxBytes says why it matters).
std::atomic<int> liveCommunicators{0};
// The job's flight-record folder: the token of the first communicator made
// while none was alive in this process (torch's default group, made before
// any other), kept while any lives, so that every group of a job writes
// under one folder. Under registryMutex.
std::string jobFolder;
}  // namespace

Connections Communicator::connectThrough(Store& store, int rank, int size,
                                         std::chrono::milliseconds timeout,
                                         const Settings& settings) {
  CLAWCOMM_ARG_CHECK(size >= 1 && rank >= 0 && rank < size, "clawcomm: rank ", rank,
                     " is not in a group of ", size, " ranks");
  checkSettings(settings);
  return rendezvous(store, rank, size, settings, Clock::now() + timeout);
}

void Communicator::checkSettings(const Settings& settings) {
  checkTransportSetting(settings.transport);
  checkAlgorithmSetting(settings.algo);
}

Communicator::Communicator(std::shared_ptr<Store> store, int rank, int size,
                           std::chrono::milliseconds timeout, Settings settings)
    : Communicator(store, rank, size, timeout, settings,
                   connectThrough(*store, rank, size, timeout, settings)) {}

Communicator::Communicator(std::shared_ptr<Store> store, int rank, int size,
                           std::chrono::milliseconds timeout, Settings settings, Connections conns)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      timeoutMs_(timeout.count()),
      settings_(std::move(settings)),
      recorder_(settings_.recorderEntries),
      channelMemory_(std::make_unique<ChannelMemory>()) {
  jobToken_ = conns.jobToken;
  storeNamespace_ = conns.storeNamespace;
  topology_ = Topology(conns.hostOf);
  hosts_ = conns.hosts;
  status_ = std::move(conns.status);
  transports_.resize(size_t(size));
  for (int p = 0; p < size; ++p) transports_[p] = p == rank ? "self" : conns.toRank[p]->kind();
  const int localRanks = conns.sameHostRanks;
  cpu_set_t cpus;
  const int cores = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  const bool oversubscribed = localRanks > cores;
  if (settings_.spinMicros < 0) settings_.spinMicros = oversubscribed ? 5 : 50;
  if (settings_.yieldMicros < 0) settings_.yieldMicros = oversubscribed ? 1000 : 0;
  // Oversubscribed, callers driving sends and receives were slower: a torch
  // isend/irecv pair at 4 ranks on 2 cores, 64 KiB, 173-308 us against 123-129.
  callersDrive_ = !oversubscribed && settings_.inlineMaxBytes > 0;
  messenger_ = std::make_unique<Messenger>(rank, size, std::move(conns.toRank),
                                           settings_.spinMicros, settings_.yieldMicros);
  messenger_->spinForReads(!oversubscribed && settings_.spinMicros > 0);
  if (status_) {
    StatusPages* pages = status_.get();
    messenger_->setStallWatch([pages](int peer) { pages->stalled(peer); });
  }
  // The group's epoch: its random token's low bits, new for every group (a
  // rebuilt one included).
  messenger_->setEpoch(uint32_t(std::stoull(jobToken_.empty() ? "0" : jobToken_, nullptr, 16)));
  // The progress thread takes its nice value before the communicator is
  // returned, so that no work runs at the wrong priority and a caller that
  // looks sees it set.
  std::promise<void> niced;
  thread_ = std::thread([this, &niced] {
    if (settings_.progressNice > 0) {
      // This thread only: on Linux a thread id names one thread here.
      setpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)), settings_.progressNice);
    }
    niced.set_value();
    progressLoop();
  });
  niced.get_future().wait();
  liveCommunicators.fetch_add(1);
  std::lock_guard<std::mutex> lock(registryMutex);
  registry().insert(this);
  if (jobFolder.empty()) jobFolder = jobToken_;
}

std::shared_ptr<Communicator> Communicator::create(std::shared_ptr<Store> store, int rank, int size,
                                                   std::chrono::milliseconds timeout,
                                                   Settings settings) {
  return own(new Communicator(std::move(store), rank, size, timeout, std::move(settings)));
}

std::shared_ptr<Communicator> Communicator::own(Communicator* c) {
  return std::shared_ptr<Communicator>(c, [](Communicator* c) {
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
  liveCommunicators.fetch_sub(1);
  std::lock_guard<std::mutex> lock(registryMutex);
  registry().erase(this);
  if (registry().empty()) jobFolder.clear();  // the next group made starts a new job's folder
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

size_t Communicator::singleCopyFrom(int peer) const {
  transportOf(peer);  // checks the rank
  return peer == rank_ ? SIZE_MAX : messenger_->singleCopyFrom(peer);
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
  Traffic::add(t.bytesSent, sent);
  Traffic::add(t.payloadSent, sent);
  Traffic::add(t.bytesReceived, received);
  Traffic::add(t.payloadReceived, received);
}

// ---------------------------------------------------------------------------
// Queue and progress thread.

thread_local bool Communicator::Blocking::active_ = false;

std::unique_ptr<Communicator::Op> Communicator::takeOpLocked() {
  return spareOp_ ? std::move(spareOp_) : std::make_unique<Op>();
}

RequestPtr Communicator::takeRequestLocked(Callback cb) {
  if (spareRequest_ && spareRequest_.use_count() == 1) {
    // Its last other holder let go with a release; see its writes.
    std::atomic_thread_fence(std::memory_order_acquire);
    spareRequest_->reuse(std::move(cb));
  } else {
    spareRequest_ = std::make_shared<Request>(std::move(cb));
  }
  return spareRequest_;
}

void Communicator::checkAcceptingLocked(OpType type) const {
  CLAWCOMM_ARG_CHECK(!stopping_, opPrefix(type), "the communicator is shutting down");
  CLAWCOMM_ARG_CHECK(!suspended_, opPrefix(type),
                     "the group is suspended; every rank calls resume() first");
}

bool Communicator::runHereOrQueueLocked(bool allowed, std::unique_ptr<Op>& op) {
  if (allowed && queue_.empty() && !threadBusy_ && !inlineBusy_) {
    inlineBusy_ = true;
    inlineThread_ = std::this_thread::get_id();
    return true;
  }
  queue_.push_back(std::move(op));
  enqueued_.fetch_add(1, std::memory_order_release);
  return false;
}

RequestPtr Communicator::enqueueCollective(const OpSignature& sig, size_t bytes,
                                           std::function<void(Channel&)> run, Callback cb) {
  if (estimating_.load(std::memory_order_acquire)) {
    return estimateOnly(
        operationCost(sig.type, sig.algo, double(bytes), topology_, settings_.costModel),
        std::move(cb));
  }
  Traffic::add(messenger_->traffic().of(sig.type).calls, 1);
  std::unique_ptr<Op> op;
  RequestPtr request;
  bool runHere = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checkAcceptingLocked(sig.type);
    op = takeOpLocked();
    op->sig = sig;
    op->run = std::move(run);
    op->request = request = takeRequestLocked(std::move(cb));
    op->sig.seq = nextSeq_++;
    op->record = recorder_.queued(op->sig, -1, bytes);
    if (status_) status_->called(op->sig);
    // Small and nothing ahead of it: run it right here. The progress thread
    // stays parked until it is done (inlineBusy_), so one thread at a time
    // drives the messenger and issue order is kept.
    // CLAWCOMM_INLINE_BYTES=0 keeps every collective off the caller's
    // thread, a blocking call's too.
    // One the caller does not wait for: only while no other group of this
    // process could need the caller meanwhile (Settings::inlineMaxBytes).
    const bool inlineAllowed = (Blocking::active() && settings_.inlineMaxBytes > 0) ||
                               (bytes <= settings_.inlineMaxBytes &&
                                liveCommunicators.load(std::memory_order_relaxed) == 1);
    runHere = runHereOrQueueLocked(inlineAllowed, op);
  }
  if (!runHere) {
    cv_.notify_one();
    messenger_->wake();  // the progress thread may sleep in a point-to-point wait
    return request;
  }
  runCollective(*op);
  *op = Op();  // its closure's captures go now, on this thread
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!spareOp_) spareOp_ = std::move(op);
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
  if (estimating_.load(std::memory_order_acquire)) {
    return estimateOnly(pointToPointCost(isSend ? rank_ : farthestFrom(peer), isSend ? peer : rank_,
                                         double(bytes), topology_, settings_.costModel),
                        std::move(cb));
  }
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
  bool runHere;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checkAcceptingLocked(op->sig.type);
    op->record = recorder_.queued(op->sig, peer, bytes);
    // Nothing ahead of it and nobody driving: post it here, with one pass
    // that writes its frame (or reference), and leave it to the caller's
    // wait (drive()). Posting never blocks, so unlike an inline collective
    // this needs no check for other groups. CLAWCOMM_INLINE_BYTES=0, or
    // an oversubscribed host, keeps it on the progress thread.
    runHere = runHereOrQueueLocked(callersDrive_, op);
  }
  if (runHere) {
    Clock::time_point idleSince = Clock::now();
    startPointToPoint(std::move(op));
    if (!pointToPoint_.empty()) progressPointToPoint(true, idleSince, Clock::time_point::max());
    releaseDrive();
    return request;
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
    if (failure_.empty()) failure_ = why;
    failed_ = true;
  }
  messenger_->cancel(why);  // wakes a wait in progress, on any thread
  cv_.notify_all();         // wakes an idle progress thread
  notifyFailure(why);
}

void Communicator::fail(std::exception_ptr error) {
  if (!broken_) {
    broken_ = error;
    const std::string why = errorText(error);
    std::string culprit;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_.empty()) failure_ = why;
      failed_ = true;
      culprit = culprit_;
    }
    // The peers read a reason of kAbortReasonBytes at most: where the
    // whole error does not fit, the culprit goes first.
    std::string told = CLAWCOMM_CONCAT("rank ", rank_, " failed: ", why);
    if (told.size() >= kAbortReasonBytes && !culprit.empty()) {
      told = CLAWCOMM_CONCAT("rank ", rank_, " failed, ", culprit, ": ", why);
    }
    messenger_->abort(told);
    notifyFailure(why);
  }
  for (auto& op : pointToPoint_) {
    recorder_.finished(op->record, false);
    op->request->complete(error);
  }
  pointToPoint_.clear();
}

void Communicator::notifyFailure(const std::string& reason) {
  std::lock_guard<std::mutex> lock(listenersMutex_);
  if (notified_) return;
  notified_ = true;
  for (auto& [id, f] : listeners_) f(reason);
}

int Communicator::addFailureListener(std::function<void(const std::string&)> f) {
  std::lock_guard<std::mutex> lock(listenersMutex_);
  listeners_[nextListener_] = std::move(f);
  return nextListener_++;
}

void Communicator::removeFailureListener(int id) {
  std::lock_guard<std::mutex> lock(listenersMutex_);
  listeners_.erase(id);
}

std::string Communicator::failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::string Communicator::setupNamespace(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  return CLAWCOMM_CONCAT(storeNamespace_, what, "/", setups_++, "/");
}

uint64_t Communicator::beginExternal(OpSignature& sig, uint64_t bytes, int peer) {
  Traffic::add(messenger_->traffic().of(sig.type).calls, 1);
  std::lock_guard<std::mutex> lock(mutex_);
  checkAcceptingLocked(sig.type);
  if (!failure_.empty()) {
    throw PeerError(CLAWCOMM_CONCAT(
        opPrefix(sig.type), "the communicator was aborted by an earlier error: ", failure_));
  }
  const bool collective = sig.type != OpType::kSend && sig.type != OpType::kRecv;
  if (collective) sig.seq = nextSeq_++;
  const uint64_t id = recorder_.queued(sig, peer, bytes);
  recorder_.started(id, Clock::now());
  // The page shows it called, and endExternal completed, by the record's id
  // (none with the recorder off: then the page leaves device calls out).
  if (collective && status_ && id != 0) {
    status_->called(sig);
    std::lock_guard<std::mutex> seqs(externalMutex_);
    externalSeqs_[id] = sig.seq;
  }
  return id;
}

void Communicator::endExternal(uint64_t record, bool ok) {
  recorder_.finished(record, ok);
  if (!status_ || record == 0) return;
  std::lock_guard<std::mutex> seqs(externalMutex_);
  const auto it = externalSeqs_.find(record);
  if (it == externalSeqs_.end()) return;
  status_->completed(it->second, ok);
  externalSeqs_.erase(it);
}

void Communicator::setGlobalRanks(std::vector<int> ranks) {
  CLAWCOMM_ARG_CHECK(ranks.empty() || int(ranks.size()) == size_, "clawcomm: ", ranks.size(),
                     " global ranks for a group of ", size_);
  bool identity = true;
  for (size_t i = 0; i < ranks.size(); ++i) identity = identity && ranks[i] == int(i);
  globalRanks_ = identity ? std::vector<int>{} : std::move(ranks);
}

std::string Communicator::flightJobFolder() const {
  std::lock_guard<std::mutex> lock(registryMutex);
  return jobFolder.empty() ? jobToken_ : jobFolder;
}

}  // namespace clawcomm
