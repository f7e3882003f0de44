// The device collectives' algorithms, one body per kernel, over the protocol
// of device/protocol.h: compiled by nvcc for CUDA blocks (cuda/ipc_kernels.cu)
// and by the host compiler for host threads (device/host_runtime.cc).
//
// Every body moves 16-byte packs; `L.in`/`L.out` are the caller's buffers
// when the launch is direct, else null (the host copies through this rank's
// input and result areas). Bytes each step moves are per rank, for a
// message of N bytes on n ranks (docs/algorithms.md has the table).
#pragma once

#include <cstring>
#include <type_traits>

#include "common/errors.h"
#include "device/protocol.h"
#include "reduce/ops.h"

namespace clawcomm {
namespace device {

// [lo, hi) of `total` items for part `part` of `parts`.
CLAWCOMM_HD void split(size_t total, size_t parts, size_t part, size_t& lo, size_t& hi) {
  const size_t per = (total + parts - 1) / parts;
  lo = part * per < total ? part * per : total;
  hi = lo + per < total ? lo + per : total;
}

// Slice q (one per rank) of `packs`, and this block's part of it.
CLAWCOMM_HD void slicePart(size_t packs, int size, int q, int block, int blocks, size_t& lo,
                           size_t& hi) {
  size_t qlo, qhi;
  split(packs, size_t(size), size_t(q), qlo, qhi);
  split(qhi - qlo, size_t(blocks), size_t(block), lo, hi);
  lo += qlo;
  hi += qlo;
}

template <class X>
CLAWCOMM_DEVICE void copyPacks(const X& x, const Pack* src, Pack* dst, size_t lo, size_t hi,
                               bool fromPeer) {
  for (size_t i = lo + size_t(x.thread()); i < hi; i += size_t(x.threads())) {
    X::store(dst + i, fromPeer ? X::loadPeer(src + i) : X::load(src + i));
  }
}

CLAWCOMM_HD const Pack* packsAt(const char* area) {
  return reinterpret_cast<const Pack*>(area);
}
CLAWCOMM_HD Pack* packsAt(char* area) {
  return reinterpret_cast<Pack*>(area);
}

// Element traits: how a stored element widens for the reduction and
// narrows back (16-bit floats reduce in float32 and round once).
template <typename S>
struct Plain {
  using Store = S;
  using Acc = S;
  static CLAWCOMM_HD Acc widen(S x) { return x; }
  static CLAWCOMM_HD S narrow(Acc a) { return a; }
};
template <bool kHalf>
struct Wide16 {
  using Store = uint16_t;
  using Acc = float;
  static CLAWCOMM_HD float widen(uint16_t x) { return widen16<kHalf>(x); }
  static CLAWCOMM_HD uint16_t narrow(float a) { return round16<kHalf>(a); }
};

// out[i] (and out2[i], unless null) = the reduction over ranks 0..size-1, in
// rank order, of area[rank][offset + i], for packs [lo, hi): the same bits on
// every rank.
template <typename E, typename Op, class X>
CLAWCOMM_DEVICE void reducePacks(const X& x, const IpcPeers& P, char* const* area, size_t offset,
                                 size_t lo, size_t hi, Pack* out, Pack* out2) {
  using Store = typename E::Store;
  using Acc = typename E::Acc;
  constexpr int N = 16 / sizeof(Store);
  for (size_t i = lo + size_t(x.thread()); i < hi; i += size_t(x.threads())) {
    // Elements are copied out of and into packs (memcpy: no aliasing of a
    // Pack's words as another type, which the host compiler may reorder).
    Store in[N];
    Acc acc[N];
    Pack v = X::loadPeer(packsAt(area[0]) + offset + i);
    memcpy(in, &v, sizeof(v));
    for (int j = 0; j < N; ++j) acc[j] = E::widen(in[j]);
    for (int p = 1; p < P.size; ++p) {
      v = X::loadPeer(packsAt(area[p]) + offset + i);
      memcpy(in, &v, sizeof(v));
      for (int j = 0; j < N; ++j) acc[j] = Op::template apply<Acc>(acc[j], E::widen(in[j]));
    }
    for (int j = 0; j < N; ++j) in[j] = E::narrow(acc[j]);
    Pack o;
    memcpy(&o, in, sizeof(o));
    X::store(out + i, o);
    if (out2) X::store(out2 + i, o);
  }
}

// ---------------------------------------------------------------------------
// The kernels' bodies, one block each.

// All-reduce, one-shot (small messages; N bytes, n ranks):
//   1. copy this rank's input into its input area         (N)
//   2. barrier(start)
//   3. read all n inputs and reduce them in rank order    (n N read)
//   4. barrier(end): nobody reuses its input area while a peer still reads it.
template <typename E, typename Op, class X>
CLAWCOMM_DEVICE void oneShot(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  const uint32_t epoch = beginOp(x, P);
  size_t lo, hi;
  split(L.packs, size_t(L.blocks), size_t(x.block()), lo, hi);
  if (L.in) copyPacks(x, L.in, packsAt(P.input[P.rank]), lo, hi, false);
  if (!barrier(x, P, kIpcStart, epoch, &L.call)) return;
  reducePacks<E, Op>(x, P, P.input, 0, lo, hi, L.out ? L.out : packsAt(P.result[P.rank]), nullptr);
  barrier(x, P, kIpcEnd, epoch);
}

// All-reduce, two-shot (large): the message is cut into n slices;
//   1. copy in; 2. barrier(start)
//   3. rank r reduces slice r from all n inputs into its result area (N read)
//   4. barrier(middle)
//   5. rank r copies slice q from rank q's result area, for every q   (N read)
//   6. barrier(end)
template <typename E, typename Op, class X>
CLAWCOMM_DEVICE void twoShot(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  const uint32_t epoch = beginOp(x, P);
  Pack* myIn = packsAt(P.input[P.rank]);
  Pack* myResult = packsAt(P.result[P.rank]);
  size_t lo, hi;
  if (L.in) {
    for (int q = 0; q < P.size; ++q) {
      slicePart(L.packs, P.size, q, x.block(), L.blocks, lo, hi);
      copyPacks(x, L.in, myIn, lo, hi, false);
    }
  }
  if (!barrier(x, P, kIpcStart, epoch, &L.call)) return;
  slicePart(L.packs, P.size, P.rank, x.block(), L.blocks, lo, hi);
  reducePacks<E, Op>(x, P, P.input, 0, lo, hi, myResult, L.out);
  if (!barrier(x, P, kIpcMiddle, epoch)) return;
  Pack* dst = L.out ? L.out : myResult;
  for (int q = 0; q < P.size; ++q) {
    if (q == P.rank) continue;
    slicePart(L.packs, P.size, q, x.block(), L.blocks, lo, hi);
    copyPacks(x, packsAt(P.result[q]), dst, lo, hi, true);
  }
  barrier(x, P, kIpcEnd, epoch);
}

// Copies this block's part [lo, hi) of each of the size pieces of `in`
// (`piece` packs each) into this rank's input area, at the same offsets.
template <class X>
CLAWCOMM_DEVICE void copyPiecesIn(const X& x, const IpcPeers& P, const Pack* in, size_t piece,
                                  size_t lo, size_t hi) {
  for (int q = 0; q < P.size; ++q) {
    copyPacks(x, in + size_t(q) * piece, packsAt(P.input[P.rank]) + size_t(q) * piece, lo, hi,
              false);
  }
}

// Reduce-scatter (two-shot's first half): in holds size pieces of `packs`;
// out receives this rank's piece, reduced.
template <typename E, typename Op, class X>
CLAWCOMM_DEVICE void reduceScatter(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  const uint32_t epoch = beginOp(x, P);
  size_t lo, hi;
  split(L.packs, size_t(L.blocks), size_t(x.block()), lo, hi);
  if (L.in) copyPiecesIn(x, P, L.in, L.packs, lo, hi);
  if (!barrier(x, P, kIpcStart, epoch, &L.call)) return;
  Pack* dst = L.out ? L.out : packsAt(P.result[P.rank]);
  reducePacks<E, Op>(x, P, P.input, size_t(P.rank) * L.packs, lo, hi, dst, nullptr);
  barrier(x, P, kIpcEnd, epoch);
}

// All-gather (two-shot's second half): in is this rank's piece; out
// receives every rank's, rank-major.
template <class X>
CLAWCOMM_DEVICE void allGather(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  const uint32_t epoch = beginOp(x, P);
  size_t lo, hi;
  split(L.packs, size_t(L.blocks), size_t(x.block()), lo, hi);
  if (L.in) copyPacks(x, L.in, packsAt(P.input[P.rank]), lo, hi, false);
  if (!barrier(x, P, kIpcStart, epoch, &L.call)) return;
  Pack* dst = L.out ? L.out : packsAt(P.result[P.rank]);
  for (int q = 0; q < P.size; ++q) {
    copyPacks(x, packsAt(P.input[q]), dst + size_t(q) * L.packs, lo, hi, q != P.rank);
  }
  barrier(x, P, kIpcEnd, epoch);
}

// Broadcast: the root's message, read by every other rank from its input area.
template <class X>
CLAWCOMM_DEVICE void broadcast(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  const uint32_t epoch = beginOp(x, P);
  size_t lo, hi;
  split(L.packs, size_t(L.blocks), size_t(x.block()), lo, hi);
  if (P.rank == L.root && L.in) copyPacks(x, L.in, packsAt(P.input[L.root]), lo, hi, false);
  if (!barrier(x, P, kIpcStart, epoch, &L.call)) return;
  if (P.rank != L.root) {
    Pack* dst = L.out ? L.out : packsAt(P.result[P.rank]);
    copyPacks(x, packsAt(P.input[L.root]), dst, lo, hi, true);
  }
  barrier(x, P, kIpcEnd, epoch);
}

// All-to-all: in holds piece p for rank p; out receives piece p from rank p.
template <class X>
CLAWCOMM_DEVICE void allToAll(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  const uint32_t epoch = beginOp(x, P);
  size_t lo, hi;
  split(L.packs, size_t(L.blocks), size_t(x.block()), lo, hi);
  if (L.in) copyPiecesIn(x, P, L.in, L.packs, lo, hi);
  if (!barrier(x, P, kIpcStart, epoch, &L.call)) return;
  Pack* dst = L.out ? L.out : packsAt(P.result[P.rank]);
  for (int p = 0; p < P.size; ++p) {
    copyPacks(x, packsAt(P.input[p]) + size_t(P.rank) * L.packs, dst + size_t(p) * L.packs, lo, hi,
              p != P.rank);
  }
  barrier(x, P, kIpcEnd, epoch);
}

// The setup probe, with the loads and stores the kernels use: store a value
// into every peer's mailbox, and load every peer's hello word. The host
// checks both after a store-side barrier (device/ipc_group.cc).
template <class X>
CLAWCOMM_DEVICE void probe(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  for (int p = x.thread(); p < P.size; p += x.threads()) {
    if (p == P.rank) continue;
    X::fenceSystem();
    X::storeRelease(&P.signals[p]->probe[P.rank], probeValue(P.rank, p));
    P.signals[P.rank]->loaded[p] = X::loadAcquire(&P.signals[p]->hello);
  }
  X::fenceSystem();
}

// Point-to-point (device/protocol.h): one thread of one block each; the
// stream copies the bytes between them.

// The header of message `L.p2p` in `from`'s ring for `to`.
CLAWCOMM_HD Pack* headerAt(const IpcPeers& P, int from, int to, uint64_t offset) {
  return reinterpret_cast<Pack*>(P.rings[from] + uint64_t(to) * P.ringBytes + offset);
}

// A send, before its copy: the receiver has taken the messages this one overwrites.
template <class X>
CLAWCOMM_DEVICE void p2pSpace(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  if (x.thread() != 0) return;
  waitAtLeast(x, P, &P.signals[P.rank]->taken[L.p2p.peer], L.p2p.count, L.p2p.peer, kIpcPhaseSpace);
}

// A send, after its copy: the header, then the message announced.
template <class X>
CLAWCOMM_DEVICE void p2pPost(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  if (x.thread() != 0) return;
  Pack h;
  memcpy(&h, &L.p2p.header, sizeof(h));
  X::store(headerAt(P, P.rank, L.p2p.peer, L.p2p.offset), h);
  X::fenceSystem();
  X::storeRelease(&P.signals[L.p2p.peer]->posted[P.rank], L.p2p.count);
}

// A receive, before its copy: the message has arrived, with the tag and
// size this receive expects.
template <class X>
CLAWCOMM_DEVICE void p2pArrive(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  if (x.thread() != 0) return;
  const int from = L.p2p.peer;
  if (waitAtLeast(x, P, &P.signals[P.rank]->posted[from], L.p2p.count, from, kIpcPhaseData) !=
      kIpcOk) {
    return;
  }
  const Pack h = X::loadPeer(headerAt(P, from, P.rank, L.p2p.offset));
  IpcMessageHeader found;
  memcpy(&found, &h, sizeof(found));
  if (found.tag != L.p2p.header.tag || found.bytes != L.p2p.header.bytes) {
    giveUp(x, P, kIpcMismatch, from, kIpcPhaseData, L.p2p.count, 0, &L.p2p.header, &found);
  }
}

// A receive, after its copy: the sender may reuse the message's place.
template <class X>
CLAWCOMM_DEVICE void p2pTake(const X& x, const IpcLaunch& L) {
  const IpcPeers& P = L.peers;
  if (x.thread() != 0) return;
  X::fenceSystem();
  X::storeRelease(&P.signals[L.p2p.peer]->taken[P.rank], L.p2p.count);
}

// ---------------------------------------------------------------------------
// Host side: the element type and operator of a reducing launch.

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<E>(), Op()) with the element traits E and the operator Op for
// `type` and `op` (AVG reduces as SUM; the caller divides).
template <typename F>
void dispatchReduce(DataType type, ReduceOp op, F&& f) {
  if (type == DataType::kBool) op = ops::boolOp(op);
  auto withType = [&](auto opTag) {
    switch (type) {
      case DataType::kFloat32: return f(Tag<Plain<float>>(), opTag);
      case DataType::kFloat64: return f(Tag<Plain<double>>(), opTag);
      case DataType::kInt8: return f(Tag<Plain<int8_t>>(), opTag);
      case DataType::kUInt8:
      case DataType::kBool: return f(Tag<Plain<uint8_t>>(), opTag);
      case DataType::kInt32: return f(Tag<Plain<int32_t>>(), opTag);
      case DataType::kInt64: return f(Tag<Plain<int64_t>>(), opTag);
      case DataType::kFloat16: return f(Tag<Wide16<true>>(), opTag);
      case DataType::kBFloat16: return f(Tag<Wide16<false>>(), opTag);
      default: CLAWCOMM_CHECK(false, "unexpected dtype ", dataTypeName(type));
    }
  };
  auto bitwiseType = [&](auto opTag) {
    switch (type) {
      case DataType::kInt8: return f(Tag<Plain<int8_t>>(), opTag);
      case DataType::kUInt8:
      case DataType::kBool: return f(Tag<Plain<uint8_t>>(), opTag);
      case DataType::kInt32: return f(Tag<Plain<int32_t>>(), opTag);
      case DataType::kInt64: return f(Tag<Plain<int64_t>>(), opTag);
      default: CLAWCOMM_CHECK(false, "bitwise op on ", dataTypeName(type));
    }
  };
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return withType(ops::Sum());
    case ReduceOp::kProduct: return withType(ops::Prod());
    case ReduceOp::kMin: return withType(ops::Min());
    case ReduceOp::kMax: return withType(ops::Max());
    case ReduceOp::kBand: return bitwiseType(ops::Band());
    case ReduceOp::kBor: return bitwiseType(ops::Bor());
    case ReduceOp::kBxor: return bitwiseType(ops::Bxor());
    default: CLAWCOMM_CHECK(false, "unexpected reduce op ", int(op));
  }
}

template <int K>
using BodyNumber = std::integral_constant<int, K>;

// Calls run(BodyNumber<K>(), Tag<E>(), Op()) for L's kernel (K as runBody
// numbers them), element traits and operator: one switch for both executors.
template <typename Run>
void dispatchKernel(const IpcLaunch& L, Run&& run) {
  const Tag<Plain<uint8_t>> bytes;
  switch (L.kernel) {
    case IpcKernel::kOneShot:
      return dispatchReduce(L.type, L.op, [&](auto e, auto op) { run(BodyNumber<1>(), e, op); });
    case IpcKernel::kTwoShot:
      return dispatchReduce(L.type, L.op, [&](auto e, auto op) { run(BodyNumber<2>(), e, op); });
    case IpcKernel::kReduceScatter:
      return dispatchReduce(L.type, L.op, [&](auto e, auto op) { run(BodyNumber<3>(), e, op); });
    case IpcKernel::kAllGather: return run(BodyNumber<4>(), bytes, ops::Sum());
    case IpcKernel::kBroadcast: return run(BodyNumber<5>(), bytes, ops::Sum());
    case IpcKernel::kAllToAll: return run(BodyNumber<6>(), bytes, ops::Sum());
    case IpcKernel::kProbe: return run(BodyNumber<7>(), bytes, ops::Sum());
    case IpcKernel::kP2pSpace: return run(BodyNumber<8>(), bytes, ops::Sum());
    case IpcKernel::kP2pPost: return run(BodyNumber<9>(), bytes, ops::Sum());
    case IpcKernel::kP2pArrive: return run(BodyNumber<10>(), bytes, ops::Sum());
    case IpcKernel::kP2pTake: return run(BodyNumber<11>(), bytes, ops::Sum());
  }
}

// The body with number K (as dispatchKernel passes it) for element traits E
// and operator Op, on executor x.
template <int K, typename E, typename Op, class X>
CLAWCOMM_DEVICE void runBody(const X& x, const IpcLaunch& L) {
  if constexpr (K == 1) oneShot<E, Op>(x, L);
  if constexpr (K == 2) twoShot<E, Op>(x, L);
  if constexpr (K == 3) reduceScatter<E, Op>(x, L);
  if constexpr (K == 4) allGather(x, L);
  if constexpr (K == 5) broadcast(x, L);
  if constexpr (K == 6) allToAll(x, L);
  if constexpr (K == 7) probe(x, L);
  if constexpr (K == 8) p2pSpace(x, L);
  if constexpr (K == 9) p2pPost(x, L);
  if constexpr (K == 10) p2pArrive(x, L);
  if constexpr (K == 11) p2pTake(x, L);
}

}  // namespace device
}  // namespace clawcomm
