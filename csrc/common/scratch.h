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

#include <cstddef>
#include <cstdint>
#include <memory>

namespace clawcomm {

enum ScratchSlot { kOpScratch = 0, kAlgorithmScratch = 1, kScratchSlots = 2 };

class Scratch {
 public:
  // At least `bytes` bytes of uninitialised memory, valid until the next
  // get() of the same slot.
  uint8_t* get(ScratchSlot slot, size_t bytes) {
    Buffer& b = slots_[slot];
    if (bytes > b.size) {
      b.data.reset();  // before the new one: never hold both
      b.data.reset(new uint8_t[bytes]);
      b.size = bytes;
    }
    return b.data.get();
  }

 private:
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t size = 0;
  };
  Buffer slots_[kScratchSlots];
};

}  // namespace clawcomm
