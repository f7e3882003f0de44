// TCP transport between ranks on different hosts (or on one host, with
// CLAWCOMM_TRANSPORT=tcp).
//
// Every rank listens on an ephemeral port. For each pair the higher rank
// connects and the lower one accepts; the connecting side opens with a hello
// carrying its rank, the job's random token and which of the pair's
// sockets it is, and the acceptor drops any connection that presents a
// different token. A pair uses CLAWCOMM_SOCKETS_PER_PEER sockets, and its
// byte stream is striped over them in 256 KiB units (TcpConnection).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace clawcomm {

class TcpEndpoint : public Endpoint {
 public:
  // `hostAddr` is the IPv4 address published to peers, and the only one the
  // socket listens on.
  // `stripes` sockets per peer.
  TcpEndpoint(uint64_t jobToken, int rank, int size, const std::string& hostAddr, int stripes = 1);
  static constexpr size_t kHelloBytes = 24;
  ~TcpEndpoint() override;

  std::string address() const override { return address_; }
  std::unique_ptr<Connection> connect(int peer, const std::string& peerAddress,
                                      Clock::time_point deadline) override;
  void finishSetup() override;

  // The address to publish when CLAWCOMM_SOCKET_ADDR is unset: the
  // interface's IPv4 address if `ifname` is set (CLAWCOMM_SOCKET_IFNAME; one
  // without an address is an InvalidArgument), else the host name's first
  // non-loopback IPv4 address, else 127.0.0.1.
  static std::string defaultHostAddress(const std::string& ifname = "");

 private:
  // An accepted socket whose hello has not all arrived yet.
  struct Pending {
    int fd;
    std::string from;           // "address:port", for the log
    Clock::time_point helloBy;  // dropped if the hello is not complete by then
    uint8_t hello[kHelloBytes];
    size_t got = 0;
  };

  // The peer's sockets, by stripe.
  std::vector<int> acceptFrom(int peer, Clock::time_point deadline);
  int connectOne(const std::string& peerAddress, int peer, int stripe, Clock::time_point deadline);
  void acceptNew(Clock::time_point now);
  // Reads what pending[i]'s socket has; true when it is settled (accepted
  // into acceptedEarly_, or refused).
  bool readHello(Pending& p);
  void refuse(int fd, const std::string& from, const std::string& why);

  uint64_t token_;
  int rank_;
  int size_;
  int stripes_;
  int listenFd_ = -1;
  std::string address_;
  // Peer rank -> its sockets (by stripe; -1 until accepted), accepted before
  // they were asked for.
  std::map<int, std::vector<int>> acceptedEarly_;
  std::vector<Pending> pending_;
  size_t refused_ = 0;  // connections refused during setup (logged)
};

}  // namespace clawcomm
