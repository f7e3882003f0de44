#include "comm/rendezvous.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "common/errors.h"
#include "transport/registry.h"

namespace clawcomm {
namespace {

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

}  // namespace

Connections rendezvous(Store& store, int rank, int size, const Settings& settings,
                       Clock::time_point deadline) {
  Connections out;
  auto& conns = out.toRank;
  conns.resize(static_cast<size_t>(size));
  if (size == 1) return out;

  // 1. The job token: random, from rank 0. Every TCP connection presents it
  //    and it names the shm segments, so two jobs never cross.
  if (rank == 0) {
    std::random_device rd;
    const uint64_t token = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid());
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(token));
    store.set("clawcomm/token", bytesOf(hex));
  }
  const std::string tokenHex = stringOf(store.get("clawcomm/token"));
  out.jobToken = tokenHex;
  const uint64_t token = std::stoull(tokenHex, nullptr, 16);

  // 2. Where everybody runs, and which transport setting they use.
  const std::string host = settings.hostId.empty() ? hostIdentity() : settings.hostId;
  const std::string mySetting = settings.transport + "|" + std::to_string(settings.shmRingBytes);
  store.set("clawcomm/host/" + std::to_string(rank), bytesOf(host + "|" + mySetting));
  std::vector<RankInfo> ranks(static_cast<size_t>(size));
  for (int p = 0; p < size; ++p) {
    const std::string theirs =
        stringOf(store.get("clawcomm/host/" + std::to_string(p)));  // "host|transport|ring bytes"
    const size_t bar = theirs.find('|');
    if (theirs.substr(bar + 1) != mySetting) {
      throw InvalidArgument(CLAWCOMM_CONCAT(
          "clawcomm: rank ", p, " runs with transport|ring bytes ", theirs.substr(bar + 1),
          ", rank ", rank, " with ", mySetting,
          "; CLAWCOMM_TRANSPORT and CLAWCOMM_SHM_RING_BYTES must match on every rank"));
    }
    ranks[p].rank = p;
    ranks[p].host = theirs.substr(0, bar);
    if (p != rank) out.sameHostRanks += ranks[p].host == host;
  }

  // 3. Each pair's transport: the forced one, which must be able to connect
  //    it, or the first in the registry that can.
  const auto& registry = transportRegistry();
  std::vector<const TransportEntry*> chosen(static_cast<size_t>(size), nullptr);
  std::vector<bool> used(registry.size(), false);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    for (size_t i = 0; i < registry.size(); ++i) {
      const TransportEntry& t = registry[i];
      if (settings.transport != "auto" && settings.transport != t.name) continue;
      if (!t.canConnect(ranks[rank], ranks[p])) {
        if (settings.transport == t.name) {
          throw InvalidArgument(CLAWCOMM_CONCAT(
              "clawcomm: CLAWCOMM_TRANSPORT=", t.name, " cannot connect rank ", rank, " (host ",
              ranks[rank].host, ") with rank ", p, " (host ", ranks[p].host, ")"));
        }
        continue;
      }
      chosen[p] = &t;
      used[i] = true;
      break;
    }
    CLAWCOMM_CHECK(chosen[p] != nullptr, "no transport connects rank ", rank, " with rank ", p);
  }

  // 4. Create the endpoints this rank needs and publish their addresses
  //    (an empty one for a transport it does not use).
  const EndpointSetup setup{tokenHex, token, rank, size, &settings};
  std::vector<std::unique_ptr<Endpoint>> endpoints(registry.size());
  for (size_t i = 0; i < registry.size(); ++i) {
    if (used[i]) endpoints[i] = registry[i].makeEndpoint(setup);
    store.set(CLAWCOMM_CONCAT("clawcomm/addr/", registry[i].name, "/", rank),
              bytesOf(endpoints[i] ? endpoints[i]->address() : ""));
  }

  // 5. Connect every pair, each through its transport's endpoint.
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const size_t i = size_t(chosen[p] - registry.data());
    const std::string addr =
        stringOf(store.get(CLAWCOMM_CONCAT("clawcomm/addr/", registry[i].name, "/", p)));
    conns[p] = endpoints[i]->connect(p, addr, deadline);
    if (settings.debug) {
      std::cerr << "clawcomm: rank " << rank << " -> rank " << p << " over " << registry[i].name
                << " (" << addr << ")\n";
    }
  }

  // 6. Once everybody has mapped and connected, nothing needs the names any
  //    more: unlink the segment so a crash cannot leak it.
  store.set("clawcomm/connected/" + std::to_string(rank), bytesOf("1"));
  for (int p = 0; p < size; ++p) {
    if (p != rank) store.get("clawcomm/connected/" + std::to_string(p));
  }
  for (auto& e : endpoints) {
    if (e) e->finishSetup();
  }
  return out;
}

}  // namespace clawcomm
