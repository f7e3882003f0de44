// The key-value store used for rendezvous.
//
// The torch adapter wraps the c10d::Store that torch.distributed hands to the
// backend (already prefixed per group); other front ends can wrap anything
// with set and a blocking get.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace clawcomm {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until `key` exists (up to the store's own timeout), then returns it.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
};

}  // namespace clawcomm
