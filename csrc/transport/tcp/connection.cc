#include "transport/tcp/connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "common/errors.h"

namespace clawcomm {
namespace {

constexpr uint32_t kHelloMagic = 0x636c7463;  // "cltc"
constexpr size_t kStagingBytes = size_t(1) << 20;
// The unit a striped stream puts on one socket before moving to the next.
constexpr size_t kStripeBytes = size_t(256) << 10;
// Setup: an accepted socket must deliver its whole hello within kHelloTime
// (a peer sends it right after connecting, and retries if dropped); at most
// kMaxPending sockets wait for theirs; the first kRefusalsLogged refusals
// are logged one by one, the rest counted.
constexpr std::chrono::milliseconds kHelloTime(2000);
constexpr size_t kMaxPending = 256;
constexpr size_t kRefusalsLogged = 5;

struct Hello {
  uint32_t magic;
  int32_t rank;
  uint64_t token;
  uint32_t stripe;   // which of the pair's sockets this is
  uint32_t stripes;  // how many the connecting rank opens (must match)
};
static_assert(sizeof(Hello) == TcpEndpoint::kHelloBytes, "TcpEndpoint::Pending holds a hello");

std::string sysError(const char* what) {
  return CLAWCOMM_CONCAT(what, ": ", std::strerror(errno));
}

int remainingMs(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms < 0 ? 0 : int(std::min<long long>(ms, 1000));
}

// Blocking exact read/write with a deadline, used only during setup.
bool ioExact(int fd, void* buf, size_t n, bool reading, Clock::time_point deadline) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    pollfd pfd{fd, short(reading ? POLLIN : POLLOUT), 0};
    if (poll(&pfd, 1, remainingMs(deadline)) <= 0) {
      if (Clock::now() >= deadline) return false;
      continue;
    }
    ssize_t r = reading ? ::recv(fd, p, n, 0) : ::send(fd, p, n, MSG_NOSIGNAL);
    if (r <= 0) {
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return false;
    }
    p += r;
    n -= size_t(r);
  }
  return true;
}

void tuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// One peer's byte stream over `stripes` sockets: the stream is cut into
// units of kStripeBytes, and unit u travels on socket u % stripes. Both
// sides walk the sockets in the same order, so the reader reassembles the
// stream by reading each unit from its socket in turn (while it waits on
// one socket, the others' bytes wait in their kernel buffers and keep
// flowing). With one socket this is a plain TCP stream.
class TcpConnection : public Connection {
 public:
  TcpConnection(std::vector<int> fds, int peer)
      : fds_(std::move(fds)), peer_(peer), staging_(kStagingBytes) {
    for (int fd : fds_) tuneSocket(fd);
  }
  ~TcpConnection() override {
    for (int fd : fds_) ::close(fd);
  }

  size_t write(const void* data, size_t n) override {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    size_t done = 0;
    while (done < n) {
      const size_t want = std::min(n - done, kStripeBytes - writeUnit_);
      const ssize_t r = ::send(fds_[writeStripe_], p + done, want, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " is unreachable over TCP (",
                                        std::strerror(errno), "); it died or aborted"));
      }
      done += size_t(r);
      writeUnit_ += size_t(r);
      if (writeUnit_ == kStripeBytes) {
        writeUnit_ = 0;
        writeStripe_ = (writeStripe_ + 1) % fds_.size();
      } else if (size_t(r) < want) {
        break;  // this socket is full
      }
    }
    return done;
  }

  Readable peek() override {
    if (rpos_ == wpos_) {
      rpos_ = wpos_ = 0;
    } else if (staging_.size() - wpos_ < staging_.size() / 4 && rpos_ >= 8) {
      // Compact, keeping the stream offset's alignment modulo 8 so that
      // elements read in place stay aligned.
      const size_t dst = rpos_ % 8;
      std::memmove(staging_.data() + dst, staging_.data() + rpos_, wpos_ - rpos_);
      wpos_ = dst + (wpos_ - rpos_);
      rpos_ = dst;
    }
    while (!eof_ && wpos_ < staging_.size()) {
      const size_t want = std::min(staging_.size() - wpos_, kStripeBytes - readUnit_);
      const ssize_t r = ::recv(fds_[readStripe_], staging_.data() + wpos_, want, MSG_DONTWAIT);
      if (r > 0) {
        wpos_ += size_t(r);
        readUnit_ += size_t(r);
        if (readUnit_ == kStripeBytes) {
          readUnit_ = 0;
          readStripe_ = (readStripe_ + 1) % fds_.size();
          continue;  // the next unit may be waiting on the next socket
        }
        if (size_t(r) == want) continue;
      } else if (r == 0) {
        eof_ = true;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        eof_ = true;
        eofError_ = std::strerror(errno);
      }
      break;
    }
    return Readable{staging_.data() + rpos_, wpos_ - rpos_};
  }

  void consume(size_t n) override { rpos_ += n; }

  void checkPeer(bool waitingOnIt) override {
    // An abort arrives as a frame (read by the messenger) or as end of
    // stream, which only matters when this rank waits on the peer.
    if (!waitingOnIt) return;
    if (!eof_) {
      for (int fd : fds_) {
        pollfd pfd{fd, POLLRDHUP, 0};
        if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
          if (fd == fds_[readStripe_]) {
            peek();  // drain what is left; sets eof_ once the stream is empty
          } else {
            eof_ = true;  // another socket of the stream is gone: so is the peer
          }
        }
      }
    }
    if (eof_ && rpos_ == wpos_) {
      throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " closed its TCP connection",
                                      eofError_.empty() ? "" : " (" + eofError_ + ")",
                                      "; it died or aborted"));
    }
  }

  std::string stall() const override {
    for (int fd : fds_) {
      tcp_info info{};
      socklen_t len = sizeof(info);
      if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;
      if (info.tcpi_unacked > 0 && info.tcpi_last_ack_recv >= kStallMs) {
        return CLAWCOMM_CONCAT(info.tcpi_unacked, " TCP segments unacknowledged, no ACK for ",
                               info.tcpi_last_ack_recv / 1000.0, " s (", info.tcpi_total_retrans,
                               " retransmissions)");
      }
    }
    return {};
  }

  void abort(const std::string&) override {
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
  }
  void close() override {
    for (int fd : fds_) shutdown(fd, SHUT_WR);
  }
  // The socket the next bytes arrive on, and the one the next bytes leave
  // on: what a sleeping reader or a blocked writer waits for.
  int pollFd() const override { return fds_[readStripe_]; }
  int writePollFd() const override { return fds_[writeStripe_]; }
  std::vector<int> allFds() const override { return fds_; }
  const char* kind() const override { return "tcp"; }

 private:
  static constexpr uint32_t kStallMs = 1000;  // no ACK for this long: the link looks cut
  std::vector<int> fds_;
  int peer_;
  std::vector<uint8_t> staging_;
  size_t rpos_ = 0;
  size_t wpos_ = 0;
  size_t writeStripe_ = 0, writeUnit_ = 0;  // where the next byte written goes
  size_t readStripe_ = 0, readUnit_ = 0;    // where the next byte read comes from
  bool eof_ = false;
  std::string eofError_;
};

}  // namespace

std::string TcpEndpoint::defaultHostAddress(const std::string& ifname) {
  if (!ifname.empty()) {
    ifaddrs* list = nullptr;
    std::string found, seen;
    if (getifaddrs(&list) == 0) {
      for (ifaddrs* a = list; a; a = a->ifa_next) {
        if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
        seen += std::string(seen.empty() ? "" : ", ") + a->ifa_name;
        if (ifname != a->ifa_name || !found.empty()) continue;
        char buf[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf,
                  sizeof(buf));
        found = buf;
      }
      freeifaddrs(list);
    }
    CLAWCOMM_ARG_CHECK(
        !found.empty(), "clawcomm: CLAWCOMM_SOCKET_IFNAME=", ifname,
        " has no IPv4 address here (interfaces with one: ", seen.empty() ? "none" : seen, ")");
    return found;
  }
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) == 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host, nullptr, &hints, &res) == 0) {
      for (addrinfo* a = res; a; a = a->ai_next) {
        auto* sin = reinterpret_cast<sockaddr_in*>(a->ai_addr);
        char buf[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
        if (std::strncmp(buf, "127.", 4) != 0) {
          freeaddrinfo(res);
          return buf;
        }
      }
      freeaddrinfo(res);
    }
  }
  return "127.0.0.1";
}

TcpEndpoint::TcpEndpoint(uint64_t jobToken, int rank, int size, const std::string& hostAddr,
                         int stripes)
    : token_(jobToken), rank_(rank), size_(size), stripes_(stripes) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, hostAddr.c_str(), &addr.sin_addr) != 1) {
    throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm tcp: ", hostAddr,
                                          " is not an IPv4 address (CLAWCOMM_SOCKET_ADDR)"));
  }
  listenFd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listenFd_ < 0) throw Error(sysError("clawcomm tcp: socket"));
  if (bind(listenFd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listenFd_, size * stripes + 64) != 0) {
    const std::string why = sysError("bind/listen");
    ::close(listenFd_);
    throw Error(CLAWCOMM_CONCAT("clawcomm tcp: rank ", rank, " cannot listen on ", hostAddr, ": ",
                                why, " (is it this host's address? see CLAWCOMM_SOCKET_ADDR)"));
  }
  socklen_t len = sizeof(addr);
  getsockname(listenFd_, reinterpret_cast<sockaddr*>(&addr), &len);
  address_ = hostAddr + ":" + std::to_string(ntohs(addr.sin_port));
}

TcpEndpoint::~TcpEndpoint() {
  finishSetup();
  for (auto& kv : acceptedEarly_) {
    for (int fd : kv.second) {
      if (fd >= 0) ::close(fd);
    }
  }
}

void TcpEndpoint::finishSetup() {
  if (listenFd_ < 0) return;  // done already
  ::close(listenFd_);
  listenFd_ = -1;
  for (const Pending& p : pending_) ::close(p.fd);
  pending_.clear();
  if (refused_ > kRefusalsLogged) {
    std::fprintf(stderr, "clawcomm tcp: rank %d refused %zu connections during setup\n", rank_,
                 refused_);
  }
}

void TcpEndpoint::refuse(int fd, const std::string& from, const std::string& why) {
  ::close(fd);
  if (++refused_ <= kRefusalsLogged) {
    std::fprintf(stderr, "clawcomm tcp: rank %d refused a connection from %s: %s%s\n", rank_,
                 from.c_str(), why.c_str(),
                 refused_ == kRefusalsLogged ? " (further refusals are only counted)" : "");
  }
}

void TcpEndpoint::acceptNew(Clock::time_point now) {
  for (int i = 0; i < 64; ++i) {  // a bounded batch, so hellos are read in between
    sockaddr_in from{};
    socklen_t len = sizeof(from);
    const int fd =
        accept4(listenFd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN: nobody else waiting (or a transient error)
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &from.sin_addr, ip, sizeof(ip));
    std::string who = CLAWCOMM_CONCAT(ip, ":", ntohs(from.sin_port));
    if (pending_.size() >= kMaxPending) {  // a flood: the oldest goes
      refuse(pending_.front().fd, pending_.front().from, "too many connections without a hello");
      pending_.erase(pending_.begin());
    }
    pending_.push_back(Pending{fd, std::move(who), now + kHelloTime});
  }
}

bool TcpEndpoint::readHello(Pending& p) {
  while (p.got < sizeof(Hello)) {
    const ssize_t r = ::recv(p.fd, p.hello + p.got, sizeof(Hello) - p.got, MSG_DONTWAIT);
    if (r > 0) {
      p.got += size_t(r);
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    refuse(p.fd, p.from, "closed before its hello");
    return true;
  }
  Hello hello;
  std::memcpy(&hello, p.hello, sizeof(hello));
  std::string why;
  if (hello.magic != kHelloMagic) {
    why = "not a clawcomm hello";
  } else if (hello.token != token_) {
    why = "wrong job token";
  } else if (hello.rank <= rank_ || hello.rank >= size_) {
    why = CLAWCOMM_CONCAT("rank ", hello.rank, " does not connect to rank ", rank_);
  } else if (int(hello.stripes) != stripes_ || int(hello.stripe) >= stripes_) {
    why = CLAWCOMM_CONCAT("rank ", hello.rank, " opens ", hello.stripes, " sockets per peer, rank ",
                          rank_, " ", stripes_, " (CLAWCOMM_SOCKETS_PER_PEER must match)");
  } else if (acceptedEarly_.count(hello.rank) && acceptedEarly_[hello.rank][hello.stripe] >= 0) {
    why = CLAWCOMM_CONCAT("rank ", hello.rank, " socket ", hello.stripe, " is already connected");
  }
  const uint8_t ack = 'K';
  if (why.empty() && ::send(p.fd, &ack, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
    why = "could not be acknowledged";
  }
  if (!why.empty()) {
    refuse(p.fd, p.from, why);
    return true;
  }
  std::vector<int>& fds = acceptedEarly_[hello.rank];
  if (fds.empty()) fds.assign(size_t(stripes_), -1);
  fds[hello.stripe] = p.fd;
  return true;
}

// Accepted sockets and their hellos are handled together in one poll loop,
// so a client that connects and then sends nothing (or too little, or
// garbage) never holds up a peer's hello: it is dropped after kHelloTime.
std::vector<int> TcpEndpoint::acceptFrom(int peer, Clock::time_point deadline) {
  std::vector<pollfd> fds;
  while (true) {
    auto early = acceptedEarly_.find(peer);
    if (early != acceptedEarly_.end() &&
        std::count(early->second.begin(), early->second.end(), -1) == 0) {
      std::vector<int> all = std::move(early->second);
      acceptedEarly_.erase(early);
      return all;
    }
    Clock::time_point now = Clock::now();
    if (now >= deadline) {
      throw TimeoutError(CLAWCOMM_CONCAT("clawcomm tcp: rank ", rank_,
                                         " timed out waiting for rank ", peer, " to connect"));
    }
    Clock::time_point wake = deadline;
    fds.assign(1, pollfd{listenFd_, POLLIN, 0});
    for (const Pending& p : pending_) {
      fds.push_back(pollfd{p.fd, POLLIN, 0});
      wake = std::min(wake, p.helloBy);
    }
    poll(fds.data(), fds.size(), remainingMs(wake));
    now = Clock::now();
    // Settle the pending sockets (hello complete, refused or expired).
    std::vector<Pending> waiting;
    for (size_t i = 0; i < pending_.size(); ++i) {
      Pending& p = pending_[i];
      const bool ready = fds[i + 1].revents != 0;
      if (ready && readHello(p)) continue;
      if (now >= p.helloBy) {
        refuse(p.fd, p.from, CLAWCOMM_CONCAT("no hello within ", kHelloTime.count(), " ms"));
        continue;
      }
      waiting.push_back(p);
    }
    pending_ = std::move(waiting);
    if (fds[0].revents & POLLIN) acceptNew(now);
  }
}

std::unique_ptr<Connection> TcpEndpoint::connect(int peer, const std::string& peerAddress,
                                                 Clock::time_point deadline) {
  if (peer > rank_) return std::make_unique<TcpConnection>(acceptFrom(peer, deadline), peer);
  std::vector<int> fds;
  try {
    for (int stripe = 0; stripe < stripes_; ++stripe) {
      fds.push_back(connectOne(peerAddress, peer, stripe, deadline));
    }
  } catch (...) {
    for (int fd : fds) ::close(fd);
    throw;
  }
  return std::make_unique<TcpConnection>(std::move(fds), peer);
}

int TcpEndpoint::connectOne(const std::string& peerAddress, int peer, int stripe,
                            Clock::time_point deadline) {
  const size_t colon = peerAddress.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (colon == std::string::npos ||
      inet_pton(AF_INET, peerAddress.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    throw Error(
        CLAWCOMM_CONCAT("clawcomm tcp: rank ", peer, " published a bad address ", peerAddress));
  }
  addr.sin_port = htons(uint16_t(std::atoi(peerAddress.c_str() + colon + 1)));
  std::string lastProblem = "no attempt finished";
  while (true) {
    // Non-blocking connect, the hello and the ack, all under the deadline;
    // any failure is retried (the peer may not listen yet, or may have
    // dropped us behind a flood of strays) until the deadline passes.
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) throw Error(sysError("clawcomm tcp: socket"));
    bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (!connected && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      if (poll(&pfd, 1, remainingMs(deadline)) > 0) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        connected = err == 0;
        if (!connected) lastProblem = std::strerror(err);
      } else {
        lastProblem = "the connection did not complete";
      }
    } else if (!connected) {
      lastProblem = std::strerror(errno);
    }
    if (connected) {
      Hello hello{kHelloMagic, rank_, token_, uint32_t(stripe), uint32_t(stripes_)};
      uint8_t ack = 0;
      if (ioExact(fd, &hello, sizeof(hello), false, deadline) &&
          ioExact(fd, &ack, 1, true, deadline) && ack == 'K') {
        return fd;
      }
      lastProblem = "rank " + std::to_string(peer) + " did not acknowledge the hello";
    }
    ::close(fd);
    if (Clock::now() >= deadline) {
      throw TimeoutError(CLAWCOMM_CONCAT("clawcomm tcp: rank ", rank_, " cannot connect to rank ",
                                         peer, " at ", peerAddress, ": ", lastProblem));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace clawcomm
