#include "comm/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "algorithms/topology.h"
#include "common/errors.h"
#include "transport/registry.h"

namespace clawcomm {

// Posted in place of every key a rank had yet to set when its setup fails,
// so that whoever waits for one of them learns at once what went wrong (and
// where), instead of timing out on the wrong rank.
const std::string kSetupFailed = "!failed: ";

namespace {

// CLAWCOMM_SHM_PEERS=auto gives every pair of a host a ring up to this many
// ranks on it, and only the pairs the collectives use beyond.
constexpr int kDenseShmRanks = 16;

std::vector<uint8_t> bytesOf(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}
std::string stringOf(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

// Ranks with equal host identities share memory: the host name plus the boot
// id, so that two machines with the same name never pair up.
std::string hostIdentity() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + boot;
}

// "CLAWCOMM_CUDA_IPC: rank p has 0, this rank auto; ..." for each setting of
// Settings::mustMatch() whose values differ.
std::string settingsThatDiffer(const std::string& theirs, const std::string& mine) {
  auto split = [](const std::string& s) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t at = 0;
    while (at <= s.size()) {
      size_t end = s.find('|', at);
      if (end == std::string::npos) end = s.size();
      const std::string item = s.substr(at, end - at);
      const size_t eq = item.find('=');
      out.emplace_back(item.substr(0, eq), eq == std::string::npos ? "" : item.substr(eq + 1));
      at = end + 1;
    }
    return out;
  };
  const auto a = split(theirs), b = split(mine);
  if (a.size() != b.size()) return "a different clawcomm version";
  std::string out;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      out += CLAWCOMM_CONCAT(out.empty() ? "" : "; ", b[i].first, "=", a[i].second, " there, ",
                             b[i].second, " here");
    }
  }
  return out;
}

// Store waits run this much past the group's deadline: a rank whose own wait
// on a dead peer (a socket, say) ran out at the deadline has that long to
// post its failure for the ranks that wait on it.
constexpr std::chrono::milliseconds kGrace(500);

// Raises the arrival count to `end`, the first arrival of the next
// generation, unless it is there already. A setup that timed out because a
// rank never came leaves the count short of its generation's end; the next
// group on this store would then straddle two generations and wait for
// itself until the timeout. Compare-and-set, so that the ranks of one
// generation that timed out raise it once between them. A rank that comes
// after the close lands alone in the next generation, times out and closes
// that one: the count heals itself.
void closeGeneration(Store& store, const std::string& arrivals, int64_t end) {
  for (;;) {
    const int64_t count = store.add(arrivals, 0);
    if (count >= end || store.compareSet(arrivals, std::to_string(count), std::to_string(end))) {
      return;
    }
  }
}

// The group's keys in the store, under its namespace: what this rank sets
// (`published` collects the keys, without the prefix, for the failure
// notice) and what it waits for.
class StoreBoard {
 public:
  StoreBoard(Store& store, std::string ns, int rank, Clock::time_point deadline,
             std::vector<std::string>& published)
      : store_(store),
        ns_(std::move(ns)),
        rank_(rank),
        deadline_(deadline),
        published_(published),
        started_(Clock::now()) {}

  void publish(const std::string& key, const std::vector<uint8_t>& value) {
    store_.set(ns_ + key, value);
    published_.push_back(key);
  }

  // Waits for `key`, which rank `p` sets; the error names the rank that
  // never came, or says why it failed.
  std::vector<uint8_t> waitFor(const std::string& key, int p, const char* what) {
    std::vector<uint8_t> value;
    try {
      value = store_.get(ns_ + key, deadline_ + kGrace);
    } catch (const TimeoutError& e) {
      throw TimeoutError(CLAWCOMM_CONCAT(
          "clawcomm: rank ", rank_, " gave up setting up the group after ",
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_).count(),
          " ms: rank ", p, " never ", what, " (it died, hangs, or did not create the group; ",
          e.what(), ")"));
    }
    const std::string text = stringOf(value);
    if (text.compare(0, kSetupFailed.size(), kSetupFailed) == 0) {
      throw Error(CLAWCOMM_CONCAT("clawcomm: rank ", rank_, " cannot set up the group: rank ", p,
                                  " failed: ", text.substr(kSetupFailed.size())));
    }
    return value;
  }

 private:
  Store& store_;
  std::string ns_;
  int rank_;
  Clock::time_point deadline_;
  std::vector<std::string>& published_;
  Clock::time_point started_;
};

// The addresses and the "connected" word, through the store: a key per
// rank, each read when it is needed.
class StoreExchange final : public SetupExchange {
 public:
  StoreExchange(StoreBoard& board, int rank, int size) : board_(board), rank_(rank), size_(size) {}

  void publish(const std::vector<std::string>& addresses) override {
    const auto& registry = transportRegistry();
    for (size_t i = 0; i < registry.size(); ++i) {
      board_.publish(CLAWCOMM_CONCAT("addr/", registry[i].name, "/", rank_), bytesOf(addresses[i]));
    }
  }

  std::string addressOf(int peer, size_t transport) override {
    return stringOf(
        board_.waitFor(CLAWCOMM_CONCAT("addr/", transportRegistry()[transport].name, "/", peer),
                       peer, "published its address"));
  }

  void connected() override {
    board_.publish("connected/" + std::to_string(rank_), bytesOf("1"));
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) board_.waitFor("connected/" + std::to_string(p), p, "finished connecting");
    }
  }

 private:
  StoreBoard& board_;
  int rank_;
  int size_;
};

// Connects this rank; `published` collects the keys it set (without the
// prefix), for the failure notice.
Connections connectAll(Store& store, const std::string& ns, int rank, int size,
                       const Settings& settings, Clock::time_point deadline,
                       std::vector<std::string>& published) {
  Connections out;
  out.storeNamespace = ns;
  StoreBoard board(store, ns, rank, deadline, published);

  // 1. The job token: random, from rank 0. Every TCP connection presents it
  //    and it names the shm segments, so two jobs never cross.
  if (rank == 0) {
    std::random_device rd;
    board.publish("token", bytesOf(tokenHex((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid()))));
  }
  GroupPlan plan;
  plan.rank = rank;
  plan.size = size;
  plan.tokenHex = stringOf(board.waitFor("token", 0, "published the job token"));
  out.jobToken = plan.tokenHex;

  // 2. Where everybody runs, and the settings every rank must share.
  const std::string host = settings.hostId.empty() ? hostIdentity() : settings.hostId;
  const std::string mySettings = settings.mustMatch();
  board.publish("host/" + std::to_string(rank), bytesOf(host + "\n" + mySettings));
  plan.ranks.resize(static_cast<size_t>(size));
  for (int p = 0; p < size; ++p) {
    const std::string theirs = stringOf(
        board.waitFor("host/" + std::to_string(p), p, "joined"));  // "host\nNAME=value|..."
    const size_t cut = theirs.find('\n');
    const std::string differ = settingsThatDiffer(theirs.substr(cut + 1), mySettings);
    if (!differ.empty()) {
      throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: rank ", p, " and rank ", rank,
                                            " run with different settings (", differ,
                                            "); these must match on every rank"));
    }
    plan.ranks[p].rank = p;
    plan.ranks[p].host = theirs.substr(0, cut);
    if (p != rank) out.sameHostRanks += plan.ranks[p].host == host;
  }
  for (const RankInfo& r : plan.ranks) out.hosts.push_back(r.host);
  out.hostOf = hostNumbers(out.hosts);

  // 3-6. The endpoints, their addresses through the store, every pair.
  StoreExchange exchange(board, rank, size);
  connectPeers(plan, settings, exchange, deadline, out);
  return out;
}

// Posts `why` in place of every key this rank had yet to set: `keys`, its
// addresses and its "connected" word (`published` holds those it set).
void postFailure(Store& store, const std::string& ns, int rank, std::vector<std::string> keys,
                 const std::vector<std::string>& published, const std::string& why) {
  keys.push_back("connected/" + std::to_string(rank));
  for (const auto& t : transportRegistry()) {
    keys.push_back(CLAWCOMM_CONCAT("addr/", t.name, "/", rank));
  }
  for (const auto& key : keys) {
    if (std::find(published.begin(), published.end(), key) != published.end()) continue;
    try {
      store.set(ns + key, bytesOf(kSetupFailed + why));
    } catch (...) {  // the store is gone too: the others time out instead
      return;
    }
  }
}

}  // namespace

void connectThroughStore(Store& store, const std::string& ns, const GroupPlan& plan,
                         const Settings& settings, Clock::time_point deadline, Connections& out) {
  std::vector<std::string> published;
  try {
    StoreBoard board(store, ns, plan.rank, deadline, published);
    StoreExchange exchange(board, plan.rank, plan.size);
    connectPeers(plan, settings, exchange, deadline, out);
  } catch (const std::exception& e) {
    postFailure(store, ns, plan.rank, {}, published, e.what());
    throw;
  }
}

std::string describeRanks(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += CLAWCOMM_CONCAT(i ? ", " : "", ranks[i]);
  return out + "]";
}

std::string tokenHex(uint64_t token) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(token));
  return hex;
}

std::vector<int> hostNumbers(const std::vector<std::string>& hosts) {
  std::vector<int> out;
  std::vector<std::string> seen;
  for (const std::string& h : hosts) {
    auto it = std::find(seen.begin(), seen.end(), h);
    out.push_back(int(it - seen.begin()));
    if (it == seen.end()) seen.push_back(h);
  }
  return out;
}

void connectPeers(const GroupPlan& plan, const Settings& settings, SetupExchange& exchange,
                  Clock::time_point deadline, Connections& out) {
  const int rank = plan.rank;
  const int size = plan.size;
  const auto& ranks = plan.ranks;
  const uint64_t token = std::stoull(plan.tokenHex, nullptr, 16);
  std::vector<std::string> hosts;
  for (const RankInfo& r : ranks) hosts.push_back(r.host);

  // 3. Each pair's transport: the forced one, which must be able to connect
  //    it, or the first in the registry that can. With sparse shared-memory
  //    peers (CLAWCOMM_SHM_PEERS), a pair of one host that the reducing
  //    collectives do not use goes on to TCP over loopback. Every rank
  //    evaluates the same rule, so both ends of a pair agree.
  const Topology topology(hostNumbers(hosts));
  std::vector<int> hostRanks(size_t(topology.hosts()), 0);
  for (int p = 0; p < size; ++p) ++hostRanks[size_t(topology.hostOf(p))];
  const auto sparse = [&](int a) {
    return settings.shmPeers == Settings::ShmPeers::kSparse ||
           (settings.shmPeers == Settings::ShmPeers::kAuto &&
            hostRanks[size_t(topology.hostOf(a))] > kDenseShmRanks);
  };
  const auto& registry = transportRegistry();
  const auto choose = [&](int a, int b) -> size_t {
    for (size_t i = 0; i < registry.size(); ++i) {
      const TransportEntry& t = registry[i];
      if (settings.transport != "auto" && settings.transport != t.name) continue;
      if (!t.canConnect(ranks[a], ranks[b])) {
        if (settings.transport == t.name) {
          throw InvalidArgument(CLAWCOMM_CONCAT(
              "clawcomm: CLAWCOMM_TRANSPORT=", t.name, " cannot connect rank ", a, " (host ",
              ranks[a].host, ") with rank ", b, " (host ", ranks[b].host, ")"));
        }
        continue;
      }
      if (settings.transport == "auto" && std::string(t.name) == "shm" && sparse(a) &&
          !topology.frequentPair(a, b)) {
        continue;
      }
      return i;
    }
    CLAWCOMM_CHECK(false, "no transport connects rank ", a, " with rank ", b);
    return 0;
  };
  std::vector<size_t> chosen(static_cast<size_t>(size), 0);
  std::vector<bool> used(registry.size(), false);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    chosen[p] = choose(rank, p);
    used[chosen[p]] = true;
  }

  // 4. Create the endpoints this rank needs and publish their addresses
  //    (an empty one for a transport it does not use).
  std::vector<std::unique_ptr<Endpoint>> endpoints(registry.size());
  std::vector<std::string> addresses(registry.size());
  // If anything below throws, the endpoints' destructors clean up (shm
  // names, this rank's and any peer's, and listening sockets).
  for (size_t i = 0; i < registry.size(); ++i) {
    if (!used[i]) continue;
    EndpointSetup setup{plan.tokenHex, token, rank, size, &settings, {}};
    // Whom each rank of this host reaches through transport i.
    setup.peersOf.resize(size_t(size));
    for (int q = 0; q < size; ++q) {
      if (topology.hostOf(q) != topology.hostOf(rank)) continue;
      for (int r = 0; r < size; ++r) {
        if (r != q && choose(q, r) == i) setup.peersOf[size_t(q)].push_back(r);
      }
    }
    endpoints[i] = registry[i].makeEndpoint(setup);
    addresses[i] = endpoints[i]->address();
  }
  // The group's status pages on this machine, opened before the addresses
  // go out, so that every rank has opened them by the last step below
  // (which unlinks their name).
  auto status = std::make_unique<StatusPages>(plan.tokenHex, rank, size);
  exchange.publish(addresses);

  // 5. Connect every pair, each through its transport's endpoint.
  std::vector<std::unique_ptr<Connection>> conns(static_cast<size_t>(size));
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const size_t i = chosen[p];
    const std::string addr = exchange.addressOf(p, i);
    conns[p] = endpoints[i]->connect(p, addr, deadline);
    if (settings.debug) {
      std::cerr << "clawcomm: rank " << rank << " -> rank " << p << " over " << registry[i].name
                << " (" << addr << ")\n";
    }
  }

  // 6. Once everybody has mapped and connected, nothing needs the names any
  //    more: unlink the segments so a crash cannot leak them.
  exchange.connected();
  for (auto& e : endpoints) {
    if (e) e->finishSetup();
  }
  status->unlink();
  out.toRank = std::move(conns);
  out.status = std::move(status);
}

Connections rendezvous(Store& store, int rank, int size, const Settings& settings,
                       Clock::time_point deadline) {
  if (size == 1) {
    Connections out;
    out.toRank.resize(1);
    return out;
  }
  // 0. The generation: a store that already served a group of this size
  //    (a reused FileStore, say) holds that group's keys. Every rank counts
  //    its arrival among the groups of its size, and a group's keys live
  //    under the number of such groups that arrived before it, so nobody
  //    reads a predecessor's token. Counted per size: a group of another
  //    size in between must not shift the count. A setup that timed out
  //    closes its generation (below), so that the ranks it lacked do not
  //    shift the count either.
  const std::string arrivals = CLAWCOMM_CONCAT("clawcomm/arrivals/", size);
  const int64_t generation = (store.add(arrivals, 1) - 1) / size;
  const std::string ns = CLAWCOMM_CONCAT("clawcomm/", size, "/", generation, "/");
  std::vector<std::string> published;
  try {
    return connectAll(store, ns, rank, size, settings, deadline, published);
  } catch (const std::exception& e) {
    std::vector<std::string> keys = {"host/" + std::to_string(rank)};
    if (rank == 0) keys.push_back("token");
    postFailure(store, ns, rank, std::move(keys), published, e.what());
    // A rank that timed out waiting closes the generation: by now everybody
    // who will come has. One that failed on its own does not, since its
    // peers may still be on their way to read its notice.
    if (dynamic_cast<const TimeoutError*>(&e) != nullptr) {
      try {
        closeGeneration(store, arrivals, (generation + 1) * size);
      } catch (...) {  // the store is gone: nobody can reuse it either
      }
    }
    throw;
  }
}

}  // namespace clawcomm
