// The communicator's scheduler: the progress thread that takes queued
// operations in issue order and runs them. A collective runs to its end on
// this thread; a send or receive is started and then progressed alongside
// the others in flight until its transfer completes. Between operations the
// thread spins briefly, then sleeps on the condition variable; with only
// sends and receives in flight it hands waiting to the messenger's policy
// (messenger/waits.cc).
#include <unistd.h>

#include "algorithms/channel.h"
#include "comm/communicator.h"
#include "comm/op.h"

namespace clawcomm {

bool Communicator::completeIfBroken(Op& op) {
  if (!broken_) return false;
  recorder_.finished(op.record, false);
  if (status_ && !op.pointToPoint) status_->completed(op.sig.seq, false);
  op.request->complete(
      withContext(broken_, CLAWCOMM_CONCAT(opPrefix(op.sig.type),
                                           "the communicator was aborted by an earlier error: ")));
  return true;
}

void Communicator::runCollective(Op& op) {
  if (completeIfBroken(op)) return;
  std::exception_ptr error;
  bool timedOut = false, mismatched = false;
  double late = 0;  // seconds the timeout was seen past its deadline
  const Clock::time_point start = Clock::now();
  recorder_.started(op.record, start);
  try {
    Channel ch(*messenger_, op.sig, start + this->timeout(), settings_, topology_, &scratch_,
               channelMemory_.get());
    op.run(ch);
  } catch (const TimeoutError&) {
    // "clawcomm::all_reduce: timeout after 5 s: rank 0 timed out waiting
    // for rank 1 to send 16 bytes (0 received)"
    error = withContext(std::current_exception(),
                        CLAWCOMM_CONCAT(opPrefix(op.sig.type), "timeout after ",
                                        timeoutMs_.load() / 1000.0, " s: rank ", rank_, " "));
    timedOut = true;
    late = std::chrono::duration<double>(Clock::now() - (start + this->timeout())).count();
  } catch (const MismatchError&) {
    error = withContext(std::current_exception(), opPrefix(op.sig.type));
    mismatched = true;
  } catch (...) {
    error = withContext(std::current_exception(), opPrefix(op.sig.type));
  }
  recorder_.finished(op.record, !error);
  if (timedOut || mismatched) error = withCulprits(error, op.sig, timedOut, late);
  if (status_) status_->completed(op.sig.seq, !error);
  const auto ran = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
  Traffic::add(messenger_->traffic().of(op.sig.type).busyUs, uint64_t(ran.count()));
  if (error) {
    error = withFlightRecord(error);
    fail(error);
  }
  op.request->complete(error);
}

void Communicator::idleSpin(std::unique_lock<std::mutex>& lock) {
  // Poll for the next operation a while before sleeping: waking this thread
  // from the condition variable costs tens of microseconds, which a run of
  // point-to-point calls would pay every time. Only the counter is read
  // meanwhile; an inline collective may run.
  if (settings_.spinMicros <= 0 || stopping_ || abortRequested_) return;
  const uint64_t seen = enqueued_.load(std::memory_order_acquire);
  lock.unlock();
  const auto until = Clock::now() + std::chrono::microseconds(settings_.spinMicros);
  while (enqueued_.load(std::memory_order_acquire) == seen && Clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  lock.lock();
}

bool Communicator::nextWork(std::vector<std::unique_ptr<Op>>& ops, std::string& abortNow,
                            Clock::time_point& stopDeadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (auto& op : ops) {
    if (op && !spareOp_) spareOp_ = std::move(op);
  }
  ops.clear();
  bool spun = false;
  while (true) {
    // pointToPoint_ is read only while no caller drives (inlineBusy_).
    if (!inlineBusy_) {
      if (stopping_ || !queue_.empty() || (abortRequested_ && !abortHandled_)) break;
      // Its own sends and receives, or ones a caller started and has not
      // driven for kCallerGrace (it may never wait for them).
      if (!pointToPoint_.empty() && (threadBusy_ || Clock::now() >= callerDrove_ + kCallerGrace)) {
        break;
      }
    }
    threadBusy_ = false;
    // While callers drive their sends and receives (and for a while after
    // the last), look at them every kCallerGrace instead of sleeping until
    // notified: a caller then posts and finishes one without waking this
    // thread.
    if (Clock::now() < callerDrove_ + kCallerWatch || (!inlineBusy_ && !pointToPoint_.empty())) {
      threadWatching_ = true;
      cv_.wait_for(lock, kCallerGrace);
      threadWatching_ = false;
      continue;
    }
    if (!spun && !inlineBusy_) {
      spun = true;
      idleSpin(lock);
      continue;
    }
    cv_.wait(lock);
  }
  // Here this thread drives the messenger (no caller can: threadBusy_ stays
  // set while it has sends or receives in flight).
  threadBusy_ = true;
  if (abortRequested_ && !abortHandled_) {
    abortHandled_ = true;
    abortNow = abortReason_;
  }
  if (!queue_.empty()) {
    // One collective, or every send and receive at the queue's head: they
    // all start before the messenger's next pass, so a send/recv pair
    // issued as receive then send posts its send (a single-copy reference
    // the peer reads meanwhile) before this thread spends a pass reading
    // the peer's payload. Posted one per pass, the two ranks' reads ran one
    // after the other (a 4 MiB pair: 400 us, against 210 with the reads at
    // once and 160 for the bare copy).
    const bool pointToPoint = queue_.front()->pointToPoint;
    do {
      ops.push_back(std::move(queue_.front()));
      queue_.pop_front();
    } while (pointToPoint && !queue_.empty() && queue_.front()->pointToPoint);
  } else if (stopping_) {
    if (pointToPoint_.empty()) return false;
    // Give in-flight sends and receives a grace period, then fail them.
    if (stopDeadline == Clock::time_point::max()) {
      stopDeadline =
          Clock::now() + std::min<Clock::duration>(this->timeout(), std::chrono::seconds(5));
    }
  }
  return true;
}

void Communicator::startPointToPoint(std::unique_ptr<Op> op) {
  const Clock::time_point start = Clock::now();
  op->deadline = start + this->timeout();
  recorder_.started(op->record, start);
  if (completeIfBroken(*op)) return;
  try {
    op->transfer = op->isSend ? messenger_->sendPointToPoint(op->peer, op->tag, op->buf, op->bytes)
                              : messenger_->recvPointToPoint(op->peer, op->tag, op->buf, op->bytes);
    pointToPoint_.push_back(std::move(op));
  } catch (...) {
    std::exception_ptr error = withContext(std::current_exception(), opPrefix(op->sig.type));
    fail(error);
    op->request->complete(error);
  }
}

void Communicator::progressPointToPoint(bool startedOne, Clock::time_point& idleSince,
                                        Clock::time_point stopDeadline) {
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
    if (moved || startedOne) {
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
    fail(withFlightRecord(withContext(std::current_exception(), opPrefix(first.sig.type))));
  }
}

void Communicator::progressLoop() {
  Clock::time_point idleSince = Clock::now();
  Clock::time_point stopDeadline = Clock::time_point::max();
  std::vector<std::unique_ptr<Op>> ops;
  while (true) {
    std::string abortNow;
    if (!nextWork(ops, abortNow, stopDeadline)) break;
    if (!abortNow.empty()) fail(std::make_exception_ptr(PeerError(abortNow)));
    const bool started = !ops.empty();
    if (started) idleSince = Clock::now();
    for (auto& op : ops) {
      if (op->pointToPoint) {
        startPointToPoint(std::move(op));
      } else {
        runCollective(*op);
      }
    }
    if (!pointToPoint_.empty()) progressPointToPoint(started, idleSince, stopDeadline);
    // A collective's op (its buffers, its callback's captures) is emptied
    // now, not when the next work wakes this thread: held until then, the
    // last call's tensors outlived it (the chaos soak saw its memory floor
    // rise). nextWork keeps the emptied op for the next collective.
    for (auto& op : ops) {
      if (op) *op = Op();
    }
  }
}

void Communicator::drive(const Request& request, Clock::time_point until) {
  const uint64_t queued = enqueued_.load(std::memory_order_acquire);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!callersDrive_ || !queue_.empty() || threadBusy_ || inlineBusy_ || pointToPoint_.empty() ||
        request.isCompleted()) {
      return;
    }
    inlineBusy_ = true;
    inlineThread_ = std::this_thread::get_id();
  }
  Clock::time_point idleSince = Clock::now();
  // Until it is done, or until work queued meanwhile (by another thread)
  // needs the progress thread, or an abort, which that thread handles.
  while (!pointToPoint_.empty() && !request.isCompleted() && !failed_.load() &&
         enqueued_.load(std::memory_order_acquire) == queued && Clock::now() < until) {
    progressPointToPoint(false, idleSince, until);
  }
  releaseDrive();
}

void Communicator::releaseDrive() {
  std::lock_guard<std::mutex> lock(mutex_);
  inlineBusy_ = false;
  inlineThread_ = std::thread::id();
  callerDrove_ = Clock::now();
  // Under the lock, as in enqueueCollective: once it is released the
  // communicator may be destroyed by another thread.
  // A thread that watches (nextWork) finds the sends and receives left in
  // flight by itself.
  if (!queue_.empty() || stopping_ || abortRequested_ ||
      (!pointToPoint_.empty() && !threadWatching_)) {
    cv_.notify_one();
  }
}

}  // namespace clawcomm
