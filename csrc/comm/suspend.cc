// What a communicator holds in memory, and giving it back between phases of
// a job (torch's Backend.memory_stats, suspend and resume).
//
// suspend() frees the pages of the shared-memory rings this rank reads and
// the collectives' working memory; the mappings stay, so nothing has to be
// set up again: a ring's pages come back, zeroed, when a peer next writes
// into them. Freeing a ring's pages while a peer writes into it would lose
// its bytes, so every rank of the group takes part:
//   1. a barrier: every rank has finished its operations, and everything
//      sent to this rank has been read (the barrier's own frames too: a
//      rank leaves it only after it has received each one);
//   2. each rank frees its rings and its working memory;
//   3. every rank says so through the store, not the rings (a frame there
//      could land in a ring a slower rank is freeing), and waits for all.
// Between suspend() and resume() every operation is refused, naming why.
// resume() takes the rings' pages back at once, as the segment's creation
// reserved them (posix_fallocate): a /dev/shm that filled meanwhile is an
// error there, not a SIGBUS at a later write.
#include <thread>

#include "comm/communicator.h"
#include "common/errors.h"
#include "messenger/messenger.h"

namespace clawcomm {

Communicator::MemoryStats Communicator::memoryStats() const {
  MemoryStats out;
  out.ringBytes = messenger_->ringBytes();
  out.ringResidentBytes = messenger_->ringResidentBytes();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out.scratchBytes = scratch_.bytes();
    out.suspended = suspended_;
  }
  out.deviceIpcBytes = deviceBytes();
  return out;
}

void Communicator::suspend() {
  CLAWCOMM_ARG_CHECK(!onProgressThread(), "clawcomm: suspend: called from the progress thread");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CLAWCOMM_ARG_CHECK(!suspended_, "clawcomm: suspend: the group is suspended already");
    CLAWCOMM_ARG_CHECK(queue_.empty(), "clawcomm: suspend: ", queue_.size(),
                       " operations are still queued; wait for them first");
  }
  const std::string ns = setupNamespace("suspend");
  barrier()->wait();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    suspended_ = true;
    scratch_.releaseAll();
  }
  messenger_->releaseRings();
  // 3. Through the store: every rank has freed its rings.
  store_->add(ns + "freed", 1);
  const auto deadline = Clock::now() + timeout();
  for (auto wait = std::chrono::microseconds(50);;
       wait = std::min(wait * 2, decltype(wait)(2000))) {
    const int64_t freed = store_->add(ns + "freed", 0);
    if (freed >= size_) break;
    if (Clock::now() > deadline) {
      throw TimeoutError(CLAWCOMM_CONCAT("clawcomm: suspend: ", freed, " of ", size_,
                                         " ranks freed their rings within the group's timeout (",
                                         timeout().count(), " ms); every rank must call suspend"));
    }
    std::this_thread::sleep_for(wait);
  }
}

void Communicator::resume() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CLAWCOMM_ARG_CHECK(suspended_, "clawcomm: resume: the group is not suspended");
  }
  // The rings' pages again, reserved as at creation (a peer that resumed
  // first may be writing into them: taking a page keeps what is in it).
  messenger_->reserveRings();
  std::lock_guard<std::mutex> lock(mutex_);
  suspended_ = false;
}

}  // namespace clawcomm
