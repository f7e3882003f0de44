// The transport interface: an ordered, reliable byte stream to one peer.
//
// Everything above this file (framing, matching, algorithms) is written
// against Connection and Endpoint only; it never names shared memory or TCP.
// Every call is non-blocking: the messenger drives all connections from one
// progress thread and decides itself when to spin and when to sleep.
//
// Alignment contract: the writer only ever produces frames whose lengths are
// multiples of 8 bytes, and a transport never splits an aligned 8-byte word
// across two readable regions. So a reader that reduces elements straight
// out of the region returned by peek() never sees an element cut in two
// except at the end of what has arrived so far.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/clock.h"

namespace clawcomm {

struct Doorbell;

struct Readable {
  const uint8_t* data = nullptr;
  size_t size = 0;
};

class Connection {
 public:
  virtual ~Connection() = default;

  // Appends up to `n` bytes to the outgoing stream; returns how many were taken.
  virtual size_t write(const void* data, size_t n) = 0;

  // The longest contiguous run of received, unconsumed bytes. May be empty.
  virtual Readable peek() = 0;

  // Releases the first `n` bytes returned by peek().
  virtual void consume(size_t n) = 0;

  // Throws PeerError when the peer aborted, or, if `waitingOnIt`, when it
  // died or closed the stream. Called from the slow path of every wait. A
  // peer this rank is not waiting on may legitimately have finished its last
  // operation and exited; its death is reported by the wait that needs it.
  virtual void checkPeer(bool waitingOnIt) = 0;

  // Marks the stream as aborted for the peer, with a reason it can report.
  virtual void abort(const std::string& reason) = 0;

  // Why the link to the peer looks cut, or "" where it does not: over TCP,
  // bytes sent that the peer's host has not acknowledged for a second or
  // more. A stopped or busy peer's kernel still acknowledges, so this points
  // at the link or the host, not at the process (comm/culprit.h).
  virtual std::string stall() const { return {}; }

  // Clean shutdown: tells the peer no more bytes follow.
  virtual void close() = 0;

  // The memory that holds this connection's incoming bytes, where the
  // transport keeps it itself (a shared-memory ring; a socket's buffers are
  // the kernel's: 0), and how much of it is in memory now.
  virtual size_t ringBytes() const { return 0; }
  virtual size_t ringResidentBytes() const { return 0; }
  // Gives the incoming ring's pages back to the system (Communicator::
  // suspend); they come back, zeroed, when next written. Only while nothing
  // is in the ring and nobody writes to it.
  virtual void releaseRing() {}
  // Takes the ring's pages again (Communicator::resume), as the segment's
  // creation reserved them: a /dev/shm filled meanwhile fails here, with
  // the reason, instead of a SIGBUS at the next write. Throws Error.
  virtual void reserveRing() {}

  // A file descriptor to poll for readability, or -1 (shared memory); it
  // may change as bytes move (a striped stream reads its sockets in turn).
  virtual int pollFd() const { return -1; }
  // The one to poll for writability while writes are blocked.
  virtual int writePollFd() const { return pollFd(); }
  // Every descriptor the connection uses (for an edge-triggered watcher).
  virtual std::vector<int> allFds() const {
    return pollFd() >= 0 ? std::vector<int>{pollFd()} : std::vector<int>{};
  }

  // The doorbell the peer rings whenever it writes to this rank or frees
  // space for it (transport/doorbell.h), or null. Shared-memory connections
  // of one rank all return the same one, so a rank waiting on any of them
  // sleeps in one futex.
  virtual Doorbell* doorbell() { return nullptr; }

  virtual const char* kind() const = 0;

  // Single copy (shared memory with cross-memory attach; a transport
  // without it keeps the defaults). A sender may put a reference to its own
  // memory in the stream instead of the bytes of a frame of at least
  // referenceMinBytes() payload bytes (SIZE_MAX: never; the peer decides, by
  // whether it may read this process). References are numbered 1, 2, ... per
  // direction. The receiver copies straight out of the sender's memory
  // (readPeer) and then calls referenceRead(seq), which the sender sees out
  // of band (referenceWasRead), in any order: never behind frames in the
  // stream, which back-pressure can hold. One slot per seq modulo
  // kReferenceWindow carries it, so a sender keeps the references it awaits
  // within that many consecutive numbers.
  static constexpr uint64_t kReferenceWindow = 64;
  virtual size_t referenceMinBytes() const { return SIZE_MAX; }
  // Whether frames of every operation may go by reference, not only those
  // the messenger deems suited (Messenger::referenceSuits).
  virtual bool referencesForEveryOp() const { return false; }
  // Copies `n` bytes at `address` in the peer's memory to `dst`. Throws
  // PeerError when the peer died or its memory is gone.
  virtual void readPeer(uint64_t /*address*/, void* /*dst*/, size_t /*n*/) {
    throw std::logic_error("a reference on a transport without single copy");
  }
  virtual void referenceRead(uint64_t /*seq*/) {}
  virtual bool referenceWasRead(uint64_t /*seq*/) const { return false; }
};

// This rank's side of one transport: the local resources (a listening socket,
// an inbound shared-memory segment) and the address peers use to reach them.
class Endpoint {
 public:
  virtual ~Endpoint() = default;

  // What peers pass to connect() to reach this rank.
  virtual std::string address() const = 0;

  // Establishes the stream with `peer`, whose endpoint published
  // `peerAddress`. Both ranks of a pair call it; it may block until `deadline`.
  virtual std::unique_ptr<Connection> connect(int peer, const std::string& peerAddress,
                                              Clock::time_point deadline) = 0;

  // Called once every peer has connected: drop what is no longer needed to
  // accept peers (the segment name, the listening socket).
  // Also run when the endpoint is destroyed, after a failed setup.
  virtual void finishSetup() = 0;
};

}  // namespace clawcomm
