// Connecting a group: through the Store, agree on a random job token, learn
// which ranks share a host, create the endpoints each rank needs, exchange
// their addresses, connect every pair, and drop the setup resources (shm
// names, listening sockets) once every rank is connected.
//
// The steps from the endpoints on (connectPeers) are shared with a group
// split from another (comm/split.cc), which knows the token and the hosts
// already and swaps the addresses over its parent's connections instead of
// the store: the SetupExchange is the seam between the two.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/status_pages.h"
#include "common/settings.h"
#include "common/store.h"
#include "transport/registry.h"
#include "transport/transport.h"

namespace clawcomm {

struct Connections {
  std::vector<std::unique_ptr<Connection>> toRank;  // one per rank, null for this rank
  int sameHostRanks = 1;                            // ranks on this rank's host, itself included
  std::vector<int> hostOf = {0};   // each rank's host, numbered by first appearance
  std::string jobToken;            // the group's random token (hex)
  std::string storeNamespace;      // this group's store keys' prefix ("clawcomm/<generation>/")
  std::vector<std::string> hosts;  // each rank's host identity (RankInfo::host)
  std::unique_ptr<StatusPages> status;  // this rank's status page (null for a group of one)
};

// What the ranks of a new group swap once they agree on who is where: each
// rank's endpoint addresses, then word that it has connected. Each call
// blocks until every rank has made it (or throws naming the rank that
// failed or never came).
class SetupExchange {
 public:
  virtual ~SetupExchange() = default;
  // This rank's address for each transport of the registry, in its order
  // ("" for a transport this rank does not use).
  virtual void publish(const std::vector<std::string>& addresses) = 0;
  // Rank `peer`'s address for the registry's transport `transport`.
  virtual std::string addressOf(int peer, size_t transport) = 0;
  // Says that this rank has connected to all its peers; returns once every
  // rank has.
  virtual void connected() = 0;
};

// Who a new group is: this rank, the group's random token (hex), and where
// every rank runs.
struct GroupPlan {
  int rank = 0;
  int size = 1;
  std::string tokenHex;
  std::vector<RankInfo> ranks;
};

// The text a setup step posts in place of its value when this rank's setup
// failed, followed by why: whoever reads it fails too, naming this rank.
extern const std::string kSetupFailed;

// Ranks as "[0, 2, 3]", for messages.
std::string describeRanks(const std::vector<int>& ranks);

// A group's random token as its 16 hex digits (Connections::jobToken).
std::string tokenHex(uint64_t token);

// Each host identity's number, numbered by first appearance (Topology's
// hostOf).
std::vector<int> hostNumbers(const std::vector<std::string>& hosts);

// Chooses each pair's transport, creates this rank's endpoints, swaps their
// addresses through `exchange`, connects every pair, and drops the setup
// resources once every rank has connected. Fills `out.toRank`, one
// connection per rank (null for this rank), and `out.status`, this rank's
// status page in the group's table.
void connectPeers(const GroupPlan& plan, const Settings& settings, SetupExchange& exchange,
                  Clock::time_point deadline, Connections& out);

// Connects the ranks of `plan`, whose members, hosts and token are known
// already (a shrunk group's: Communicator::shrink), through the store's
// keys under `ns`. On failure this rank posts why in place of each key it
// had yet to set, so that the ranks waiting on it fail at once, naming it.
void connectThroughStore(Store& store, const std::string& ns, const GroupPlan& plan,
                         const Settings& settings, Clock::time_point deadline, Connections& out);

// Connects this rank to every other through the transport registry
// (transport/registry.h).
Connections rendezvous(Store& store, int rank, int size, const Settings& settings,
                       Clock::time_point deadline);

}  // namespace clawcomm
