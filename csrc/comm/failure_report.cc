// How a communicator tells its first failure: who held the group up (the
// verdict of comm/culprit.h), the job's ranks in place of the group's in
// every message, and the flight record the error names (clawcomm flight
// reads a job's records).
#include <sys/stat.h>

#include <cstdio>
#include <fstream>

#include "comm/communicator.h"
#include "comm/culprit.h"
#include "comm/op.h"
#include "messenger/messenger.h"

namespace clawcomm {
namespace {
constexpr double kLateSeconds = 1.0;
}  // namespace

std::exception_ptr Communicator::withCulprits(std::exception_ptr error, const OpSignature& sig,
                                              bool timedOut, double late) {
  // Only the first failure: later ones follow from it.
  if (broken_ || !status_) return error;
  LinkView links;
  if (timedOut) {
    links.awaited = messenger_->timedOutOn();
    links.stalled = messenger_->stalledLinks();
    links.transports = transports_;
  }
  // A wait checks its deadline every 10 ms: one seen a second late means
  // this process did not run meanwhile (it was the stopped one).
  const Verdict verdict = timedOut && late > kLateSeconds
                              ? selfHeldUp(*status_, rank_, hosts_, late)
                              : findCulprits(*status_, rank_, hosts_, sig, timedOut, links);
  if (verdict.text.empty()) return error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    culprit_ = globalRanks_.empty() ? verdict.text : inGlobalRanks(verdict.text);
  }
  return withSuffix(error, "; " + verdict.text);
}

std::exception_ptr Communicator::withFlightRecord(std::exception_ptr error) {
  // The first failure leaves a flight record, named in the error, and names
  // the job's ranks (setGlobalRanks).
  if (broken_) return error;
  if (!globalRanks_.empty()) error = retyped(error, inGlobalRanks(errorText(error)));
  const std::string path = dumpFlightRecord(errorText(error));
  if (path.empty()) return error;
  return withSuffix(error, CLAWCOMM_CONCAT(" (flight record: ", path, ")"));
}

std::string Communicator::flightRecord(const std::string& why) const {
  std::string culprit;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    culprit = culprit_;
  }
  return recorder_.dumpJson(rank_, size_, why, culprit, globalRanks_);
}

std::string Communicator::inGlobalRanks(const std::string& text) const {
  if (globalRanks_.empty()) return text;
  std::string out;
  size_t i = 0;
  while (true) {
    const size_t at = text.find("rank ", i);
    if (at == std::string::npos) break;
    size_t end = at + 5;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    const bool word = at == 0 || !std::isalpha(static_cast<unsigned char>(text[at - 1]));
    // Text a peer wrote in global ranks already (its abort's reason) stays
    // as it is: "rank 3 (group rank 2, ...)", and the "group rank 2" in it.
    const bool mapped = text.compare(end, 13, " (group rank ") == 0 ||
                        (at >= 6 && text.compare(at - 6, 6, "group ") == 0);
    out += text.substr(i, at + 5 - i);
    i = end;
    if (!word || mapped || end == at + 5 || end - at > 12) {
      out += text.substr(at + 5, end - at - 5);
      continue;
    }
    const int r = std::stoi(text.substr(at + 5, end - at - 5));
    if (r >= size_) {
      out += text.substr(at + 5, end - at - 5);
      continue;
    }
    // "rank 1 (pid 42)" -> "rank 2 (group rank 1, pid 42)"; "rank 1" -> "rank 2 (group rank 1)"
    out += CLAWCOMM_CONCAT(globalRank(r), " (group rank ", r);
    if (text.compare(end, 2, " (") == 0) {
      out += ", ";
      i = end + 2;
    } else {
      out += ")";
    }
  }
  return out + text.substr(i);
}

// <dir>/<job>/rank<r>.json for the job's first group, and
// <dir>/<job>/group-<token>/rank<r>.json for every other: one folder a job,
// which `clawcomm flight` reads group by group.
std::string Communicator::flightRecordPath() const {
  const std::string job = flightJobFolder();
  const std::string group = job == jobToken_ ? "" : CLAWCOMM_CONCAT("/group-", jobToken_);
  return CLAWCOMM_CONCAT(settings_.flightDir, "/", job, group, "/rank", rank_, ".json");
}

// Writes the flight record where flightRecordPath() says (best effort: a
// failure here must not hide the error being reported). Returns the path,
// or "" if it could not be written.
std::string Communicator::dumpFlightRecord(const std::string& why) noexcept {
  if (!recorder_.enabled() || settings_.flightDir.empty()) return "";
  try {
    const std::string job = flightJobFolder();
    const std::string path = flightRecordPath();
    ::mkdir(settings_.flightDir.c_str(), 0777);
    ::mkdir(CLAWCOMM_CONCAT(settings_.flightDir, "/", job).c_str(), 0777);
    ::mkdir(path.substr(0, path.rfind('/')).c_str(), 0777);
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp);
      f << flightRecord(why) << "\n";
      if (!f) return "";
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) return "";
    pruneFlightRecords(settings_.flightDir, job, settings_.flightKeepDays, settings_.flightKeep);
    return path;
  } catch (...) {
    return "";
  }
}

}  // namespace clawcomm
