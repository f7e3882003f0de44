// Collectives over CUDA IPC buffers (cuda/ipc.h): kernels first, launchers
// after.
//
// Data moves in 16-byte packs. Every kernel splits its packs among its
// blocks the same way on every rank, and block b of a rank only ever waits
// for block b of its peers, so one block's flags are all the
// synchronisation a block needs (no grid-wide barrier):
//   barrier(phase): each block's thread p < size stores the block's epoch
//   into rank p's slot[phase][block][me] (release, system scope, after a
//   system fence), then waits until its own slot[phase][block][p] reaches
//   the epoch (acquire), giving up after the timeout with a message and a
//   trap. The epoch is counter[block], incremented by the kernel itself in
//   device memory, so a CUDA graph that replays the kernel counts on.
//
// All-reduce, one-shot (small messages; N bytes per rank, n ranks):
//   1. copy this rank's input into its IPC input area        (N)
//   2. barrier(start)
//   3. every rank reads all n inputs and reduces them in rank order 0..n-1,
//      in float32 for 16-bit types (one rounding): the same bits everywhere
//                                                              (n N read)
//   4. barrier(end): nobody reuses its input area while a peer still reads it.
// All-reduce, two-shot (large): the input is cut into n slices;
//   1. copy in; 2. barrier(start);
//   3. rank r reduces slice r from all n inputs into its result area (N read)
//   4. barrier(middle)
//   5. rank r copies slice q from rank q's result area, for every q (N read)
//   6. barrier(end)
// Reduce-scatter is two-shot's first half, all-gather its second; broadcast
// and all-to-all are copies between the areas.
#include <cuda_runtime.h>

#include <cstdio>
#include <cuda/atomic>

#include "common/errors.h"
#include "cuda/check.h"
#include "cuda/ipc_kernels.h"
#include "reduce/ops.h"

namespace clawcomm {
namespace cuda {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// This block's epoch for this launch.
__device__ uint32_t beginOp(const IpcPeers& P) {
  __shared__ uint32_t flag;
  if (threadIdx.x == 0) flag = ++P.signals[P.rank]->counter[blockIdx.x];
  __syncthreads();
  return flag;
}

__device__ void barrier(const IpcPeers& P, int phase, uint32_t flag) {
  __syncthreads();
  const int p = threadIdx.x;
  if (p < P.size) {
    __threadfence_system();
    ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> tell(
        P.signals[p]->slot[phase][blockIdx.x][P.rank]);
    tell.store(flag, ::cuda::memory_order_release);
    ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> heard(
        P.signals[P.rank]->slot[phase][blockIdx.x][p]);
    const uint64_t start = globalTimerNs();
    while (int32_t(heard.load(::cuda::memory_order_acquire) - flag) < 0) {
      if (globalTimerNs() - start > P.timeoutNs) {
        printf(
            "clawcomm: CUDA IPC rank %d, block %d waited %llu ms for rank %d at phase %d "
            "(epoch %u); the peer died or stopped calling collectives. Trapping.\n",
            P.rank, int(blockIdx.x), (unsigned long long)(P.timeoutNs / 1000000), p, phase, flag);
        __trap();
      }
    }
  }
  __syncthreads();
}

// [lo, hi) of `total` items for part `part` of `parts`.
__device__ __forceinline__ void split(size_t total, size_t parts, size_t part, size_t& lo,
                                      size_t& hi) {
  const size_t per = (total + parts - 1) / parts;
  lo = min(total, part * per);
  hi = min(total, lo + per);
}

__device__ __forceinline__ void copyPacks(const uint4* src, uint4* dst, size_t lo, size_t hi,
                                          bool fromPeer) {
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    dst[i] = fromPeer ? __ldcg(src + i) : src[i];
}

// Copies this block's part [lo, hi) of each of the size pieces of `in`
// (`piece` packs each) into this rank's input area, at the same offsets.
__device__ __forceinline__ void copyPiecesIn(const IpcPeers& P, const uint4* in, size_t piece,
                                             size_t lo, size_t hi) {
  for (int q = 0; q < P.size; ++q) {
    copyPacks(in + q * piece, reinterpret_cast<uint4*>(P.input[P.rank]) + q * piece, lo, hi, false);
  }
}

template <typename S>
struct Plain {
  using Store = S;
  using Acc = S;
  static __device__ Acc widen(S x) { return x; }
  static __device__ S narrow(Acc a) { return a; }
};
template <bool kHalf>
struct Wide16 {
  using Store = uint16_t;
  using Acc = float;
  static __device__ float widen(uint16_t x) { return widen16<kHalf>(x); }
  static __device__ uint16_t narrow(float a) { return round16<kHalf>(a); }
};

// out[i] (and out2[i]) = reduction over ranks 0..size-1 of area[rank][i],
// for packs [lo, hi).
template <typename E, typename Op>
__device__ void reducePacks(const IpcPeers& P, char* const* area, size_t offsetPacks, size_t lo,
                            size_t hi, uint4* out, uint4* out2) {
  using Store = typename E::Store;
  using Acc = typename E::Acc;
  constexpr int N = 16 / sizeof(Store);
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    Acc acc[N];
    uint4 v = __ldcg(reinterpret_cast<const uint4*>(area[0]) + offsetPacks + i);
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] = E::widen(reinterpret_cast<const Store*>(&v)[j]);
    for (int p = 1; p < P.size; ++p) {
      v = __ldcg(reinterpret_cast<const uint4*>(area[p]) + offsetPacks + i);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        acc[j] = Op::template apply<Acc>(acc[j], E::widen(reinterpret_cast<const Store*>(&v)[j]));
      }
    }
    uint4 o;
#pragma unroll
    for (int j = 0; j < N; ++j) reinterpret_cast<Store*>(&o)[j] = E::narrow(acc[j]);
    out[i] = o;
    if (out2) out2[i] = o;
  }
}

template <typename E, typename Op>
__global__ void oneShotKernel(IpcPeers P, const uint4* in, uint4* out, size_t packs) {
  const uint32_t flag = beginOp(P);
  size_t lo, hi;
  split(packs, gridDim.x, blockIdx.x, lo, hi);
  if (in) copyPacks(in, reinterpret_cast<uint4*>(P.input[P.rank]), lo, hi, false);
  barrier(P, kIpcStart, flag);
  uint4* dst = out ? out : reinterpret_cast<uint4*>(P.result[P.rank]);
  reducePacks<E, Op>(P, P.input, 0, lo, hi, dst, nullptr);
  barrier(P, kIpcEnd, flag);
}

// Slice q of `packs` (one per rank), and this block's part of it.
__device__ __forceinline__ void slicePart(size_t packs, int size, int q, size_t& lo, size_t& hi) {
  size_t qlo, qhi;
  split(packs, size, q, qlo, qhi);
  split(qhi - qlo, gridDim.x, blockIdx.x, lo, hi);
  lo += qlo;
  hi += qlo;
}

template <typename E, typename Op>
__global__ void twoShotKernel(IpcPeers P, const uint4* in, uint4* out, size_t packs) {
  const uint32_t flag = beginOp(P);
  uint4* myIn = reinterpret_cast<uint4*>(P.input[P.rank]);
  uint4* myResult = reinterpret_cast<uint4*>(P.result[P.rank]);
  size_t lo, hi;
  if (in) {
    for (int q = 0; q < P.size; ++q) {
      slicePart(packs, P.size, q, lo, hi);
      copyPacks(in, myIn, lo, hi, false);
    }
  }
  barrier(P, kIpcStart, flag);
  slicePart(packs, P.size, P.rank, lo, hi);
  reducePacks<E, Op>(P, P.input, 0, lo, hi, myResult, out);
  barrier(P, kIpcMiddle, flag);
  uint4* dst = out ? out : myResult;
  for (int q = 0; q < P.size; ++q) {
    if (q == P.rank) continue;
    slicePart(packs, P.size, q, lo, hi);
    copyPacks(reinterpret_cast<const uint4*>(P.result[q]), dst, lo, hi, true);
  }
  barrier(P, kIpcEnd, flag);
}

// `piece` packs per rank. in: size pieces; out: this rank's piece.
template <typename E, typename Op>
__global__ void reduceScatterKernel(IpcPeers P, const uint4* in, uint4* out, size_t piece) {
  const uint32_t flag = beginOp(P);
  size_t lo, hi;
  split(piece, gridDim.x, blockIdx.x, lo, hi);
  if (in) copyPiecesIn(P, in, piece, lo, hi);
  barrier(P, kIpcStart, flag);
  uint4* dst = out ? out : reinterpret_cast<uint4*>(P.result[P.rank]);
  reducePacks<E, Op>(P, P.input, size_t(P.rank) * piece, lo, hi, dst, nullptr);
  barrier(P, kIpcEnd, flag);
}

// in: this rank's piece; out: every rank's, rank-major.
__global__ void allGatherKernel(IpcPeers P, const uint4* in, uint4* out, size_t piece) {
  const uint32_t flag = beginOp(P);
  size_t lo, hi;
  split(piece, gridDim.x, blockIdx.x, lo, hi);
  if (in) copyPacks(in, reinterpret_cast<uint4*>(P.input[P.rank]), lo, hi, false);
  barrier(P, kIpcStart, flag);
  uint4* dst = out ? out : reinterpret_cast<uint4*>(P.result[P.rank]);
  for (int q = 0; q < P.size; ++q) {
    copyPacks(reinterpret_cast<const uint4*>(P.input[q]), dst + q * piece, lo, hi, q != P.rank);
  }
  barrier(P, kIpcEnd, flag);
}

__global__ void broadcastKernel(IpcPeers P, const uint4* in, uint4* out, size_t packs, int root) {
  const uint32_t flag = beginOp(P);
  size_t lo, hi;
  split(packs, gridDim.x, blockIdx.x, lo, hi);
  if (P.rank == root && in) copyPacks(in, reinterpret_cast<uint4*>(P.input[root]), lo, hi, false);
  barrier(P, kIpcStart, flag);
  if (P.rank != root) {
    uint4* dst = out ? out : reinterpret_cast<uint4*>(P.result[P.rank]);
    copyPacks(reinterpret_cast<const uint4*>(P.input[root]), dst, lo, hi, true);
  }
  barrier(P, kIpcEnd, flag);
}

// in: piece p for rank p; out: piece p from rank p.
__global__ void allToAllKernel(IpcPeers P, const uint4* in, uint4* out, size_t piece) {
  const uint32_t flag = beginOp(P);
  size_t lo, hi;
  split(piece, gridDim.x, blockIdx.x, lo, hi);
  if (in) copyPiecesIn(P, in, piece, lo, hi);
  barrier(P, kIpcStart, flag);
  uint4* dst = out ? out : reinterpret_cast<uint4*>(P.result[P.rank]);
  for (int p = 0; p < P.size; ++p) {
    copyPacks(reinterpret_cast<const uint4*>(P.input[p]) + size_t(P.rank) * piece, dst + p * piece,
              lo, hi, p != P.rank);
  }
  barrier(P, kIpcEnd, flag);
}

// The same on every rank: it depends on the size alone.
int blocksFor(size_t packs) {
  const size_t want = (packs + 2 * kThreads - 1) / (2 * kThreads);
  return int(std::max<size_t>(1, std::min<size_t>(want, kIpcMaxBlocks)));
}

size_t packsOf(size_t bytes) {
  return (bytes + 15) / 16;
}

// Calls f.template operator()<E, Op>() for the element traits and operator.
template <typename F>
void dispatch(DataType type, ReduceOp op, F f) {
  if (type == DataType::kBool) op = ops::boolOp(op);
  auto withType = [&](auto opTag) {
    using Op = decltype(opTag);
    switch (type) {
      case DataType::kFloat32: return f.template operator()<Plain<float>, Op>();
      case DataType::kFloat64: return f.template operator()<Plain<double>, Op>();
      case DataType::kInt8: return f.template operator()<Plain<int8_t>, Op>();
      case DataType::kUInt8:
      case DataType::kBool: return f.template operator()<Plain<uint8_t>, Op>();
      case DataType::kInt32: return f.template operator()<Plain<int32_t>, Op>();
      case DataType::kInt64: return f.template operator()<Plain<int64_t>, Op>();
      case DataType::kFloat16: return f.template operator()<Wide16<true>, Op>();
      case DataType::kBFloat16: return f.template operator()<Wide16<false>, Op>();
      default: CLAWCOMM_CHECK(false, "unexpected dtype ", dataTypeName(type));
    }
  };
  auto bitwiseType = [&](auto opTag) {
    using Op = decltype(opTag);
    switch (type) {
      case DataType::kInt8: return f.template operator()<Plain<int8_t>, Op>();
      case DataType::kUInt8:
      case DataType::kBool: return f.template operator()<Plain<uint8_t>, Op>();
      case DataType::kInt32: return f.template operator()<Plain<int32_t>, Op>();
      case DataType::kInt64: return f.template operator()<Plain<int64_t>, Op>();
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

// Launches the all-reduce kernel for one element type and operator.
struct AllReduceLaunch {
  const IpcPeers& p;
  const uint4* i;
  uint4* o;
  size_t packs;
  int grid;
  cudaStream_t s;
  IpcAllReduce algo;
  template <typename E, typename Op>
  void operator()() const {
    if (algo == IpcAllReduce::kOneShot) {
      oneShotKernel<E, Op><<<grid, kThreads, 0, s>>>(p, i, o, packs);
    } else {
      twoShotKernel<E, Op><<<grid, kThreads, 0, s>>>(p, i, o, packs);
    }
  }
};
struct ReduceScatterLaunch {
  const IpcPeers& p;
  const uint4* i;
  uint4* o;
  size_t piece;
  cudaStream_t s;
  template <typename E, typename Op>
  void operator()() const {
    reduceScatterKernel<E, Op><<<blocksFor(piece), kThreads, 0, s>>>(p, i, o, piece);
  }
};
const uint4* packIn(const void* p) {
  return static_cast<const uint4*>(p);
}
uint4* packOut(void* p) {
  return static_cast<uint4*>(p);
}

}  // namespace

void launchAllReduce(const IpcPeers& p, const void* in, void* out, size_t count, DataType type,
                     ReduceOp op, IpcAllReduce algo, bool direct, Stream stream) {
  const size_t packs = packsOf(count * elementSize(type));
  if (packs == 0) return;
  const int grid = blocksFor(algo == IpcAllReduce::kTwoShot ? packs / p.size + 1 : packs);
  const cudaStream_t s = asStream(stream);
  const uint4* i = direct ? packIn(in) : nullptr;
  uint4* o = direct ? packOut(out) : nullptr;
  dispatch(type, op, AllReduceLaunch{p, i, o, packs, grid, s, algo});
  CLAWCOMM_CUDA_LAUNCHED();
}

void launchReduceScatter(const IpcPeers& p, const void* in, void* out, size_t countPerRank,
                         DataType type, ReduceOp op, bool direct, Stream stream) {
  const size_t piece = packsOf(countPerRank * elementSize(type));
  if (piece == 0) return;
  dispatch(type, op,
           ReduceScatterLaunch{p, direct ? packIn(in) : nullptr, direct ? packOut(out) : nullptr,
                               piece, asStream(stream)});
  CLAWCOMM_CUDA_LAUNCHED();
}

void launchAllGather(const IpcPeers& p, const void* in, void* out, size_t bytesPerRank, bool direct,
                     Stream stream) {
  const size_t piece = packsOf(bytesPerRank);
  if (piece == 0) return;
  allGatherKernel<<<blocksFor(piece), kThreads, 0, asStream(stream)>>>(
      p, direct ? packIn(in) : nullptr, direct ? packOut(out) : nullptr, piece);
  CLAWCOMM_CUDA_LAUNCHED();
}

void launchBroadcast(const IpcPeers& p, void* buf, size_t bytes, int root, bool direct,
                     Stream stream) {
  const size_t packs = packsOf(bytes);
  if (packs == 0) return;
  broadcastKernel<<<blocksFor(packs), kThreads, 0, asStream(stream)>>>(
      p, direct ? packIn(buf) : nullptr, direct ? packOut(buf) : nullptr, packs, root);
  CLAWCOMM_CUDA_LAUNCHED();
}

void launchAllToAll(const IpcPeers& p, const void* in, void* out, size_t bytesPerRank, bool direct,
                    Stream stream) {
  const size_t piece = packsOf(bytesPerRank);
  if (piece == 0) return;
  allToAllKernel<<<blocksFor(piece), kThreads, 0, asStream(stream)>>>(
      p, direct ? packIn(in) : nullptr, direct ? packOut(out) : nullptr, piece);
  CLAWCOMM_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace clawcomm
