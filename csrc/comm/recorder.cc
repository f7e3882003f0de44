#include "comm/recorder.h"

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

namespace clawcomm {
namespace {

int64_t micros(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

const char* stateName(uint8_t s) {
  switch (s) {
    case Recorder::kQueued: return "queued";
    case Recorder::kStarted: return "started";
    case Recorder::kDone: return "done";
    case Recorder::kFailed: return "failed";
    default: return "empty";
  }
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

constexpr auto kRelaxed = std::memory_order_relaxed;

}  // namespace

Recorder::Recorder(size_t entries)
    : size_(entries), slots_(entries ? new Slot[entries] : nullptr) {}

Recorder::Slot* Recorder::slotOf(uint64_t id) const {
  if (id == 0 || size_ == 0) return nullptr;
  Slot* s = &slots_[id % size_];
  return s->id.load(kRelaxed) == id ? s : nullptr;  // overwritten by a newer op
}

uint64_t Recorder::queued(const OpSignature& sig, int peer, uint64_t bytes) {
  if (size_ == 0) return 0;
  const uint64_t id = next_++;
  Slot& s = slots_[id % size_];
  s.id.store(id, kRelaxed);
  s.seq.store(sig.seq, kRelaxed);
  s.count.store(sig.count, kRelaxed);
  s.bytes.store(bytes, kRelaxed);
  s.startUs.store(0, kRelaxed);
  s.endUs.store(0, kRelaxed);
  s.peer.store(peer, kRelaxed);
  s.root.store(sig.root, kRelaxed);
  s.type.store(uint8_t(sig.type), kRelaxed);
  s.dtype.store(uint8_t(sig.dtype), kRelaxed);
  s.algo.store(uint8_t(sig.algo), kRelaxed);
  s.state.store(kQueued, std::memory_order_release);
  return id;
}

void Recorder::started(uint64_t id, std::chrono::steady_clock::time_point at) {
  if (Slot* s = slotOf(id)) {
    s->startUs.store(micros(at), kRelaxed);
    s->state.store(kStarted, std::memory_order_release);
  }
}

void Recorder::finished(uint64_t id, bool ok) {
  if (Slot* s = slotOf(id)) {
    s->endUs.store(micros(std::chrono::steady_clock::now()), kRelaxed);
    s->state.store(ok ? kDone : kFailed, std::memory_order_release);
  }
}

std::string Recorder::dumpJson(int rank, int size, const std::string& why,
                               const std::string& culprit,
                               const std::vector<int>& globalRanks) const {
  std::ostringstream o;
  o << "{\"rank\":" << rank << ",\"size\":" << size;
  if (!globalRanks.empty()) {
    o << ",\"global_rank\":" << globalRanks[size_t(rank)] << ",\"global_ranks\":[";
    for (size_t i = 0; i < globalRanks.size(); ++i) o << (i ? "," : "") << globalRanks[i];
    o << "]";
  }
  o << ",\"why\":" << quoted(why);
  if (!culprit.empty()) o << ",\"culprit\":" << quoted(culprit);
  o << ",\"ops\":[";
  uint64_t newest = 0;
  for (size_t i = 0; i < size_; ++i) newest = std::max(newest, slots_[i].id.load(kRelaxed));
  bool first = true;
  for (uint64_t id = newest >= size_ ? newest - size_ + 1 : 1; id <= newest && size_; ++id) {
    const Slot& s = slots_[id % size_];
    if (s.id.load(kRelaxed) != id) continue;
    const uint8_t state = s.state.load(std::memory_order_acquire);
    if (state == kEmpty) continue;
    const bool p2p = OpType(s.type.load(kRelaxed)) == OpType::kSend ||
                     OpType(s.type.load(kRelaxed)) == OpType::kRecv;
    o << (first ? "" : ",") << "{\"id\":" << id;
    if (!p2p) o << ",\"seq\":" << s.seq.load(kRelaxed);
    o << ",\"op\":\"" << opTypeName(OpType(s.type.load(kRelaxed))) << "\""
      << ",\"dtype\":\"" << dataTypeName(DataType(s.dtype.load(kRelaxed))) << "\""
      << ",\"count\":" << s.count.load(kRelaxed) << ",\"peer\":" << s.peer.load(kRelaxed)
      << ",\"root\":" << s.root.load(kRelaxed) << ",\"algo\":\""
      << algorithmName(Algorithm(s.algo.load(kRelaxed))) << "\""
      << ",\"bytes\":" << s.bytes.load(kRelaxed) << ",\"state\":\"" << stateName(state) << "\""
      << ",\"start_us\":" << s.startUs.load(kRelaxed) << ",\"end_us\":" << s.endUs.load(kRelaxed)
      << "}";
    first = false;
  }
  o << "]}";
  return o.str();
}

void pruneFlightRecords(const std::string& root, const std::string& current, int keepDays,
                        size_t keepCount) noexcept {
  namespace fs = std::filesystem;
  try {
    std::error_code ec;
    const auto now = fs::file_time_type::clock::now();
    const auto bound = now - std::chrono::hours(24) * keepDays;
    std::vector<std::pair<fs::file_time_type, fs::path>> jobs;
    for (const auto& e : fs::directory_iterator(root, ec)) {
      if (!e.is_directory(ec) || e.path().filename() == current) continue;
      const auto t = e.last_write_time(ec);
      if (!ec) jobs.emplace_back(t, e.path());
    }
    std::sort(jobs.begin(), jobs.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    // `current` is one of the kept ones.
    const size_t keepOthers = keepCount > 0 ? keepCount - 1 : 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (i >= keepOthers || jobs[i].first < bound) fs::remove_all(jobs[i].second, ec);
    }
  } catch (...) {
  }
}

}  // namespace clawcomm
