// The completion handle of one queued operation.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace clawcomm {

// Completion happens in three steps (complete()):
//   1. the operation is marked done, with its error;
//   2. the callback runs (on the thread that completes it);
//   3. waiters on other threads wake.
// The callback sees its operation done: isCompleted() and exception() say
// so, and waitFor() returns at once on that thread (the torch adapter's
// callback completes a future whose then-callbacks may wait for the op:
// they used to wait for themselves, for ever). Other threads see the op
// done only after step 3, because the callback writes the op's results
// into the caller's buffers (the adapter's copy back of a staged or
// non-contiguous tensor): a thread that wakes or polls must find them
// there, and find an error the callback raised.
class Request {
 public:
  // Runs when the operation ends, with nullptr on success or the error; an
  // exception it throws becomes the operation's error (when it had none).
  using Callback = std::function<void(std::exception_ptr)>;

  explicit Request(Callback callback) : callback_(std::move(callback)) {}

  // Makes a completed request new again, for another operation with
  // `callback`: the communicator keeps one (comm/communicator.cc), and
  // calls this only while it holds the sole reference (no waiter, no
  // completer), so every field is reset and nobody can see it half done.
  void reuse(Callback callback) {
    std::lock_guard<std::mutex> lock(mutex_);
    callback_ = std::move(callback);
    done_ = false;
    settled_ = false;
    completer_ = std::thread::id();
    error_ = nullptr;
    source_ = -1;
  }

  bool isCompleted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return doneHere();
  }

  // Waits until the operation ends; false if `timeout` passed first.
  // A negative timeout waits for ever.
  bool waitFor(std::chrono::milliseconds timeout) const {
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout.count() < 0) {
      cv_.wait(lock, [&] { return doneHere(); });
      return true;
    }
    return cv_.wait_for(lock, timeout, [&] { return doneHere(); });
  }

  // Waits for ever, then throws the operation's error, if any.
  void wait() const {
    waitFor(std::chrono::milliseconds(-1));
    if (auto e = exception()) std::rethrow_exception(e);
  }

  std::exception_ptr exception() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  // isCompleted(), and if so exception() and sourceRank(), under one lock
  // (the torch adapter's blocking calls ask all three).
  bool completedWith(std::exception_ptr& error, int& source) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!doneHere()) return false;
    error = error_;
    source = source_;
    return true;
  }

  // The rank a receive from any source matched; -1 otherwise.
  int sourceRank() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return source_;
  }

  // Called once, by the engine (see the class comment).
  // The callback is taken out to run: its captures (the caller's buffers)
  // go once the waiters have woken, not with the request, which the
  // communicator may keep for another operation (reuse()).
  void complete(std::exception_ptr error, int source = -1) {
    Callback callback;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = error;
      source_ = source;
      completer_ = std::this_thread::get_id();
      callback.swap(callback_);
    }
    if (callback) {
      try {
        callback(error);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      settled_ = true;
    }
    cv_.notify_all();
  }

 private:
  // Under mutex_: done for the calling thread.
  bool doneHere() const { return settled_ || (done_ && completer_ == std::this_thread::get_id()); }

  Callback callback_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;     // step 1
  bool settled_ = false;  // step 3
  std::thread::id completer_;
  std::exception_ptr error_;
  int source_ = -1;
};

using RequestPtr = std::shared_ptr<Request>;

}  // namespace clawcomm
