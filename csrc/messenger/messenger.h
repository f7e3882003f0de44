// Framing, matching and progress over a set of Connections.
//
// Every message is a frame: a 64-byte header, the payload, and zero padding
// to a multiple of 8 bytes. Collective frames carry the operation's signature
// (type, dtype, count, reduce op, root, sequence number) and the receiver
// compares it with its own before it touches the payload, so ranks that call
// different collectives fail with a clear error instead of corrupting data.
//
// Matching:
//   * collective frames from a peer are matched in order against the receives
//     posted for that peer. A frame that arrives before its receive is posted
//     stays in the stream (back-pressure); collectives are issued in the same
//     order everywhere, so the receive always comes.
//   * point-to-point frames are matched by (source, tag) in arrival order;
//     one with no posted receive is copied aside ("unexpected") so that the
//     frames behind it keep flowing.
//   * a receive hands the payload to its sink (messenger/sink.h: copy,
//     reduce, decode, decode-and-add) straight out of the transport's
//     memory, with no intermediate copy.
//
// Single copy (messenger/references.cc): a frame of at least the
// connection's referenceMinBytes() carries, instead of its payload, a
// reference (the address of the payload in the sender's memory;
// FrameHeader::byReference). The receiver matches it like any frame, then
// reads the payload straight into the sink (Connection::readPeer; a reduce
// or decode sink through a small buffer that stays in cache), a chunk per
// progress pass so other peers keep moving, and tells the sender out of band
// (Connection::referenceRead). The send completes only then, so its buffer
// stays untouched until it is read. An unexpected point-to-point reference
// is parked, and the stream moves on: a receive posted within kParkTime reads
// it straight into its buffer; after that it is read into a stash, as bytes
// would be, so a send never waits long for its receive to be posted.
//
// One thread (the communicator's progress thread) owns a Messenger.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/op.h"
#include "common/traffic.h"
#include "messenger/sink.h"
#include "transport/transport.h"

namespace clawcomm {

struct Doorbell;

// kAbort carries the aborting rank's reason (kAbortReasonBytes of text), so a
// peer learns why, not just that the stream ended.
enum class FrameKind : uint8_t { kCollective = 1, kPointToPoint = 2, kClose = 3, kAbort = 4 };
constexpr size_t kAbortReasonBytes = 448;

struct FrameHeader {
  uint32_t magic;
  FrameKind kind;
  OpType opType;
  DataType dtype;
  ReduceOp redop;
  uint64_t seq;    // collective: sequence number; point-to-point: tag
  uint64_t count;  // collective: the signature's count
  uint64_t payloadBytes;
  int32_t root;
  uint32_t step;        // collective: index of this message between the pair
  uint8_t algo;         // collective: OpSignature::algo
  uint8_t byReference;  // the payload stays with the sender: the stream carries a Reference
  uint8_t reserved[2];
  uint32_t epoch;  // the group's epoch (Messenger::setEpoch): frames of another group are refused
  uint8_t reserved2[16];
};
static_assert(sizeof(FrameHeader) == 64, "frame header is 64 bytes");
constexpr uint32_t kFrameMagic = 0x434c4d46;  // "CLMF", FrameHeader::magic

// The signature a collective frame carries.
OpSignature signatureOf(const FrameHeader& h);

// What a frame sent by reference carries in place of its payload.
struct Reference {
  uint64_t address;  // of the payload, in the sender's memory
  uint64_t bytes;    // the payload's size, as the header says
  uint64_t seq;      // 1, 2, ... per direction (Connection::referenceRead)
  uint64_t reserved;
};
static_assert(sizeof(Reference) % 8 == 0, "a reference keeps frames whole 8-byte words");

struct Transfer {
  enum class Mode { kSend, kRecv };
  Mode mode = Mode::kSend;
  int peer = -1;         // -1: any source, until matched
  FrameHeader header{};  // sends: the header on the wire
  OpSignature expect{};  // collective receives: what the sender must have
  uint32_t step = 0;
  uint64_t tag = 0;
  const uint8_t* src = nullptr;
  ReceiveSink sink;  // receives: where the payload goes
  size_t bytes = 0;
  size_t done = 0;  // sends: frame bytes written; receives: payload bytes
  bool complete = false;
  // Unexpected point-to-point frames land here until a receive claims them.
  bool unexpected = false;
  bool abortReason = false;  // an abort frame's text
  std::vector<uint8_t> stash;
  std::shared_ptr<Transfer> claimedBy;
  // Single copy. Sends: the reference's number. Unexpected receives: the
  // reference a frame carried, parked until a receive claims it or
  // kParkTime passes (then read into `stash`).
  uint64_t referenceSeq = 0;
  bool parked = false;
  bool readIntoStash = false;
  Reference reference{};
  Clock::time_point parkedAt{};
};
using TransferPtr = std::shared_ptr<Transfer>;

class Messenger {
 public:
  // `connections[r]` reaches rank r; connections[rank] is null.
  Messenger(int rank, int size, std::vector<std::unique_ptr<Connection>> connections,
            int spinMicros, int yieldMicros);
  ~Messenger();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Stamped into every frame sent and checked on every frame received: a
  // frame whose epoch differs came from another group (a rebuilt one's
  // predecessor) and is an error, never data. Set before any traffic.
  void setEpoch(uint32_t epoch) { epoch_ = epoch; }
  const char* transportOf(int peer) const;
  // The smallest frame payload sent to `peer` by reference (SIZE_MAX: none).
  size_t singleCopyFrom(int peer) const { return peers_[peer].conn->referenceMinBytes(); }
  // The incoming rings of this rank's connections (Connection::ringBytes):
  // their size and how much of it is in memory now. Any thread.
  size_t ringBytes() const;
  size_t ringResidentBytes() const;
  // Gives their pages back (Communicator::suspend): only while no byte is
  // in flight to this rank.
  void releaseRings();
  void reserveRings();  // Connection::reserveRing

  TransferPtr sendCollective(int peer, const OpSignature& sig, uint32_t step, const void* src,
                             size_t bytes);
  // `sink` takes the `bytes` of payload as they arrive.
  TransferPtr recvCollective(int peer, const OpSignature& sig, uint32_t step,
                             const ReceiveSink& sink, size_t bytes);
  TransferPtr sendPointToPoint(int peer, uint64_t tag, const void* src, size_t bytes);
  // peer == -1 receives from any source; the matched peer is stored in `peer`.
  TransferPtr recvPointToPoint(int peer, uint64_t tag, void* dst, size_t bytes);

  // One non-blocking pass over every connection. True if any byte moved.
  bool progress();

  // Drives progress until every transfer completes. Throws TimeoutError at
  // `deadline`, PeerError if a peer dies or aborts meanwhile.
  void waitAll(const std::vector<TransferPtr>& transfers, Clock::time_point deadline);

  // Between idle progress passes: spin for the first spinMicros after the
  // last byte moved, yield the core for the next yieldMicros, then sleep until a peer makes
  // progress possible (a doorbell for shared memory, poll() for TCP), waking every 10 ms to check
  // peer health and the deadline. `idleSince` is when progress last moved a
  // byte.
  void pause(Clock::time_point idleSince, Clock::time_point deadline,
             const std::vector<TransferPtr>& waitingOn);

  // Whether pause() also spins through the time the peers' single-copy
  // reads of this rank's sends should take (readSpinMicros). Off where the
  // host runs more ranks than it has cores.
  void spinForReads(bool on) { spinForReads_ = on; }

  // Ends a pause() that is sleeping, or makes the next one return at once:
  // another thread of this rank queued work (a send) that the sleeper must
  // see now rather than at its next health check. Any thread may call it.
  void wake();

  // Another thread's abort: from its next pass, every wait of this
  // messenger throws PeerError(reason), and a sleeping one wakes now. Any
  // thread may call it; the owning thread then fails and tells the peers.
  void cancel(const std::string& reason);
  // Bytes sent and received so far, per operation type.
  Traffic& traffic() { return traffic_; }

  // Tells every peer that this rank gives up, with the reason.
  void abort(const std::string& reason) noexcept;

  // After pause() threw TimeoutError: the peer the wait was for (-1: any).
  int timedOutOn() const { return timedOutOn_; }
  // Called (on the waiting thread) with a peer whose link looks cut
  // (Connection::stall), every kStallCheckInterval of a wait that has been
  // idle for kStallCheckAfter: the communicator shows it on its status page.
  void setStallWatch(std::function<void(int peer)> watch) { stallWatch_ = std::move(watch); }
  // Each peer whose link looks cut (Connection::stall), with why.
  std::vector<std::pair<int, std::string>> stalledLinks() const;

  // Sends a close frame to every peer and flushes what is queued.
  void close(Clock::time_point deadline) noexcept;

 private:
  struct PeerState {
    std::unique_ptr<Connection> conn;
    std::deque<TransferPtr> sendQueue;
    std::deque<TransferPtr> postedCollective;
    std::list<TransferPtr> postedPointToPoint;
    std::list<TransferPtr> unexpected;  // stash transfers, in arrival order
    uint8_t header[sizeof(FrameHeader)];
    size_t headerFill = 0;
    TransferPtr target;            // receive the current frame goes to
    size_t frameDone = 0;          // payload + padding consumed
    bool closed = false;           // the peer sent its close frame
    std::vector<uint8_t> scratch;  // small frames are assembled here
    // Single copy. Sender side: frames sent by reference that the peer has
    // not read yet, and the last number given to a reference.
    std::vector<TransferPtr> awaitingRead;
    uint64_t referencesSent = 0;
    // Receiver side: the current frame's reference, as it arrives.
    uint8_t reference[sizeof(Reference)];
    size_t referenceFill = 0;
  };

  // A fresh transfer for a send or receive posted by an operation: one of
  // spareTransfers_ that nobody else holds any more, reset, or a new one.
  TransferPtr newTransfer();
  // Queues one outgoing frame; fills the header's magic and payload size.
  TransferPtr queueSend(int peer, const FrameHeader& header, const void* src, size_t bytes);
  bool progressSend(PeerState& ps);
  // How much longer than spinMicros a pause spins for the reads by
  // reference among `waitingOn` (waits.cc).
  int64_t readSpinMicros(const std::vector<TransferPtr>& waitingOn) const;
  static constexpr uint64_t kReadBytesPerMicro = 8000;  // 8 GB/s, a slow single copy
  static constexpr int64_t kMaxReadSpinMicros = 500;
  bool progressRecv(int peer, PeerState& ps);
  // Single copy (references.cc). Whether frames of `op` go by reference.
  static bool referenceSuits(OpType op, Algorithm algo, size_t bytes);
  // Whether the next send to this peer may go by reference: the references
  // it awaits stay within the window.
  bool referenceFits(const PeerState& ps) const;
  // Completes the sends by reference the peer has read.
  bool settleReferences(PeerState& ps);
  // Gathers the current frame's reference from the stream into
  // ps.reference; true once whole.
  bool takeReference(PeerState& ps, bool& moved);
  // Reads the next chunk of `ref`'s payload into `sink`, from `offset`.
  void readChunk(Connection& c, const Reference& ref, const ReceiveSink& sink, size_t& offset);
  // Reads parked references: into the receive that claimed one, or, once
  // kParkTime has passed, into its stash. One chunk per call.
  bool progressParked(PeerState& ps);
  TransferPtr match(int peer, PeerState& ps, const FrameHeader& h);
  void startTcpWatcher(const std::vector<int>& fds);
  // Grows an unexpected frame's stash to hold `need` payload bytes (up to
  // what its header claims), doubling, so memory follows what arrives.
  static void growStash(Transfer& t, size_t need);
  void finishReceive(int peer, PeerState& ps, const TransferPtr& t);
  static void deliver(Transfer& stash, Transfer& recv);
  void checkPeers(const std::vector<TransferPtr>& waitingOn);
  int timedOutOn_ = -1;  // see timedOutOn()
  std::function<void(int)> stallWatch_;
  Clock::time_point nextStallCheck_{};
  std::string describeWait(const Transfer& t) const;
  std::string whatWasAwaited(int peer, const std::vector<TransferPtr>& waitingOn) const;

  int rank_;
  int size_;
  uint32_t epoch_ = 0;
  int spinMicros_;
  int yieldMicros_;
  bool spinForReads_ = false;
  std::vector<PeerState> peers_;
  std::list<TransferPtr> anySource_;
  Clock::time_point nextHealthCheck_{};
  Doorbell* doorbell_ = nullptr;  // this rank's shm doorbell: every peer on shm, or mixed
  bool pollFds_ = false;          // every connection has a file descriptor
  int wakeFd_ = -1;               // an eventfd in the poll() set (pollFds_ only)
  // Mixed transports (shm and TCP): a thread that turns readiness of the
  // TCP sockets into rings of the doorbell, so pause() blocks on the
  // doorbell alone. Stopped through stopFd_.
  std::thread tcpWatcher_;
  int stopFd_ = -1;
  std::atomic<bool> wakeRequested_{false};
  std::atomic<bool> cancelled_{false};
  std::mutex cancelMutex_;
  std::string cancelReason_;  // guarded by cancelMutex_
  Traffic traffic_;
  std::vector<uint8_t> bounce_;  // a reference's chunk on its way into a reduce or decode sink
  // The last transfers made (up to kSpareTransfers), for newTransfer(): a
  // small collective used to allocate one for each send and receive
  // (issue 62). Owned by the thread driving the messenger.
  static constexpr size_t kSpareTransfers = 8;
  std::vector<TransferPtr> spareTransfers_;
  size_t sparesReplaced_ = 0;  // when all are held, the next made replaces one, in turn
};

}  // namespace clawcomm
