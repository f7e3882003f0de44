// The communicator's public operations: each checks its arguments here, on
// the caller's thread (so a bad call fails before any byte is sent), and
// hands one closure to the queue (comm/communicator.cc).
#include <cmath>
#include <cstring>
#include <numeric>

#include "algorithms/algorithms.h"
#include "algorithms/channel.h"
#include "comm/communicator.h"
#include "common/errors.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {

Algorithm Communicator::algorithmFor(OpType op, size_t bytes) const {
  // The last answer first, without the lock: a loop of one call asks for
  // one size over and over. One word: bytes (48 bits), algorithm, op + 1.
  const bool packs = bytes < (uint64_t(1) << 48);
  const uint64_t key = (uint64_t(bytes) << 16) | (uint64_t(op) + 1);
  const uint64_t last = lastChoice_.load(std::memory_order_relaxed);
  if (packs && (last & ~uint64_t(0xff00)) == key) return Algorithm((last >> 8) & 0xff);
  Algorithm algo;
  {
    std::lock_guard<std::mutex> lock(choiceMutex_);
    auto it = choices_.find({op, bytes});
    if (it != choices_.end()) {
      algo = it->second;
    } else {
      if (choices_.size() >= 4096) choices_.clear();  // sizes that keep changing: stay bounded
      algo = chooseAlgorithm(op, bytes, topology_, settings_);
      choices_.emplace(std::make_pair(op, bytes), algo);
    }
  }
  if (packs) lastChoice_.store(key | (uint64_t(algo) << 8), std::memory_order_relaxed);
  return algo;
}

void Communicator::startEstimate() {
  std::lock_guard<std::mutex> lock(mutex_);
  estimated_ = 0;
  estimating_.store(true, std::memory_order_release);
}

double Communicator::endEstimate() {
  std::lock_guard<std::mutex> lock(mutex_);
  CLAWCOMM_ARG_CHECK(estimating_.load(), "clawcomm: endEstimate without startEstimate");
  estimating_.store(false, std::memory_order_release);
  return estimated_;
}

RequestPtr Communicator::estimateOnly(double seconds, Callback cb) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    estimated_ += seconds;
  }
  auto request = std::make_shared<Request>(std::move(cb));
  request->complete(nullptr);
  return request;
}

int Communicator::farthestFrom(int peer) const {
  if (peer >= 0) return peer;
  // A receive from any rank: priced as from one on another host, if any.
  for (int p = 0; p < size_; ++p) {
    if (topology_.hostOf(p) != topology_.hostOf(rank_)) return p;
  }
  return size_ > 1 ? (rank_ + 1) % size_ : rank_;
}

std::string Communicator::allReduceAlgorithm(size_t bytes) const {
  return algorithmName(algorithmFor(OpType::kAllReduce, bytes));
}

void Communicator::checkRoot(OpType op, int root) const {
  CLAWCOMM_ARG_CHECK(root >= 0 && root < size_, opPrefix(op), "root ", root,
                     " is out of range for a group of ", size_, " ranks");
}

void Communicator::checkNotDeterministic16BitWire(OpType op, DataType wire) const {
  // The 16-bit ring adds in ring order; a canonical tree over a 16-bit wire
  // is not built (docs/deterministic.md).
  CLAWCOMM_ARG_CHECK(!settings_.deterministic, opPrefix(op), "a ", dataTypeName(wire),
                     " wire (the 16-bit-wire ring) is refused with CLAWCOMM_DETERMINISTIC=1: "
                     "its ring adds in an order that depends on the rank; reduce float32 "
                     "instead, or unset CLAWCOMM_DETERMINISTIC");
}

void Communicator::checkCounts(OpType op, const std::vector<size_t>& counts,
                               const char* what) const {
  CLAWCOMM_ARG_CHECK(counts.size() == size_t(size_), opPrefix(op), what, " has ", counts.size(),
                     " entries for a group of ", size_, " ranks");
}

RequestPtr Communicator::allReduce(void* buf, size_t count, DataType dtype, ReduceOp op,
                                   Callback cb) {
  checkReduceOp(OpType::kAllReduce, dtype, op);
  OpSignature sig{OpType::kAllReduce, dtype, op, -1, count};
  sig.algo = algorithmFor(OpType::kAllReduce, count * elementSize(dtype));
  const auto run = allReduceById(sig.algo).run;
  // Two words of captures (the rest is in the signature): std::function
  // keeps them without an allocation.
  return enqueueCollective(
      sig, count * elementSize(dtype),
      [run, buf](Channel& ch) {
        const OpSignature& s = ch.signature();
        run(ch, buf, s.count);
        if (s.redop == ReduceOp::kAvg) divideInPlace(s.dtype, buf, s.count, ch.size());
      },
      std::move(cb));
}

RequestPtr Communicator::allReduce16BitWire(float* buf, size_t count, DataType wire, float prescale,
                                            float postscale, Callback cb) {
  CLAWCOMM_ARG_CHECK(wire == DataType::kFloat16 || wire == DataType::kBFloat16,
                     "clawcomm::all_reduce: the wire format must be float16 or bfloat16, not ",
                     dataTypeName(wire));
  CLAWCOMM_ARG_CHECK(std::isfinite(prescale) && prescale != 0.0f, "clawcomm::all_reduce: prescale ",
                     prescale, " is not a finite non-zero factor");
  CLAWCOMM_ARG_CHECK(std::isfinite(postscale) && postscale != 0.0f,
                     "clawcomm::all_reduce: postscale ", postscale,
                     " is not a finite non-zero factor");
  checkNotDeterministic16BitWire(OpType::kAllReduce, wire);
  OpSignature sig{OpType::kAllReduce, wire, ReduceOp::kSum, -1, count};
  sig.algo = Algorithm::kRing16BitWire;
  return enqueueCollective(
      sig, count * 2,
      [=](Channel& ch) { ringAllReduce16BitWire(ch, buf, count, prescale, postscale); },
      std::move(cb));
}

RequestPtr Communicator::reduceScatter16BitWire(float* buf, float* out, size_t count, DataType wire,
                                                float prescale, float postscale, Callback cb) {
  const char* op = "clawcomm::reduce_scatter";
  CLAWCOMM_ARG_CHECK(wire == DataType::kFloat16 || wire == DataType::kBFloat16, op,
                     ": the wire format must be float16 or bfloat16, not ", dataTypeName(wire));
  CLAWCOMM_ARG_CHECK(std::isfinite(prescale) && prescale != 0.0f, op, ": prescale ", prescale,
                     " is not a finite non-zero factor");
  CLAWCOMM_ARG_CHECK(std::isfinite(postscale) && postscale != 0.0f, op, ": postscale ", postscale,
                     " is not a finite non-zero factor");
  CLAWCOMM_ARG_CHECK(count % size_t(size_) == 0, op, ": a 16-bit wire needs a count that ", size_,
                     " ranks divide evenly, got ", count);
  checkNotDeterministic16BitWire(OpType::kReduceScatter, wire);
  OpSignature sig{OpType::kReduceScatter, wire, ReduceOp::kSum, -1, count};
  sig.algo = Algorithm::kRing16BitWire;
  return enqueueCollective(
      sig, count * 2,
      [=](Channel& ch) { ringReduceScatter16BitWire(ch, buf, count, prescale, postscale, out); },
      std::move(cb));
}

RequestPtr Communicator::reduceScatter(const void* in, void* out, std::vector<size_t> counts,
                                       DataType dtype, ReduceOp op, Callback cb) {
  checkReduceOp(OpType::kReduceScatter, dtype, op);
  checkCounts(OpType::kReduceScatter, counts, "counts");
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
  OpSignature sig{OpType::kReduceScatter, dtype, op, -1, total};
  sig.algo = algorithmFor(OpType::kReduceScatter, total * elementSize(dtype));
  const bool hierarchical = sig.algo == Algorithm::kHierarchical;
  const bool direct = sig.algo == Algorithm::kDirect || sig.algo == Algorithm::kDeterministic;
  const auto runDirect =
      sig.algo == Algorithm::kDeterministic ? deterministicReduceScatter : directReduceScatter;
  const int r = rank_, n = size_;
  return enqueueCollective(
      sig, total * elementSize(dtype),
      [=](Channel& ch) {
        const size_t es = elementSize(dtype);
        if (direct) {
          runDirect(ch, in, out, counts);
          if (op == ReduceOp::kAvg) divideInPlace(dtype, out, counts[r], n);
          return;
        }
        // The ring reduces in place, so it works on a copy of the input.
        uint8_t* work = ch.scratch(kOpScratch, total * es);
        if (total) std::memcpy(work, in, total * es);
        if (hierarchical) {
          hierarchicalReduceScatter(ch, work, counts);
        } else {
          ringReduceScatter(ch, work, counts);
        }
        const size_t offset = std::accumulate(counts.begin(), counts.begin() + r, size_t(0));
        if (counts[r]) std::memcpy(out, work + offset * es, counts[r] * es);
        if (op == ReduceOp::kAvg) divideInPlace(dtype, out, counts[r], n);
      },
      std::move(cb));
}

RequestPtr Communicator::allGather(const void* in, void* out, std::vector<size_t> counts,
                                   DataType dtype, Callback cb) {
  checkDataType(OpType::kAllGather, dtype);
  checkCounts(OpType::kAllGather, counts, "counts");
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
  OpSignature sig{OpType::kAllGather, dtype, ReduceOp::kSum, -1, total};
  sig.algo = algorithmFor(OpType::kAllGather, total * elementSize(dtype));
  const bool hierarchical = sig.algo == Algorithm::kHierarchical;
  const bool direct = sig.algo == Algorithm::kDirect;
  const int r = rank_;
  return enqueueCollective(
      sig, total * elementSize(dtype),
      [=](Channel& ch) {
        if (direct) {
          directAllGather(ch, in, out, counts);
          return;
        }
        const size_t es = elementSize(dtype);
        const size_t offset = std::accumulate(counts.begin(), counts.begin() + r, size_t(0));
        uint8_t* mine = static_cast<uint8_t*>(out) + offset * es;
        if (counts[r] && mine != in) std::memmove(mine, in, counts[r] * es);
        if (hierarchical) {
          hierarchicalAllGather(ch, out, counts);
        } else {
          ringAllGather(ch, out, counts);
        }
      },
      std::move(cb));
}

RequestPtr Communicator::broadcast(void* buf, size_t count, DataType dtype, int root, Callback cb) {
  checkDataType(OpType::kBroadcast, dtype);
  checkRoot(OpType::kBroadcast, root);
  OpSignature sig{OpType::kBroadcast, dtype, ReduceOp::kSum, root, count};
  const size_t bytes = count * elementSize(dtype);
  sig.algo = algorithmFor(OpType::kBroadcast, bytes);
  if (sig.algo == Algorithm::kScatterAllGather) {
    return enqueueCollective(
        sig, bytes, [=](Channel& ch) { scatterAllGatherBroadcast(ch, buf, count, root); },
        std::move(cb));
  }
  if (sig.algo == Algorithm::kDirect) {
    return enqueueCollective(
        sig, bytes, [=](Channel& ch) { directBroadcast(ch, buf, bytes, root); }, std::move(cb));
  }
  return enqueueCollective(
      sig, bytes, [=](Channel& ch) { binomialBroadcast(ch, buf, bytes, root); }, std::move(cb));
}

RequestPtr Communicator::reduce(void* buf, size_t count, DataType dtype, ReduceOp op, int root,
                                Callback cb) {
  checkReduceOp(OpType::kReduce, dtype, op);
  checkRoot(OpType::kReduce, root);
  OpSignature sig{OpType::kReduce, dtype, op, root, count};
  sig.algo = algorithmFor(OpType::kReduce, count * elementSize(dtype));
  const int r = rank_, n = size_;
  if (sig.algo == Algorithm::kReduceScatterGather || sig.algo == Algorithm::kDeterministic) {
    const auto run =
        sig.algo == Algorithm::kDeterministic ? deterministicReduce : reduceScatterGatherReduce;
    return enqueueCollective(
        sig, count * elementSize(dtype),
        [=](Channel& ch) {
          run(ch, buf, count, root);
          if (r == root && op == ReduceOp::kAvg) divideInPlace(dtype, buf, count, n);
        },
        std::move(cb));
  }
  return enqueueCollective(
      sig, count * elementSize(dtype),
      [=](Channel& ch) {
        const size_t bytes = count * elementSize(dtype);
        // A leaf of the tree (no children: odd, or the last) only sends
        // its input, which it never writes: no copy.
        const int v = (r - root + n) % n;
        const bool leaf = (v & 1) || v + 1 >= n;
        if (r == root) {
          binomialReduce(ch, buf, count, root);
          if (op == ReduceOp::kAvg) divideInPlace(dtype, buf, count, n);
        } else if (leaf) {
          binomialReduce(ch, buf, count, root);
        } else {
          // Non-roots accumulate their subtree in scratch, leaving `buf` as it was.
          uint8_t* partial = ch.scratch(kOpScratch, bytes);
          if (bytes) std::memcpy(partial, buf, bytes);
          binomialReduce(ch, partial, count, root);
        }
      },
      std::move(cb));
}

RequestPtr Communicator::gather(const void* in, void* out, size_t count, DataType dtype, int root,
                                Callback cb) {
  checkDataType(OpType::kGather, dtype);
  checkRoot(OpType::kGather, root);
  OpSignature sig{OpType::kGather, dtype, ReduceOp::kSum, root, count};
  const size_t bytes = count * elementSize(dtype);
  return enqueueCollective(
      sig, bytes * size_t(size_), [=](Channel& ch) { linearGather(ch, in, out, bytes, root); },
      std::move(cb));
}

RequestPtr Communicator::scatter(const void* in, void* out, size_t count, DataType dtype, int root,
                                 Callback cb) {
  checkDataType(OpType::kScatter, dtype);
  checkRoot(OpType::kScatter, root);
  OpSignature sig{OpType::kScatter, dtype, ReduceOp::kSum, root, count};
  const size_t bytes = count * elementSize(dtype);
  return enqueueCollective(
      sig, bytes * size_t(size_), [=](Channel& ch) { linearScatter(ch, in, out, bytes, root); },
      std::move(cb));
}

RequestPtr Communicator::allToAll(const void* in, std::vector<size_t> sendCounts, void* out,
                                  std::vector<size_t> recvCounts, DataType dtype, Callback cb) {
  checkDataType(OpType::kAllToAll, dtype);
  checkCounts(OpType::kAllToAll, sendCounts, "send counts");
  checkCounts(OpType::kAllToAll, recvCounts, "receive counts");
  CLAWCOMM_ARG_CHECK(sendCounts[rank_] == recvCounts[rank_], opPrefix(OpType::kAllToAll), "rank ",
                     rank_, " sends ", sendCounts[rank_], " elements to itself but expects ",
                     recvCounts[rank_]);
  // Per-pair sizes differ by design, so the count is not part of the
  // signature; each frame's byte count is still checked on arrival.
  OpSignature sig{OpType::kAllToAll, dtype, ReduceOp::kSum, -1, 0};
  const size_t es = elementSize(dtype);
  for (auto& c : sendCounts) c *= es;
  for (auto& c : recvCounts) c *= es;
  const size_t sent = std::accumulate(sendCounts.begin(), sendCounts.end(), size_t(0));
  // Not by `sent`: that differs from rank to rank, and every rank must run
  // the same algorithm. The all-to-all's choice is the layout's
  // (selection.cc), whatever the size.
  sig.algo = algorithmFor(OpType::kAllToAll, 0);
  const auto run = sig.algo == Algorithm::kHierarchical ? hierarchicalAllToAll : pairwiseAllToAll;
  return enqueueCollective(
      sig, sent, [=](Channel& ch) { run(ch, in, sendCounts, out, recvCounts); }, std::move(cb));
}

RequestPtr Communicator::barrier(Callback cb) {
  OpSignature sig{OpType::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0};
  return enqueueCollective(sig, 0, [](Channel& ch) { disseminationBarrier(ch); }, std::move(cb));
}

RequestPtr Communicator::send(const void* buf, size_t bytes, int peer, uint64_t tag, Callback cb) {
  CLAWCOMM_ARG_CHECK(peer >= 0 && peer < size_, "clawcomm::send: destination rank ", peer,
                     " is out of range for a group of ", size_, " ranks");
  CLAWCOMM_ARG_CHECK(peer != rank_, "clawcomm::send: rank ", rank_, " cannot send to itself");
  return enqueuePointToPoint(true, const_cast<void*>(buf), bytes, peer, tag, std::move(cb));
}

RequestPtr Communicator::recv(void* buf, size_t bytes, int peer, uint64_t tag, Callback cb) {
  CLAWCOMM_ARG_CHECK(peer >= -1 && peer < size_, "clawcomm::recv: source rank ", peer,
                     " is out of range for a group of ", size_, " ranks");
  CLAWCOMM_ARG_CHECK(peer != rank_, "clawcomm::recv: rank ", rank_, " cannot receive from itself");
  CLAWCOMM_ARG_CHECK(peer != -1 || size_ > 1,
                     "clawcomm::recv: no other rank to receive from in a group of 1");
  return enqueuePointToPoint(false, buf, bytes, peer, tag, std::move(cb));
}

}  // namespace clawcomm
