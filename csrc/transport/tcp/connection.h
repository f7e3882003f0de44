// TCP transport between ranks on different hosts (or on one host, with
// CLAWCOMM_TRANSPORT=tcp).
//
// Every rank listens on an ephemeral port. For each pair the higher rank
// connects and the lower one accepts; the connecting side opens with a hello
// carrying its rank and the job's random token, and the acceptor drops any
// connection that presents a different token.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "transport/transport.h"

namespace clawcomm {

class TcpEndpoint : public Endpoint {
 public:
  // `hostAddr` is the IPv4 address published to peers; the socket listens on
  // every interface.
  TcpEndpoint(uint64_t jobToken, int rank, int size, const std::string& hostAddr);
  ~TcpEndpoint() override;

  std::string address() const override { return address_; }
  std::unique_ptr<Connection> connect(int peer, const std::string& peerAddress,
                                      Clock::time_point deadline) override;
  void finishSetup() override;

  // The address to publish when CLAWCOMM_SOCKET_ADDR is unset: the host
  // name's first non-loopback IPv4 address, else 127.0.0.1.
  static std::string defaultHostAddress();

 private:
  int acceptFrom(int peer, Clock::time_point deadline);

  uint64_t token_;
  int rank_;
  int size_;
  int listenFd_ = -1;
  std::string address_;
  std::map<int, int> acceptedEarly_;  // peer rank -> socket accepted before it was asked for
};

}  // namespace clawcomm
