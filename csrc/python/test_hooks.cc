// Test hooks: the messenger's frame parser fed bytes as a peer would send
// them, with no peer behind them (tests/test_wire.py and bench/fuzz_frames.py
// throw malformed and hostile streams at it), and a communicator whose last
// reference is dropped inside a completion callback (tests/test_failures.py).
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/errors.h"
#include "messenger/messenger.h"
#include "python/engine_bindings.h"
#include "transport/shm/connection.h"

namespace clawcomm {
namespace {

// Rank 1's side of the stream, as received by rank 0: `data`, then its end.
class BytesConnection final : public Connection {
 public:
  explicit BytesConnection(std::string data) : data_(std::move(data)) {}
  size_t write(const void*, size_t n) override { return n; }
  Readable peek() override {
    return Readable{reinterpret_cast<const uint8_t*>(data_.data()) + pos_, data_.size() - pos_};
  }
  void consume(size_t n) override { pos_ += n; }
  void checkPeer(bool waitingOnIt) override {
    if (waitingOnIt && pos_ == data_.size()) throw PeerError("rank 1's stream ended");
  }
  void abort(const std::string&) override {}
  void close() override {}
  const char* kind() const override { return "bytes"; }

 private:
  std::string data_;
  size_t pos_ = 0;
};

// Parses `data` as rank 1's frames to rank 0, then, if recvBytes >= 0,
// receives one point-to-point message of that size with tag 0 from rank 1.
// Returns the error the messenger raised, or "" if it raised none.
std::string feedFrames(std::string data, int64_t recvBytes) {
  std::vector<std::unique_ptr<Connection>> conns(2);
  conns[1] = std::make_unique<BytesConnection>(std::move(data));
  try {
    Messenger m(0, 2, std::move(conns), 0, 0);
    while (m.progress()) {
    }
    if (recvBytes >= 0) {
      std::vector<uint8_t> buffer(static_cast<size_t>(recvBytes));
      auto t = m.recvPointToPoint(1, 0, buffer.data(), buffer.size());
      while (m.progress()) {
      }
      if (!t->complete) m.waitAll(std::vector<TransferPtr>{t}, Clock::now());  // raises: incomplete
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A group of one needs no store.
class NoStore final : public Store {
 public:
  void set(const std::string&, const std::vector<uint8_t>&) override { unused(); }
  std::vector<uint8_t> get(const std::string&, Clock::time_point) override { unused(); }
  int64_t add(const std::string&, int64_t) override { unused(); }
  bool compareSet(const std::string&, const std::string&, const std::string&) override { unused(); }

 private:
  [[noreturn]] static void unused() { throw Error("NoStore: a group of one has no store"); }
};

// Creates a communicator of one rank, runs an all-reduce whose completion
// callback drops the last reference to it, and says on which thread the
// callback ran: the progress thread (which cannot join itself) for a large
// op, the caller's own for a small one run inline (whose op is not
// finished when the callback runs).
std::string dropLastReferenceInCallback(bool small) {
  auto holder = std::make_shared<std::shared_ptr<Communicator>>(
      Communicator::create(std::make_shared<NoStore>(), 0, 1, std::chrono::seconds(10)));
  std::promise<std::string> where;
  // Above CLAWCOMM_INLINE_BYTES the progress thread runs it; a small op
  // runs inline, on this thread.
  std::vector<float> x(small ? size_t(4) : size_t(1) << 22, 1.0f);
  (*holder)->allReduce(
      x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum, [holder, &where](std::exception_ptr) {
        const bool progress = (*holder)->onProgressThread();
        const bool here = (*holder)->runningInlineHere();
        holder->reset();  // the last reference
        where.set_value(progress ? "progress thread" : here ? "caller, inline" : "another thread");
      });
  return where.get_future().get();
}

// A peer that writes its last frame and exits just as this rank looks
// whether its process is gone: peerLeftNothing must not call it dead.
bool peerDiesJustAfterItsLastWrite() {
  bool written = false;
  return peerLeftNothing([&] { return written = true; }, [] { return false; },
                         [&] { return written; });
}

}  // namespace

void bindTestHooks(pybind11::module_& m) {
  m.def("_peer_dies_just_after_its_last_write", &peerDiesJustAfterItsLastWrite,
        "Test hook: whether a shared-memory peer that writes its last frame and exits just as "
        "this rank looks at its process is taken for dead with nothing written (it must not be).");
  m.def("_drop_last_reference_in_callback", &dropLastReferenceInCallback,
        pybind11::arg("small") = false, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Test hook: a one-rank communicator's last reference dropped inside its completion "
        "callback (small: an op run inline on the caller's thread); returns the thread the "
        "callback ran on.");
  m.def("_feed_frames", &feedFrames, pybind11::arg("data"), pybind11::arg("recv_bytes") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Test hook: parses `data` as the frames rank 1 sends rank 0, then receives a "
        "point-to-point message of recv_bytes (tag 0) if recv_bytes >= 0. Returns the error "
        "raised, or ''.");
}

}  // namespace clawcomm
