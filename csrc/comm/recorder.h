// The flight recorder: a communicator's last operations, in a fixed ring.
//
// Each operation gets a record when it is issued (under the communicator's
// lock, which issuing takes anyway), a start time when it starts moving
// bytes and an end time and state when it completes. Nothing is allocated
// per operation and no lock is added: the fields are relaxed atomics, so a
// dump taken while operations run may mix two of them in one slot, which
// a diagnosis can live with. CLAWCOMM_RECORDER_ENTRIES sizes the ring (0
// turns it off). When the communicator fails (a timeout, a dead peer, a
// mismatch) it dumps the ring as JSON (see dumpJson) to
// CLAWCOMM_FLIGHT_DIR; `clawcomm flight DIR` reads every rank's dump and
// says which ranks are missing from which operation. Each dump prunes the
// folders of older jobs beside it (CLAWCOMM_FLIGHT_KEEP_DAYS,
// CLAWCOMM_FLIGHT_KEEP), so that the folder never grows without bound.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/op.h"

namespace clawcomm {

class Recorder {
 public:
  enum State : uint8_t { kEmpty = 0, kQueued, kStarted, kDone, kFailed };

  explicit Recorder(size_t entries);

  bool enabled() const { return size_ > 0; }

  // A new record (the caller holds the communicator's lock). `peer` is -1
  // for collectives; `bytes` this rank's payload. Returns its id (0 when
  // the recorder is off).
  uint64_t queued(const OpSignature& sig, int peer, uint64_t bytes);
  void started(uint64_t id, std::chrono::steady_clock::time_point at);
  void finished(uint64_t id, bool ok);

  // {"rank":..,"size":..,"why":..,"culprit":..,"ops":[{"id","seq","op","dtype","count",
  //  "peer","root","algo","bytes","state","start_us","end_us"}, ...]} with
  // the records oldest first; times in microseconds of steady_clock. With
  // `globalRanks` (the job's rank of each group rank) also "global_rank"
  // and "global_ranks". "culprit" (only where not empty): who held the
  // group up (comm/culprit.h).
  std::string dumpJson(int rank, int size, const std::string& why, const std::string& culprit,
                       const std::vector<int>& globalRanks = {}) const;

 private:
  struct Slot {
    std::atomic<uint64_t> id{0};
    std::atomic<uint64_t> seq{0};
    std::atomic<uint64_t> count{0};
    std::atomic<uint64_t> bytes{0};
    std::atomic<int64_t> startUs{0};
    std::atomic<int64_t> endUs{0};
    std::atomic<int32_t> peer{-1};
    std::atomic<int32_t> root{-1};
    std::atomic<uint8_t> type{0};
    std::atomic<uint8_t> dtype{0};
    std::atomic<uint8_t> algo{0};
    std::atomic<uint8_t> state{kEmpty};
  };
  Slot* slotOf(uint64_t id) const;

  size_t size_;
  std::unique_ptr<Slot[]> slots_;
  uint64_t next_ = 1;  // guarded by the communicator's lock
};

// Removes the job folders under `root` older than `keepDays` days, and the
// oldest beyond the newest `keepCount`, never `current` (a folder name).
// Errors (another rank pruning at once, a file that is not ours) are
// ignored: pruning is housekeeping.
void pruneFlightRecords(const std::string& root, const std::string& current, int keepDays,
                        size_t keepCount) noexcept;

}  // namespace clawcomm
