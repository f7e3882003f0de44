// The transports, as one table (NCCL's transport table is the model).
//
// Rendezvous gives each pair of ranks the first transport, in table order,
// whose canConnect() accepts the pair, and makes this rank's endpoint for
// every transport it uses. So a new transport is its folder (connection.h
// and connection.cc, with its Connection and Endpoint) and one row in
// registry.cc; nothing above transport/ names it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/settings.h"
#include "transport/transport.h"

namespace clawcomm {

// What rendezvous knows about a rank when it picks a transport for a pair.
struct RankInfo {
  int rank = -1;
  std::string host;  // host identity: ranks with equal ones share memory
};

// What an endpoint is made from.
struct EndpointSetup {
  std::string jobTokenHex;  // names shared-memory segments
  uint64_t jobToken = 0;    // every TCP connection presents it
  int rank = -1;
  int size = 0;
  const Settings* settings = nullptr;
  // For every rank of this rank's host (empty for the others): the ranks it
  // reaches through this transport, ascending. A shared-memory segment
  // holds one ring per such peer, in this order.
  std::vector<std::vector<int>> peersOf;
};

struct TransportEntry {
  const char* name;  // "shm", "tcp": what CLAWCOMM_TRANSPORT and transport_of() say
  // Whether this transport can connect ranks `a` and `b`.
  bool (*canConnect)(const RankInfo& a, const RankInfo& b);
  std::unique_ptr<Endpoint> (*makeEndpoint)(const EndpointSetup& setup);
};

// Every transport, in order of preference.
const std::vector<TransportEntry>& transportRegistry();

// The entry called `name`; InvalidArgument naming the choices if there is
// none. "auto" is not a transport (it means: the registry's order).
const TransportEntry& transportNamed(const std::string& name);

// Checks a CLAWCOMM_TRANSPORT value: "auto" or a registered name.
void checkTransportSetting(const std::string& value);

}  // namespace clawcomm
