// Each rank's status page: one slot of a table in shared memory, one table
// per group and machine, where a rank shows the collective its program last
// called and the last one it completed. A rank whose wait times out reads
// its peers' pages (comm/culprit.h) and names the rank that holds the group
// up: one that is stopped, one still in its own code before the call, one
// that called another collective. It asks nobody anything, so a stopped or
// wedged process is named as surely as a busy one.
//
// The owner writes its page with a handful of relaxed stores per operation,
// under a sequence count that lets a reader take a consistent copy; pages
// are read only once something has gone wrong. Every rank of the group on
// this machine opens the table before the setup's last step (connectPeers)
// and unlinks its name once every rank has connected, as with the rings,
// so the name never outlives the job. Ranks on other machines have their
// own table: their pages are not visible here. Where the table cannot be
// made (no /dev/shm), a rank keeps its page in private memory and its
// peers' pages read as not visible: diagnosis is never worth failing a job.
#pragma once

#include <cstdint>
#include <string>

#include "common/op.h"

namespace clawcomm {

// A consistent copy of one rank's page.
struct StatusPage {
  bool visible = false;    // on this machine's table, and written by its rank
  int32_t pid = 0;         // the rank's process
  bool calledAny = false;  // whether its program has called any collective
  uint64_t called = 0;     // the sequence number of the last collective it called
  uint64_t completed = 0;  // of the last it completed (valid where completedAny)
  bool completedAny = false;
  bool failed = false;       // its communicator failed
  OpSignature last;          // the last collective called (last.seq == called)
  int32_t stalledPeer = -1;  // a peer whose link it last found cut (-1: none)
  int64_t sinceNs = 0;       // CLOCK_MONOTONIC of its last change
};

class StatusPages {
 public:
  // This rank's page in the group's table on this machine, opened (made by
  // whichever rank comes first) under a name derived from the group token.
  StatusPages(const std::string& tokenHex, int rank, int size);
  ~StatusPages();
  StatusPages(const StatusPages&) = delete;
  StatusPages& operator=(const StatusPages&) = delete;

  // Once every rank has opened the table: its name is no longer needed.
  void unlink() noexcept;

  // The owner's updates (one thread at a time: the communicator's lock or
  // its progress thread, which never race on the same update).
  void called(const OpSignature& sig) noexcept;
  void completed(uint64_t seq, bool ok) noexcept;
  // A peer whose link this rank found cut while it waited (Messenger's
  // stall watch), for the verdicts of its host's other ranks.
  void stalled(int peer) noexcept;

  // A copy of `rank`'s page (visible = false where it cannot be read).
  StatusPage read(int rank) const noexcept;
  bool shared() const { return shared_; }

  // "/clawcomm-<token>-status": the table's name.
  static std::string nameFor(const std::string& tokenHex);

 private:
  struct Slot;
  Slot* slot(int rank) const;
  void write(const Slot& update) noexcept;

  std::string name_;
  int rank_;
  int size_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  bool shared_ = false;
  bool unlinked_ = false;
};

// The clock of StatusPage::sinceNs (CLOCK_MONOTONIC, coarse).
int64_t statusClockNs();

}  // namespace clawcomm
