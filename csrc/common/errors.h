// Error types of the engine.
//
// Two families, as in gloo: recoverable failures that a caller may catch and
// report (a peer died, a wait timed out, ranks disagree about an operation,
// a bad argument), and broken invariants (CLAWCOMM_CHECK), which print both
// sides of the failed comparison and mean a bug in clawcomm itself.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace clawcomm {

// Base of every error the engine raises on purpose.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A caller passed something the operation cannot accept. Raised before any
// byte is sent.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A wait exceeded the group's timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer died, closed its connection, or aborted the communicator.
class PeerError : public Error {
 public:
  using Error::Error;
};

// Ranks called different collectives, or the same one with different
// arguments.
class MismatchError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
[[noreturn]] void checkFailed(const char* file, int line, const std::string& msg);
}  // namespace detail

#define CLAWCOMM_CONCAT(...) ::clawcomm::detail::concat(__VA_ARGS__)

// Invariant checks: a failure is a clawcomm bug; the message shows both values.
#define CLAWCOMM_CHECK(cond, ...)                                                                  \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      ::clawcomm::detail::checkFailed(__FILE__, __LINE__,                                          \
                                      CLAWCOMM_CONCAT("check failed: " #cond " ", ##__VA_ARGS__)); \
    }                                                                                              \
  } while (0)

#define CLAWCOMM_CHECK_EQ(a, b, ...)                                                           \
  do {                                                                                         \
    const auto& va_ = (a);                                                                     \
    const auto& vb_ = (b);                                                                     \
    if (!(va_ == vb_)) {                                                                       \
      ::clawcomm::detail::checkFailed(__FILE__, __LINE__,                                      \
                                      CLAWCOMM_CONCAT("check failed: " #a " == " #b " (", va_, \
                                                      " vs ", vb_, ") ", ##__VA_ARGS__));      \
    }                                                                                          \
  } while (0)

// Argument validation: throws InvalidArgument with a message that names the op.
#define CLAWCOMM_ARG_CHECK(cond, ...)                                  \
  do {                                                                 \
    if (!(cond)) {                                                     \
      throw ::clawcomm::InvalidArgument(CLAWCOMM_CONCAT(__VA_ARGS__)); \
    }                                                                  \
  } while (0)

}  // namespace clawcomm
