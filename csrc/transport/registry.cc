#include "transport/registry.h"

#include "common/errors.h"
#include "transport/shm/connection.h"
#include "transport/tcp/connection.h"

namespace clawcomm {
namespace {

bool sameHost(const RankInfo& a, const RankInfo& b) {
  return a.host == b.host;
}

bool anyPair(const RankInfo&, const RankInfo&) {
  return true;
}

std::unique_ptr<Endpoint> makeShm(const EndpointSetup& s) {
  SingleCopyPolicy single;
  single.probe = s.settings->singleCopy != Settings::SingleCopy::kOff;
  single.required = s.settings->singleCopy == Settings::SingleCopy::kCma ||
                    s.settings->singleCopy == Settings::SingleCopy::kAll;
  single.everyOp = s.settings->singleCopy == Settings::SingleCopy::kAll;
  single.minBytes = s.settings->singleCopyMinBytes;
  single.measure = !s.settings->singleCopyMinBytesSet;
  return std::make_unique<ShmEndpoint>(s.jobTokenHex, s.rank, s.size, s.settings->shmRingBytes,
                                       s.peersOf, single);
}

std::unique_ptr<Endpoint> makeTcp(const EndpointSetup& s) {
  const std::string& addr = s.settings->socketAddr;
  return std::make_unique<TcpEndpoint>(
      s.jobToken, s.rank, s.size,
      addr.empty() ? TcpEndpoint::defaultHostAddress(s.settings->socketIfname) : addr);
}

std::string names() {
  std::string out = "auto";
  for (const TransportEntry& t : transportRegistry()) out += std::string(", ") + t.name;
  return out;
}

}  // namespace

const std::vector<TransportEntry>& transportRegistry() {
  static const std::vector<TransportEntry> table = {
      {"shm", sameHost, makeShm},
      {"tcp", anyPair, makeTcp},
  };
  return table;
}

const TransportEntry& transportNamed(const std::string& name) {
  for (const TransportEntry& t : transportRegistry()) {
    if (name == t.name) return t;
  }
  throw InvalidArgument(
      CLAWCOMM_CONCAT("clawcomm: CLAWCOMM_TRANSPORT=", name, " is not one of ", names()));
}

void checkTransportSetting(const std::string& value) {
  if (value != "auto") transportNamed(value);
}

}  // namespace clawcomm
