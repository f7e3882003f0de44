#include "transport/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace clawcomm {
namespace {

// Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

void ringDoorbell(Doorbell& d) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (d.sleeping.load(std::memory_order_relaxed) == 0) return;
  d.sequence.fetch_add(1, std::memory_order_seq_cst);
  futex(&d.sequence, FUTEX_WAKE, INT_MAX, nullptr);
}

uint32_t armDoorbell(Doorbell& d) {
  d.sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return d.sequence.load(std::memory_order_relaxed);
}

void sleepOnDoorbell(Doorbell& d, uint32_t seen, std::chrono::microseconds timeout) {
  const long long us = timeout.count() < 0 ? 0 : timeout.count();
  const timespec ts{time_t(us / 1000000), long(us % 1000000) * 1000};
  futex(&d.sequence, FUTEX_WAIT, seen, &ts);
}

void disarmDoorbell(Doorbell& d) {
  d.sleeping.store(0, std::memory_order_relaxed);
}

}  // namespace clawcomm
