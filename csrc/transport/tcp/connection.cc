#include "transport/tcp/connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "common/errors.h"

namespace clawcomm {
namespace {

constexpr uint32_t kHelloMagic = 0x636c7463;  // "cltc"
constexpr size_t kStagingBytes = size_t(1) << 20;

struct Hello {
  uint32_t magic;
  int32_t rank;
  uint64_t token;
};

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

class TcpConnection : public Connection {
 public:
  TcpConnection(int fd, int peer) : fd_(fd), peer_(peer), staging_(kStagingBytes) {
    tuneSocket(fd_);
  }
  ~TcpConnection() override { ::close(fd_); }

  size_t write(const void* data, size_t n) override {
    if (n == 0) return 0;
    ssize_t r = ::send(fd_, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r >= 0) return size_t(r);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " is unreachable over TCP (",
                                    std::strerror(errno), "); it died or aborted"));
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
    if (!eof_ && wpos_ < staging_.size()) {
      ssize_t r = ::recv(fd_, staging_.data() + wpos_, staging_.size() - wpos_, MSG_DONTWAIT);
      if (r > 0) {
        wpos_ += size_t(r);
      } else if (r == 0) {
        eof_ = true;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        eof_ = true;
        eofError_ = std::strerror(errno);
      }
    }
    return Readable{staging_.data() + rpos_, wpos_ - rpos_};
  }

  void consume(size_t n) override { rpos_ += n; }

  void checkPeer(bool waitingOnIt) override {
    // An abort arrives as a frame (read by the messenger) or as end of
    // stream, which only matters when this rank waits on the peer.
    if (!waitingOnIt) return;
    if (!eof_) {
      pollfd pfd{fd_, POLLRDHUP, 0};
      if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
        peek();  // drain what is left; sets eof_ once the stream is empty
      }
    }
    if (eof_ && rpos_ == wpos_) {
      throw PeerError(CLAWCOMM_CONCAT("rank ", peer_, " closed its TCP connection",
                                      eofError_.empty() ? "" : " (" + eofError_ + ")",
                                      "; it died or aborted"));
    }
  }

  void abort(const std::string&) override { shutdown(fd_, SHUT_RDWR); }
  void close() override { shutdown(fd_, SHUT_WR); }
  int pollFd() const override { return fd_; }
  const char* kind() const override { return "tcp"; }

 private:
  int fd_;
  int peer_;
  std::vector<uint8_t> staging_;
  size_t rpos_ = 0;
  size_t wpos_ = 0;
  bool eof_ = false;
  std::string eofError_;
};

}  // namespace

std::string TcpEndpoint::defaultHostAddress() {
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

TcpEndpoint::TcpEndpoint(uint64_t jobToken, int rank, int size, const std::string& hostAddr)
    : token_(jobToken), rank_(rank), size_(size) {
  listenFd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listenFd_ < 0) throw Error(sysError("clawcomm tcp: socket"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (bind(listenFd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listenFd_, size + 8) != 0) {
    throw Error(sysError("clawcomm tcp: bind/listen"));
  }
  socklen_t len = sizeof(addr);
  getsockname(listenFd_, reinterpret_cast<sockaddr*>(&addr), &len);
  address_ = hostAddr + ":" + std::to_string(ntohs(addr.sin_port));
}

TcpEndpoint::~TcpEndpoint() {
  finishSetup();
  for (auto& kv : acceptedEarly_) ::close(kv.second);
}

void TcpEndpoint::finishSetup() {
  if (listenFd_ >= 0) {
    ::close(listenFd_);
    listenFd_ = -1;
  }
}

int TcpEndpoint::acceptFrom(int peer, Clock::time_point deadline) {
  while (true) {
    auto early = acceptedEarly_.find(peer);
    if (early != acceptedEarly_.end()) {
      int fd = early->second;
      acceptedEarly_.erase(early);
      return fd;
    }
    pollfd pfd{listenFd_, POLLIN, 0};
    if (poll(&pfd, 1, remainingMs(deadline)) <= 0) {
      if (Clock::now() >= deadline) {
        throw TimeoutError(CLAWCOMM_CONCAT("clawcomm tcp: rank ", rank_,
                                           " timed out waiting for rank ", peer, " to connect"));
      }
      continue;
    }
    int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Hello hello{};
    if (!ioExact(fd, &hello, sizeof(hello), true, Clock::now() + std::chrono::seconds(10)) ||
        hello.magic != kHelloMagic || hello.token != token_ || hello.rank <= rank_ ||
        hello.rank >= size_ || acceptedEarly_.count(hello.rank)) {
      // Not one of ours (wrong token, stray client, or a duplicate): drop it.
      ::close(fd);
      continue;
    }
    const uint8_t ack = 'K';
    if (!ioExact(fd, const_cast<uint8_t*>(&ack), 1, false, deadline)) {
      ::close(fd);
      continue;
    }
    acceptedEarly_[hello.rank] = fd;
  }
}

std::unique_ptr<Connection> TcpEndpoint::connect(int peer, const std::string& peerAddress,
                                                 Clock::time_point deadline) {
  if (peer < rank_) {
    const size_t colon = peerAddress.rfind(':');
    CLAWCOMM_CHECK(colon != std::string::npos, "bad tcp address ", peerAddress);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(std::stoi(peerAddress.substr(colon + 1))));
    if (inet_pton(AF_INET, peerAddress.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
      throw Error(
          CLAWCOMM_CONCAT("clawcomm tcp: rank ", peer, " published a bad address ", peerAddress));
    }
    while (true) {
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
        Hello hello{kHelloMagic, rank_, token_};
        uint8_t ack = 0;
        if (ioExact(fd, &hello, sizeof(hello), false, deadline) &&
            ioExact(fd, &ack, 1, true, deadline) && ack == 'K') {
          return std::make_unique<TcpConnection>(fd, peer);
        }
      }
      const int err = errno;
      ::close(fd);
      if (Clock::now() >= deadline) {
        throw TimeoutError(CLAWCOMM_CONCAT("clawcomm tcp: rank ", rank_, " cannot connect to rank ",
                                           peer, " at ", peerAddress, ": ", std::strerror(err)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return std::make_unique<TcpConnection>(acceptFrom(peer, deadline), peer);
}

}  // namespace clawcomm
