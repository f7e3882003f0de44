#include "comm/rendezvous.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "common/errors.h"
#include "transport/shm/connection.h"
#include "transport/tcp/connection.h"

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

const char* transportName(TransportChoice t) {
  switch (t) {
    case TransportChoice::kShm: return "shm";
    case TransportChoice::kTcp: return "tcp";
    default: return "auto";
  }
}

}  // namespace

std::vector<std::unique_ptr<Connection>> rendezvous(Store& store, int rank, int size,
                                                    const Settings& settings,
                                                    Clock::time_point deadline) {
  std::vector<std::unique_ptr<Connection>> conns(static_cast<size_t>(size));
  if (size == 1) return conns;

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
  const uint64_t token = std::stoull(tokenHex, nullptr, 16);

  // 2. Where everybody runs, and which transport setting they use.
  const std::string host = settings.hostId.empty() ? hostIdentity() : settings.hostId;
  const std::string me =
      host + "|" + transportName(settings.transport) + "|" + std::to_string(settings.shmRingBytes);
  store.set("clawcomm/host/" + std::to_string(rank), bytesOf(me));
  std::vector<std::string> hosts(static_cast<size_t>(size));
  std::vector<bool> useShm(static_cast<size_t>(size), false);
  bool anyShm = false, anyTcp = false;
  for (int p = 0; p < size; ++p) {
    hosts[p] = p == rank ? me : stringOf(store.get("clawcomm/host/" + std::to_string(p)));
    const std::string theirs = hosts[p].substr(hosts[p].find('|'));
    const std::string mine = me.substr(me.find('|'));
    if (theirs != mine) {
      throw InvalidArgument(CLAWCOMM_CONCAT(
          "clawcomm: rank ", p, " runs with transport|ring bytes ", theirs.substr(1), ", rank ",
          rank, " with ", mine.substr(1),
          "; CLAWCOMM_TRANSPORT and CLAWCOMM_SHM_RING_BYTES must match on every rank"));
    }
    if (p == rank) continue;
    const bool sameHost = hosts[p] == me;
    if (settings.transport == TransportChoice::kShm && !sameHost) {
      throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm: CLAWCOMM_TRANSPORT=shm but rank ", p,
                                            " runs on another host than rank ", rank));
    }
    useShm[p] = settings.transport == TransportChoice::kShm ||
                (settings.transport == TransportChoice::kAuto && sameHost);
    anyShm |= useShm[p];
    anyTcp |= !useShm[p];
  }

  // 3. Create the endpoints this rank needs and publish their addresses.
  std::unique_ptr<Endpoint> shm, tcp;
  if (anyShm) shm = std::make_unique<ShmEndpoint>(tokenHex, rank, size, settings.shmRingBytes);
  if (anyTcp) {
    const std::string addr =
        settings.socketAddr.empty() ? TcpEndpoint::defaultHostAddress() : settings.socketAddr;
    tcp = std::make_unique<TcpEndpoint>(token, rank, size, addr);
  }
  store.set("clawcomm/addr/shm/" + std::to_string(rank), bytesOf(shm ? shm->address() : ""));
  store.set("clawcomm/addr/tcp/" + std::to_string(rank), bytesOf(tcp ? tcp->address() : ""));

  // 4. Connect every pair. TCP endpoints pair up by rank order themselves;
  //    shared memory needs only the peer's segment name.
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const char* kind = useShm[p] ? "shm" : "tcp";
    const std::string addr = stringOf(store.get(CLAWCOMM_CONCAT("clawcomm/addr/", kind, "/", p)));
    conns[p] = (useShm[p] ? shm : tcp)->connect(p, addr, deadline);
    if (settings.debug) {
      std::cerr << "clawcomm: rank " << rank << " -> rank " << p << " over " << kind << " (" << addr
                << ")\n";
    }
  }

  // 5. Once everybody has mapped and connected, nothing needs the names any
  //    more: unlink the segment so a crash cannot leak it.
  store.set("clawcomm/connected/" + std::to_string(rank), bytesOf("1"));
  for (int p = 0; p < size; ++p) {
    if (p != rank) store.get("clawcomm/connected/" + std::to_string(p));
  }
  if (shm) shm->finishSetup();
  if (tcp) tcp->finishSetup();
  return conns;
}

}  // namespace clawcomm
