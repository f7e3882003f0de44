#include "comm/culprit.h"

#include <algorithm>
#include <cstdio>

#include "common/errors.h"
#include "common/process.h"

namespace clawcomm {
namespace {

std::string seconds(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", double(std::max<int64_t>(ns, 0)) / 1e9);
  return buf;
}

// "rank 2 (host h, pid 7)": Communicator::inGlobalRanks turns it into
// "rank 5 (group rank 2, host h, pid 7)" in a group that is not the world.
std::string who(int rank, const std::vector<std::string>& hosts, const StatusPage& page) {
  const std::string host = size_t(rank) < hosts.size() ? hosts[size_t(rank)] : "?";
  if (!page.visible) return CLAWCOMM_CONCAT("rank ", rank, " (host ", host, ")");
  return CLAWCOMM_CONCAT("rank ", rank, " (host ", host, ", pid ", page.pid, ")");
}

// "rank 0", "rank 0 and rank 2", "rank 0, rank 1 and rank 3": each rank
// written out, so that a sub-group's error names each by its global rank
// (Communicator::inGlobalRanks rewrites every "rank N").
std::string rankList(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += CLAWCOMM_CONCAT(i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ", "rank ", ranks[i]);
  }
  return out;
}

// What a rank last finished, and how long ago its page last changed.
std::string lastDone(const StatusPage& p, int64_t now) {
  if (!p.completedAny) {
    return CLAWCOMM_CONCAT("it has completed no collective (", seconds(now - p.sinceNs),
                           " since its last step)");
  }
  if (p.calledAny && p.called == p.completed) {
    return CLAWCOMM_CONCAT("it last completed ", p.last.describe(), ", ", seconds(now - p.sinceNs),
                           " ago");
  }
  return CLAWCOMM_CONCAT("it last completed collective #", p.completed);
}

}  // namespace

Verdict selfHeldUp(const StatusPages& pages, int rank, const std::vector<std::string>& hosts,
                   double lateSeconds) {
  Verdict v;
  v.culprits = {rank};
  char late[32];
  std::snprintf(late, sizeof(late), "%.1f s", lateSeconds);
  v.text = CLAWCOMM_CONCAT("held up by ", who(rank, hosts, pages.read(rank)),
                           " itself: it did not run for ", late,
                           " past its deadline (stopped, or starved of the CPU)");
  return v;
}

Verdict findCulprits(const StatusPages& pages, int rank, const std::vector<std::string>& hosts,
                     const OpSignature& waiting, bool timedOut, const LinkView& links) {
  const int size = int(hosts.size());
  const uint64_t s = waiting.seq;
  const int64_t now = statusClockNs();
  std::vector<StatusPage> page(static_cast<size_t>(size));
  std::vector<int> unseen;
  for (int q = 0; q < size; ++q) {
    page[size_t(q)] = pages.read(q);
    if (!page[size_t(q)].visible) unseen.push_back(q);
  }

  // 1. The call each rank made as number s, for those that made it; the
  //    signature most ranks agree on (this rank's on a tie) is the call.
  std::vector<int> atS;
  for (int q = 0; q < size; ++q) {
    const StatusPage& p = page[size_t(q)];
    if (q == rank || (p.visible && p.calledAny && p.called == s)) atS.push_back(q);
  }
  const auto callOf = [&](int q) -> const OpSignature& {
    return q == rank ? waiting : page[size_t(q)].last;
  };
  const auto agreeing = [&](int q) {
    return int(
        std::count_if(atS.begin(), atS.end(), [&](int o) { return callOf(o).sameAs(callOf(q)); }));
  };
  int model = rank;
  for (int q : atS) {
    if (agreeing(q) > agreeing(model)) model = q;
  }
  // Ranks this host cannot see may hold the majority: then every side is
  // named, as on a tie.
  const bool tie = !unseen.empty() || std::any_of(atS.begin(), atS.end(), [&](int q) {
    return !callOf(q).sameAs(callOf(model)) && agreeing(q) == agreeing(model);
  });

  // 2. Each rank's finding. A rank still inside an earlier collective is
  //    held up itself: it is named only where nothing else is found.
  struct Finding {
    int rank;
    std::string clause;
    bool primary;
  };
  std::vector<Finding> found;
  const auto named = [&](int q) {
    return std::any_of(found.begin(), found.end(), [&](const Finding& f) { return f.rank == q; });
  };
  for (int q = 0; q < size; ++q) {
    const StatusPage& p = page[size_t(q)];
    if (!p.visible) continue;
    const bool differs = std::find(atS.begin(), atS.end(), q) != atS.end() &&
                         (tie || !callOf(q).sameAs(callOf(model)));
    if (differs) {
      // The frame's error has described both calls already: say whose.
      std::vector<int> others;
      for (int o : atS) {
        if (!callOf(o).sameAs(callOf(q))) others.push_back(o);
      }
      found.push_back(
          {q,
           CLAWCOMM_CONCAT(who(q, hosts, p), ": its call #", s, " (", opTypeName(callOf(q).type),
                           ") differs from that of ", rankList(others)),
           true});
      continue;
    }
    // A rank that failed on its own has told the others why.
    if (q == rank || p.failed) continue;
    const bool reached = p.calledAny && p.called >= s;
    if (processStopped(p.pid)) {
      found.push_back(
          {q,
           CLAWCOMM_CONCAT(who(q, hosts, p), ": stopped (SIGSTOP, or held by a debugger) ",
                           reached ? CLAWCOMM_CONCAT("in ", p.last.describe())
                                   : CLAWCOMM_CONCAT("before its call #", s),
                           "; ", lastDone(p, now)),
           true});
    } else if (!reached && timedOut) {
      const bool inEarlier = p.calledAny && (!p.completedAny || p.completed < p.called);
      found.push_back(
          {q,
           CLAWCOMM_CONCAT(
               who(q, hosts, p), ": has not called collective #", s, ": ",
               inEarlier ? CLAWCOMM_CONCAT("it is still in ", p.last.describe(), " (called ",
                                           seconds(now - p.sinceNs), " ago)")
                         : CLAWCOMM_CONCAT(lastDone(p, now), ", and has run its own code since")),
           !inEarlier});
    }
  }
  // 3. Links, on a timeout: one that looks cut, to this rank or to a rank
  //    of this host (its page says so), names the rank behind it; failing
  //    any other finding, so does the TCP peer this rank waited for, where
  //    every rank seen here is in the collective.
  const auto unreachable = [&](int q, int from, const std::string& why) {
    found.push_back({q,
                     CLAWCOMM_CONCAT(who(q, hosts, page[size_t(q)]), ": unreachable from rank ",
                                     from, " (host ", hosts[size_t(from)], "): ", why),
                     true});
  };
  for (const auto& [q, why] : links.stalled) {
    if (!named(q)) unreachable(q, rank, why);
  }
  // Only a host-mate's mark: across a cut both sides mark each other, and
  // a mark that names this rank says only that it is on the other side.
  for (int from = 0; from < size && timedOut; ++from) {
    const int q = page[size_t(from)].stalledPeer;
    if (page[size_t(from)].visible && hosts[size_t(from)] == hosts[size_t(rank)] && q >= 0 &&
        q < size && q != rank && !named(q)) {
      unreachable(q, from, "its TCP link got no ACK for a second or more");
    }
  }
  const bool primary =
      std::any_of(found.begin(), found.end(), [](const Finding& f) { return f.primary; });
  const int q = links.awaited;
  if (!primary && timedOut && q >= 0 && q < size && size_t(q) < links.transports.size() &&
      links.transports[size_t(q)] == "tcp" && !named(q)) {
    found.push_back({q,
                     CLAWCOMM_CONCAT(who(q, hosts, page[size_t(q)]),
                                     ": nothing came from it over TCP while every rank seen ",
                                     "from host ", hosts[size_t(rank)], " is in collective #", s,
                                     ": its link or its host may be down"),
                     true});
  }
  Verdict v;
  std::vector<std::string> clauses;
  const bool anyPrimary =
      std::any_of(found.begin(), found.end(), [](const Finding& f) { return f.primary; });
  for (const Finding& f : found) {
    if (anyPrimary && !f.primary) continue;
    clauses.push_back(f.clause);
    v.culprits.push_back(f.rank);
  }
  std::sort(v.culprits.begin(), v.culprits.end());
  if (!clauses.empty()) {
    v.text = "held up by " + clauses.front();
    for (size_t i = 1; i < clauses.size(); ++i) v.text += "; and by " + clauses[i];
  } else if (timedOut && !unseen.empty()) {
    // Only what this machine's table shows: ranks elsewhere cannot be seen.
    std::vector<std::string> where;
    for (int u : unseen) {
      if (std::find(where.begin(), where.end(), hosts[size_t(u)]) == where.end()) {
        where.push_back(hosts[size_t(u)]);
      }
    }
    std::string names;
    for (const auto& h : where) names += (names.empty() ? "" : ", ") + h;
    v.text = CLAWCOMM_CONCAT("every rank seen from this host is in collective #", s, "; ",
                             rankList(unseen), " on ", names,
                             " cannot be seen from here: look at their errors");
  }
  return v;
}

}  // namespace clawcomm
