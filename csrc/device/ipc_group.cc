#include "device/ipc_group.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"

namespace clawcomm {
namespace device {
namespace {

constexpr size_t kSignalBytes = (sizeof(IpcSignals) + 4095) & ~size_t(4095);
constexpr size_t kStatusOffset = 64;  // in the host-mapped words, after the abort flag
constexpr size_t kHostWordBytes = kStatusOffset + sizeof(IpcStatus);

const std::string kFailed = "!";  // a posted value that says what failed

std::vector<uint8_t> bytesOf(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

size_t packsOf(size_t bytes) {
  return (bytes + 15) / 16;
}

}  // namespace

IpcMapping::IpcMapping(std::shared_ptr<DeviceRuntime> rt, size_t eagerBytes, size_t graphBytes,
                       size_t rings, int n)
    : runtime(std::move(rt)), capacity{eagerBytes, graphBytes}, ringBytes(rings), ranks(n) {
  void* onDevice = nullptr;
  hostWords = runtime->allocMapped(kHostWordBytes, &onDevice);
  for (int c = 0; c < kIpcChannels; ++c) {
    peers[c] = IpcPeers{};
    peers[c].abortFlag = static_cast<const volatile uint32_t*>(onDevice);
    peers[c].status = reinterpret_cast<IpcStatus*>(static_cast<char*>(onDevice) + kStatusOffset);
    peers[c].channel = c;
    peers[c].ringBytes = ringBytes;
  }
}

IpcMapping::~IpcMapping() {
  for (void* p : opened) runtime->closeHandle(p);
  if (base) runtime->freeShared(base);
  if (hostWords) runtime->freeMapped(hostWords);
}

size_t IpcMapping::bufferBytes() const {
  return kSignalBytes + 2 * (capacity[kIpcEager] + capacity[kIpcGraph]) + ringBytes * size_t(ranks);
}

void IpcMapping::map(int rank, void* buffer) {
  char* at = static_cast<char*>(buffer) + kSignalBytes;
  for (int c = 0; c < kIpcChannels; ++c) {
    peers[c].signals[rank] = static_cast<IpcSignals*>(buffer);
    peers[c].input[rank] = at;
    peers[c].result[rank] = at + capacity[c];
    at += 2 * capacity[c];
  }
  for (int c = 0; c < kIpcChannels; ++c) peers[c].rings[rank] = ringBytes ? at : nullptr;
}

IpcStatus* IpcMapping::status() const {
  return reinterpret_cast<IpcStatus*>(static_cast<char*>(hostWords) + kStatusOffset);
}

IpcGroup::IpcGroup(std::shared_ptr<DeviceRuntime> runtime, Store& store, const std::string& prefix,
                   int rank, int size, size_t eagerBytes, size_t graphBytes, size_t p2pBytes,
                   Clock::time_point deadline)
    : runtime_(std::move(runtime)),
      rank_(rank),
      size_(size),
      capacity_{(eagerBytes + 255) & ~size_t(255), (graphBytes + 255) & ~size_t(255)},
      ringBytes_(size > 1 ? (p2pBytes / size_t(size - 1)) & ~size_t(255) : 0),
      sent_(size_t(size)),
      received_(size_t(size)),
      devices_(size_t(size), -1) {
  devices_[rank] = runtime_->device();
  if (size > kIpcMaxRanks) {
    // Every rank sees the same size: no exchange needed to agree.
    why_ = CLAWCOMM_CONCAT(size, " ranks share this host and CUDA IPC groups hold up to ",
                           kIpcMaxRanks);
    return;
  }
  setUp(store, prefix, deadline);
}

void IpcGroup::setUp(Store& store, const std::string& prefix, Clock::time_point deadline) {
  auto key = [&](const char* what, int r) { return CLAWCOMM_CONCAT(prefix, what, "/", r); };
  const std::string me = CLAWCOMM_CONCAT("rank ", rank_, " (", runtime_->kind(), " device ",
                                         runtime_->device(), "): ");
  std::string local;   // what failed on this rank
  std::string remote;  // what peers said failed on them (they post it in their verdict too)
  auto note = [&](std::string& where, const std::string& what) {
    where += (where.empty() ? "" : "; ") + what;
  };

  // 1. Our buffer and its handle, posted as "<device>|<handle>" or "!<why>".
  std::vector<uint8_t> handle;
  try {
    map_ = std::make_shared<IpcMapping>(runtime_, capacity_[kIpcEager], capacity_[kIpcGraph],
                                        ringBytes_, size_);
    for (IpcPeers& p : map_->peers) {
      p.rank = rank_;
      p.size = size_;
    }
    map_->base = runtime_->allocShared(map_->bufferBytes());
    runtime_->fill(map_->base, 0, kSignalBytes);
    const uint32_t hello = helloValue(rank_);
    runtime_->toDevice(&static_cast<IpcSignals*>(map_->base)->hello, &hello, sizeof(hello));
    map_->map(rank_, map_->base);
    handle = runtime_->exportHandle(map_->base);
  } catch (const std::exception& e) {
    note(local, me + e.what());
  }
  std::vector<uint8_t> posted =
      bytesOf(local.empty() ? CLAWCOMM_CONCAT(runtime_->device(), "|") : kFailed + local);
  if (local.empty()) posted.insert(posted.end(), handle.begin(), handle.end());
  store.set(key("handle", rank_), posted);

  // 2. Every peer's handle, opened.
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    std::vector<uint8_t> theirs;
    try {
      theirs = store.get(key("handle", p), deadline);
    } catch (const std::exception& e) {
      note(local, CLAWCOMM_CONCAT(me, "rank ", p, " never posted its handle (", e.what(), ")"));
      continue;
    }
    const std::string text(theirs.begin(), theirs.end());
    if (text.compare(0, kFailed.size(), kFailed) == 0) {
      note(remote, text.substr(kFailed.size()));
      continue;
    }
    const size_t bar = text.find('|');
    devices_[p] = std::atoi(text.substr(0, bar).c_str());
    if (!local.empty()) continue;
    try {
      void* ptr =
          runtime_->openHandle(std::vector<uint8_t>(theirs.begin() + long(bar) + 1, theirs.end()));
      map_->opened.push_back(ptr);
      map_->map(p, ptr);
    } catch (const std::exception& e) {
      note(local, CLAWCOMM_CONCAT(me, "cannot open rank ", p, "'s buffer: ", e.what()));
    }
  }

  // 3. The probe, where everything so far worked; then a store-side barrier.
  const bool probed = local.empty() && remote.empty();
  if (probed) {
    try {
      IpcLaunch probe;
      probe.kernel = IpcKernel::kProbe;
      probe.peers = map_->peers[kIpcEager];
      probe.peers.timeoutNs = 0;
      runtime_->launch(probe, nullptr);
      runtime_->synchronize();
    } catch (const std::exception& e) {
      note(local, me + "the probe kernel failed: " + e.what());
    }
  }
  store.set(key("probed", rank_), bytesOf("1"));
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    try {
      store.get(key("probed", p), deadline);
    } catch (const std::exception& e) {
      note(local, CLAWCOMM_CONCAT(me, "rank ", p, " never finished the probe (", e.what(), ")"));
    }
  }
  if (probed && local.empty()) {
    IpcSignals mine;
    try {
      runtime_->toHost(&mine, map_->base, sizeof(mine));
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        if (mine.probe[p] != probeValue(p, rank_)) {
          note(local, CLAWCOMM_CONCAT(me, "rank ", p, "'s stores do not reach this rank's memory"));
        }
        if (mine.loaded[p] != helloValue(p)) {
          note(local, CLAWCOMM_CONCAT(me, "loads from rank ", p, "'s memory read 0x", std::hex,
                                      mine.loaded[p], " instead of what it wrote"));
        }
      }
    } catch (const std::exception& e) {
      note(local, me + "reading the probe's results failed: " + e.what());
    }
  }

  // 4. Verdicts: the group's is everybody's.
  store.set(key("verdict", rank_), bytesOf(local.empty() ? "ok" : local));
  for (int p = 0; p < size_; ++p) {
    std::string v = local.empty() ? "ok" : local;
    if (p != rank_) {
      try {
        const std::vector<uint8_t> theirs = store.get(key("verdict", p), deadline);
        v.assign(theirs.begin(), theirs.end());
      } catch (const std::exception& e) {
        v = CLAWCOMM_CONCAT("rank ", p, " never posted its verdict (", e.what(), ")");
      }
    }
    if (v != "ok") note(why_, v);
  }
  if (map_ && map_->base) runtime_->setupDone(map_->base);
  if (!why_.empty()) map_.reset();  // unusable: free everything now
}

IpcStatus IpcGroup::status() const {
  IpcStatus s{};
  if (!map_) return s;
  const IpcStatus* live = map_->status();
  s.state = live->state;
  if (s.state != kIpcOk) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);  // the fields were written before the state
    s.block = live->block;
    s.waitedFor = live->waitedFor;
    s.phase = live->phase;
    s.epoch = live->epoch;
    s.channel = live->channel;
    s.waitedNs = live->waitedNs;
    s.expected = live->expected;
    s.found = live->found;
    s.ours = live->ours;
    s.theirs = live->theirs;
  }
  return s;
}

void IpcGroup::abort() {
  if (!map_) return;
  __atomic_store_n(map_->abortFlag(), 1u, __ATOMIC_SEQ_CST);
  runtime_->writeWordNow(&map_->peers[kIpcEager].signals[rank_]->failed, 1);
}

IpcLaunch IpcGroup::launchOf(IpcKernel kernel, const void* in, void* out, size_t packs,
                             const Launch& how, bool direct) const {
  IpcLaunch L;
  L.kernel = kernel;
  L.peers = peers(how);
  L.peers.timeoutNs = how.timeoutNs;
  L.call = how.call;
  L.in = direct ? static_cast<const Pack*>(in) : nullptr;
  L.out = direct ? static_cast<Pack*>(out) : nullptr;
  L.packs = packs;
  // Two-shot splits the message among the ranks first.
  L.blocks = blocksFor(kernel == IpcKernel::kTwoShot ? packs / size_t(size_) + 1 : packs,
                       runtime_->maxBlocks());
  return L;
}

void IpcGroup::launchP2p(IpcKernel kernel, int peer, uint32_t count, uint64_t tag, uint64_t bytes,
                         uint64_t offset, const Launch& how) const {
  IpcLaunch L = launchOf(kernel, nullptr, nullptr, 0, how, false);
  L.blocks = 1;
  L.p2p.peer = peer;
  L.p2p.count = count;
  L.p2p.header = IpcMessageHeader{tag, bytes};
  L.p2p.offset = offset;
  runtime_->launch(L, how.stream);
}

char* IpcGroup::ringFor(int from, int to) const {
  return map_->peers[kIpcEager].rings[from] + size_t(to) * ringBytes_;
}

void IpcGroup::copy(void* dst, const void* src, size_t bytes, Stream s) const {
  if (bytes) runtime_->copy(dst, src, bytes, s);
}

void IpcGroup::piecesIn(const void* in, size_t bytes, const Launch& how) const {
  for (int q = 0; q < size_; ++q) {
    copy(peers(how).input[rank_] + q * roundUp(bytes), static_cast<const char*>(in) + q * bytes,
         bytes, how.stream);
  }
}

void IpcGroup::piecesOut(void* out, size_t bytes, const Launch& how) const {
  for (int q = 0; q < size_; ++q) {
    copy(static_cast<char*>(out) + q * bytes, peers(how).result[rank_] + q * roundUp(bytes), bytes,
         how.stream);
  }
}

void IpcGroup::allReduce(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                         IpcKernel algo, const Launch& how) {
  const size_t es = elementSize(type);
  const size_t per = capacity_[how.channel] / es;
  const int me = rank_;
  for (size_t at = 0; at < count; at += per) {
    const size_t n = std::min(per, count - at);
    const char* i = static_cast<const char*>(in) + at * es;
    char* o = static_cast<char*>(out) + at * es;
    const bool direct = aligned16(i) && aligned16(o) && (n * es) % 16 == 0;
    if (!direct) copy(peers(how).input[me], i, n * es, how.stream);
    IpcLaunch L = launchOf(algo, i, o, packsOf(n * es), how, direct);
    L.type = type;
    L.op = op;
    runtime_->launch(L, how.stream);
    if (!direct) copy(o, peers(how).result[me], n * es, how.stream);
  }
}

void IpcGroup::allGather(const void* in, void* out, size_t bytes, const Launch& how) {
  if (bytes == 0) return;
  const bool direct = aligned16(in) && aligned16(out) && bytes % 16 == 0;
  const int me = rank_;
  if (!direct) copy(peers(how).input[me], in, bytes, how.stream);
  runtime_->launch(launchOf(IpcKernel::kAllGather, in, out, packsOf(bytes), how, direct),
                   how.stream);
  if (!direct) piecesOut(out, bytes, how);
}

void IpcGroup::reduceScatter(const void* in, void* out, size_t countPerRank, DataType type,
                             ReduceOp op, const Launch& how) {
  const size_t bytes = countPerRank * elementSize(type);
  if (bytes == 0) return;
  const bool direct = aligned16(in) && aligned16(out) && bytes % 16 == 0;
  const int me = rank_;
  if (!direct) piecesIn(in, bytes, how);
  IpcLaunch L = launchOf(IpcKernel::kReduceScatter, in, out, packsOf(bytes), how, direct);
  L.type = type;
  L.op = op;
  runtime_->launch(L, how.stream);
  if (!direct) copy(out, peers(how).result[me], bytes, how.stream);
}

void IpcGroup::broadcast(void* buf, size_t bytes, int root, const Launch& how) {
  if (bytes == 0) return;
  const bool direct = aligned16(buf) && bytes % 16 == 0;
  const int me = rank_;
  if (!direct && me == root) copy(peers(how).input[root], buf, bytes, how.stream);
  IpcLaunch L = launchOf(IpcKernel::kBroadcast, buf, buf, packsOf(bytes), how, direct);
  L.root = root;
  runtime_->launch(L, how.stream);
  if (!direct && me != root) copy(buf, peers(how).result[me], bytes, how.stream);
}

void IpcGroup::allToAll(const void* in, void* out, size_t bytes, const Launch& how) {
  if (bytes == 0) return;
  const bool direct = aligned16(in) && aligned16(out) && bytes % 16 == 0;
  if (!direct) piecesIn(in, bytes, how);
  runtime_->launch(launchOf(IpcKernel::kAllToAll, in, out, packsOf(bytes), how, direct),
                   how.stream);
  if (!direct) piecesOut(out, bytes, how);
}

void IpcGroup::send(const void* in, size_t bytes, int peer, uint64_t tag, const Launch& how) {
  CLAWCOMM_CHECK(how.channel == kIpcEager && ringBytes_ >= P2pRing::footprint(bytes),
                 "IpcGroup::send outside its rings");
  const P2pRing::Slot at = sent_[size_t(peer)].place(bytes, ringBytes_);
  if (at.need) launchP2p(IpcKernel::kP2pSpace, peer, at.need, tag, bytes, at.offset, how);
  copy(ringFor(rank_, peer) + at.offset + 16, in, bytes, how.stream);
  launchP2p(IpcKernel::kP2pPost, peer, at.count, tag, bytes, at.offset, how);
}

P2pRing::Slot IpcGroup::placeRecv(size_t bytes, int peer) {
  CLAWCOMM_CHECK(ringBytes_ >= P2pRing::footprint(bytes), "IpcGroup::recv outside its rings");
  return received_[size_t(peer)].place(bytes, ringBytes_);
}

void IpcGroup::recv(const P2pRing::Slot& at, void* out, size_t bytes, int peer, uint64_t tag,
                    const Launch& how) {
  CLAWCOMM_CHECK(how.channel == kIpcEager, "IpcGroup::recv outside its rings");
  launchP2p(IpcKernel::kP2pArrive, peer, at.count, tag, bytes, at.offset, how);
  copy(out, ringFor(peer, rank_) + at.offset + 16, bytes, how.stream);
  launchP2p(IpcKernel::kP2pTake, peer, at.count, tag, bytes, at.offset, how);
}

}  // namespace device
}  // namespace clawcomm
