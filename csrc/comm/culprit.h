// Who holds a group up. When a collective of this rank times out, or finds
// that a peer called another collective, the communicator reads every
// peer's status page (comm/status_pages.h) and names, by rank, host and pid,
// the ranks that keep the others waiting:
//
//   - a rank that is stopped (SIGSTOP, or held by a debugger), wherever it is;
//   - a rank whose program has not called the collective (asleep, or busy
//     in its own code): what it last completed and how long ago (on a
//     timeout only: on a mismatch the others may simply not be there yet);
//   - a rank that called another collective under the same number: the
//     ranks that agree on the call are taken as right, the others named
//     (with two ranks, or a tie, every side is named);
//   - on a timeout, a rank whose link looks cut: bytes this rank, or a rank
//     of its host (its page says so), sent it over TCP unacknowledged for a
//     second or more (its kernel would acknowledge them even if it were
//     stopped), or, where nothing else is found, the TCP peer this rank
//     waited for.
//
// A rank still inside an earlier collective is held up itself, and is named
// only where nothing else is.
//
// The sentence goes into the error every rank raises (the first rank to
// fail tells the others) and into the flight record, whose first line in
// `clawcomm flight` it becomes.
#pragma once

#include <string>
#include <vector>

#include "comm/status_pages.h"
#include "common/op.h"

namespace clawcomm {

struct Verdict {
  std::vector<int> culprits;  // group ranks, ascending
  std::string text;           // "held up by rank 2 (host h, pid 7): ...", or "" if nobody is named
};

// What this rank's own connections say (Messenger: timedOutOn,
// stalledLinks; Communicator::transportOf).
struct LinkView {
  int awaited = -1;                                  // the peer the timed-out wait was for
  std::vector<std::pair<int, std::string>> stalled;  // peers whose link looks cut, and why
  std::vector<std::string> transports;               // how this rank reaches each rank
};

// The ranks of `pages`' group that hold up this rank's collective
// `waiting`. `hosts` gives each rank's host; `timedOut` is whether the
// wait ran out (rather than a mismatch found in a frame).
Verdict findCulprits(const StatusPages& pages, int rank, const std::vector<std::string>& hosts,
                     const OpSignature& waiting, bool timedOut, const LinkView& links);

// Where this rank's own wait ran `lateSeconds` past its deadline before it
// could look (its process was stopped, or starved of the CPU): it is the
// one that held the others up, whatever the pages say now.
Verdict selfHeldUp(const StatusPages& pages, int rank, const std::vector<std::string>& hosts,
                   double lateSeconds);

}  // namespace clawcomm
