// The memory of a messenger's connections: their incoming rings' sizes and
// resident pages, given back and taken again (Communicator::memoryStats,
// suspend, resume).
#include "messenger/messenger.h"

namespace clawcomm {

size_t Messenger::ringBytes() const {
  size_t total = 0;
  for (const PeerState& p : peers_) total += p.conn ? p.conn->ringBytes() : 0;
  return total;
}

size_t Messenger::ringResidentBytes() const {
  size_t total = 0;
  for (const PeerState& p : peers_) total += p.conn ? p.conn->ringResidentBytes() : 0;
  return total;
}

void Messenger::releaseRings() {
  for (PeerState& p : peers_) {
    if (p.conn) p.conn->releaseRing();
  }
}

void Messenger::reserveRings() {
  for (PeerState& p : peers_) {
    if (p.conn) p.conn->reserveRing();
  }
}

}  // namespace clawcomm
