// Connecting a group: through the Store, agree on a random job token, learn
// which ranks share a host, create the endpoints each rank needs, exchange
// their addresses, connect every pair, and drop the setup resources (shm
// names, listening sockets) once every rank is connected.
#pragma once

#include <memory>
#include <vector>

#include "common/settings.h"
#include "common/store.h"
#include "transport/transport.h"

namespace clawcomm {

struct Connections {
  std::vector<std::unique_ptr<Connection>> toRank;  // one per rank, null for this rank
  int sameHostRanks = 1;                            // ranks on this rank's host, itself included
  std::vector<int> hostOf = {0};  // each rank's host, numbered by first appearance
  std::string jobToken;           // the group's random token (hex)
  std::string storeNamespace;     // this group's store keys' prefix ("clawcomm/<generation>/")
};

// Connects this rank to every other through the transport registry
// (transport/registry.h).
Connections rendezvous(Store& store, int rank, int size, const Settings& settings,
                       Clock::time_point deadline);

}  // namespace clawcomm
