// The key-value store used for rendezvous.
//
// The torch adapter wraps the c10d::Store that torch.distributed hands to the
// backend (already prefixed per group); other front ends can wrap anything
// with set, a get that waits until a deadline, an atomic add and an atomic
// compare-and-set.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/clock.h"

namespace clawcomm {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until `key` exists, then returns it; throws TimeoutError (which
  // names the key) if it does not exist by `deadline`.
  virtual std::vector<uint8_t> get(const std::string& key, Clock::time_point deadline) = 0;
  // Adds `delta` to the integer at `key` (0 when absent) and returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets `key` to `desired` if it holds `expected` (an absent key holds "");
  // returns whether it did. The integers of add() are stored as decimal text.
  virtual bool compareSet(const std::string& key, const std::string& expected,
                          const std::string& desired) = 0;
};

}  // namespace clawcomm
