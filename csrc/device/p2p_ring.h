// Where the messages from one rank to another go in the sender's ring for
// that peer (device/protocol.h's point-to-point), computed alike by the
// sender and the receiver from the sizes of the messages alone, in the
// order each issues them.
//
// Messages are laid out one after another, each behind its 16-byte header
// and rounded up to 16 bytes; one that does not fit before the ring's end
// starts a new lap at offset 0. Before a message is written, the receiver
// must have taken every message of the lap before whose bytes it covers
// (and everything older): `need` is that count, 0 when nothing is in the way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>

namespace clawcomm {
namespace device {

class P2pRing {
 public:
  struct Slot {
    uint64_t offset;  // of the header, from the ring's start
    uint32_t count;   // messages up to and including this one
    uint32_t need;    // the receiver must have taken this many first (0: none)
  };

  // The ring's bytes a message of `bytes` takes.
  static uint64_t footprint(uint64_t bytes) { return 16 + ((bytes + 15) & ~uint64_t(15)); }

  // The next message's place in a ring of `ringBytes` (footprint(bytes) must
  // fit it).
  Slot place(uint64_t bytes, uint64_t ringBytes) {
    const uint64_t size = footprint(bytes);
    if (head_ + size > ringBytes) {
      head_ = 0;
      ++lap_;
    }
    const uint64_t offset = head_;
    head_ += size;
    uint32_t need = 0;
    while (!used_.empty()) {
      const Used& f = used_.front();
      const bool older = f.lap + 1 < lap_;
      const bool covered = f.lap + 1 == lap_ && f.start < offset + size;
      if (!older && !covered) break;
      need = f.count;
      used_.pop_front();
    }
    ++count_;
    used_.push_back({count_, offset, lap_});
    return {offset, count_, need};
  }

 private:
  struct Used {
    uint32_t count;
    uint64_t start;
    uint64_t lap;
  };
  uint32_t count_ = 0;
  uint64_t head_ = 0;
  uint64_t lap_ = 0;
  std::deque<Used> used_;  // messages that may still be unread, oldest first
};

}  // namespace device
}  // namespace clawcomm
