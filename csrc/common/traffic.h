// Per-operation traffic counters: what went over the wire, measured where
// frames are written and read, so compression ratios are observed rather
// than computed. Updated by the thread that drives the messenger and read
// from any thread (relaxed atomics: each counter is exact, a snapshot of
// several is not atomic as a whole).
#pragma once

#include <atomic>
#include <cstdint>

#include "common/op.h"

namespace clawcomm {

struct OpTraffic {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> framesSent{0};
  std::atomic<uint64_t> bytesSent{0};    // whole frames: header, payload, padding
  std::atomic<uint64_t> payloadSent{0};  // payload only
  std::atomic<uint64_t> framesReceived{0};
  std::atomic<uint64_t> bytesReceived{0};
  std::atomic<uint64_t> payloadReceived{0};
  // Of those, frames whose payload moved by single copy (messenger.h).
  std::atomic<uint64_t> framesSentByReference{0};
  std::atomic<uint64_t> framesReceivedByReference{0};
  // Microseconds the collectives of this kind ran, start to end (on the
  // thread that ran them: the progress thread, or the caller's inline).
  std::atomic<uint64_t> busyUs{0};
};

struct Traffic {
  OpTraffic ops[kNumOpTypes];

  OpTraffic& of(OpType t) { return ops[int(t)]; }
  // Any thread (calls are counted on the callers' threads).
  static void add(std::atomic<uint64_t>& c, uint64_t n) {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  // The thread driving the messenger only (one at a time): a plain load and
  // store, no locked instruction on the per-frame path.
  static void bump(std::atomic<uint64_t>& c, uint64_t n) {
    c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
};

}  // namespace clawcomm
