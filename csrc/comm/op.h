// The communicator's queued operation and the error wrapping its two halves
// share: communicator.cc (the operations: setup, enqueueing, failure) and
// scheduler.cc (the progress thread that runs them). Internal to csrc/comm.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>

#include "comm/communicator.h"
#include "common/errors.h"
#include "messenger/messenger.h"

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

// The same error type as `e`, saying `text`.
inline std::exception_ptr retyped(std::exception_ptr e, const std::string& text) {
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError&) {
    return std::make_exception_ptr(TimeoutError(text));
  } catch (const PeerError&) {
    return std::make_exception_ptr(PeerError(text));
  } catch (const MismatchError&) {
    return std::make_exception_ptr(MismatchError(text));
  } catch (const InvalidArgument&) {
    return std::make_exception_ptr(InvalidArgument(text));
  } catch (...) {
    return std::make_exception_ptr(Error(text));
  }
}

inline std::string errorText(std::exception_ptr e);

// The same error type as `e`, with `prefix` before its text and `suffix`
// after it.
inline std::exception_ptr rewrapped(std::exception_ptr e, const std::string& prefix,
                                    const std::string& suffix) {
  return retyped(e, prefix + errorText(e) + suffix);
}

inline std::exception_ptr withContext(std::exception_ptr e, const std::string& message) {
  return rewrapped(e, message, "");
}

inline std::exception_ptr withSuffix(std::exception_ptr e, const std::string& suffix) {
  return rewrapped(e, "", suffix);
}

inline std::string errorText(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace clawcomm
