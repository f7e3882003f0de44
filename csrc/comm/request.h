// The completion handle of one queued operation.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace clawcomm {

class Request {
 public:
  // Runs on the progress thread when the operation ends, before waiters wake:
  // with nullptr on success, or the error.
  using Callback = std::function<void(std::exception_ptr)>;

  explicit Request(Callback callback) : callback_(std::move(callback)) {}

  bool isCompleted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

  // Waits until the operation ends; false if `timeout` passed first.
  // A negative timeout waits for ever.
  bool waitFor(std::chrono::milliseconds timeout) const {
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout.count() < 0) {
      cv_.wait(lock, [&] { return done_; });
      return true;
    }
    return cv_.wait_for(lock, timeout, [&] { return done_; });
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

  // The rank a receive from any source matched; -1 otherwise.
  int sourceRank() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return source_;
  }

  // Called once, by the engine.
  void complete(std::exception_ptr error, int source = -1) {
    if (callback_) {
      try {
        callback_(error);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = error;
      source_ = source;
    }
    cv_.notify_all();
  }

 private:
  Callback callback_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  int source_ = -1;
};

using RequestPtr = std::shared_ptr<Request>;

}  // namespace clawcomm
