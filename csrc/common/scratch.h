// Working memory that a communicator's collectives reuse from call to call.
//
// A buffer allocated per call (reduce-scatter's working copy, a non-root's
// partial sums) costs a page fault per 4 KiB page every time above glibc's
// mmap threshold (32 MiB at most): a fresh mapping, zeroed by the kernel,
// unmapped again at the end. That made a 64 MiB reduce-scatter 2.3x the
// time of the whole all-reduce. Buffers here grow to the largest request,
// are never zeroed, and live as long as the communicator.
//
// Collectives of one communicator run one at a time, so one set of buffers
// serves them all; an operation and the algorithm it runs take different
// slots, so both can hold one at once.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

namespace clawcomm {

enum ScratchSlot { kOpScratch = 0, kAlgorithmScratch = 1, kScratchSlots = 2 };

class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    for (Buffer& b : slots_) release(b);
  }

  // At least `bytes` bytes of uninitialised memory, valid until the next
  // get() of the same slot. Mapped on its own, on transparent huge pages
  // where the kernel allows (madvise): a peer's single-copy read of it pins
  // one 2 MiB page where it would pin 512 small ones, about three times as
  // fast here.
  // What the slots hold now, and giving it back (Communicator::suspend).
  size_t bytes() const {
    size_t total = 0;
    for (const Buffer& b : slots_) total += b.size;
    return total;
  }
  void releaseAll() {
    for (Buffer& b : slots_) release(b);
  }

  uint8_t* get(ScratchSlot slot, size_t bytes) {
    Buffer& b = slots_[slot];
    if (bytes > b.size) {
      release(b);  // before the new one: never hold both
      const size_t unit = bytes < kHugePage ? size_t(4096) : kHugePage;
      const size_t size = (bytes + unit - 1) & ~(unit - 1);
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      madvise(p, size, MADV_HUGEPAGE);  // advice: refused (no THP) is fine
      b.data = static_cast<uint8_t*>(p);
      b.size = size;
    }
    return b.data;
  }

 private:
  static constexpr size_t kHugePage = size_t(2) << 20;
  struct Buffer {
    uint8_t* data = nullptr;
    size_t size = 0;
  };
  static void release(Buffer& b) {
    if (b.data) munmap(b.data, b.size);
    b = Buffer{};
  }
  Buffer slots_[kScratchSlots];
};

}  // namespace clawcomm
