// A doorbell lets a rank sleep until a peer on the same host makes progress
// possible for it, instead of polling.
//
// It lives in shared memory (one per rank, in the rank's own segment) and is
// a futex word plus a "someone sleeps here" flag:
//   sleeper: arm() (flag := 1, full fence, read the sequence), re-check every
//            ring, then sleep(seen) blocks in FUTEX_WAIT unless the sequence
//            moved since arm(); disarm() clears the flag.
//   waker:   after publishing bytes (or freeing ring space), ring() issues a
//            full fence and, only if the flag is set, bumps the sequence and
//            calls FUTEX_WAKE.
// The two fences order "flag, then re-check" against "publish, then read
// flag" (Dekker), so a wake-up is never lost, and a waker whose peer is
// awake pays one fence and one load: no system call.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace clawcomm {

struct alignas(64) Doorbell {
  std::atomic<uint32_t> sequence{0};
  std::atomic<uint32_t> sleeping{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "doorbell needs lock-free atomics");

// Waker side.
void ringDoorbell(Doorbell& d);

// Sleeper side. Returns the sequence to pass to sleepOnDoorbell().
uint32_t armDoorbell(Doorbell& d);
// Blocks until rung, `timeout` passes, or a signal; returns at once if the
// doorbell rang since armDoorbell() returned `seen`.
void sleepOnDoorbell(Doorbell& d, uint32_t seen, std::chrono::microseconds timeout);
void disarmDoorbell(Doorbell& d);

}  // namespace clawcomm
