// Ordered compaction on the GPU: every index i of [0, n) that passes a test,
// handed its rank among the passing ones in index order, with no host round
// trip (the bound may live on the device). Used by the top-k kernels
// (compress_kernels.cu); device code only, included by .cu files.
//
// Two passes. The counting pass tests every entry once (reading the data),
// keeps each warp's verdicts as bits (one word per 32 entries: 1/32 of the
// data's size) and counts each chunk's; a scan turns the counts into
// offsets; the emitting pass reads only the bits and hands each passing
// entry its rank: the chunk's offset, plus the passing entries of the warps
// before it in the chunk, plus the lanes before it in its word.
//
// Layout. A chunk of kChunk entries goes to one block at a time (blocks
// stride over the chunks); each warp takes kWarpSpan consecutive entries of
// it, and its lane l tests entries l, l + 32, l + 64, ...: every load of a
// warp is 32 consecutive words (coalesced), and a thread's kItems loads are
// independent, so they are all in flight at once.
//
// A test fills pass[j] for the thread's entries base + 32 j (j < kItems)
// below `count`: Each<Pred> does it with a predicate of one index; a test
// of its own may load everything first and store as it goes (the top-k's
// fold: it sees each entry once, and the emitting pass sees it changed).
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>

#include "cuda/check.h"

namespace clawcomm {
namespace cuda {
namespace compaction {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 16;                 // entries per thread per chunk
constexpr int kWarpSpan = 32 * kItems;     // entries per warp per chunk
constexpr int kChunk = kThreads * kItems;  // entries per chunk

template <typename Pred>
struct Each {
  Pred pred;
  __device__ void operator()(size_t base, size_t count, bool (&pass)[kItems]) const {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + size_t(j) * 32;
      pass[j] = i < count && pred(i);
    }
  }
};
template <typename Pred>
Each<Pred> each(Pred pred) {
  return Each<Pred>{pred};
}

// This thread's first entry of chunk c.
__device__ __forceinline__ size_t firstOf(size_t c) {
  return c * kChunk + size_t(threadIdx.x >> 5) * kWarpSpan + (threadIdx.x & 31);
}

// Chunk c's warp w keeps its kItems verdict words at bits[wordsOf(c, w) ..].
__device__ __forceinline__ size_t wordsOf(size_t c, int warp) {
  return c * (kChunk / 32) + size_t(warp) * kItems;
}

// Pass 1: counts[c] = the passing entries of chunk c, for every c < chunks
// (0 past the count, so the scan sees every chunk), and the verdicts' bits.
template <typename Test>
__global__ void countKernel(size_t chunks, size_t n, const uint32_t* nOnDevice, Test test,
                            uint32_t* __restrict__ counts, uint32_t* __restrict__ bits) {
  __shared__ uint32_t warpTotal[kWarps];
  const size_t count = nOnDevice ? *nOnDevice : n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    if (c * kChunk >= count) {  // the same for the whole block
      if (threadIdx.x == 0) counts[c] = 0;
      continue;
    }
    bool pass[kItems];
    test(firstOf(c), count, pass);
    uint32_t mine = 0, word = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const uint32_t mask = __ballot_sync(0xffffffffu, pass[j]);
      mine += __popc(mask);
      if (lane == j) word = mask;
    }
    if (lane < kItems) bits[wordsOf(c, warp) + lane] = word;
    if (lane == 0) warpTotal[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t total = 0;
      for (int w = 0; w < kWarps; ++w) total += warpTotal[w];
      counts[c] = total;
    }
    __syncthreads();  // warpTotal is the next chunk's
  }
}

// Pass 2, after an exclusive scan of the counts into offsets: for every
// passing entry i, emit.put(i, rank, emit.fetch(i)), from the bits alone.
// A thread fetches for all its entries before it puts any (a put stores,
// and the compiler would not move a later fetch above it), so its loads are
// in flight together rather than one latency each.
template <typename Emit>
__global__ void emitKernel(size_t chunks, size_t n, const uint32_t* nOnDevice,
                           const uint32_t* __restrict__ bits, const uint32_t* __restrict__ offsets,
                           Emit emit) {
  __shared__ uint32_t warpTotal[kWarps];
  const size_t count = nOnDevice ? *nOnDevice : n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t before = (1u << lane) - 1;  // the lanes below this one
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    if (c * kChunk >= count) break;  // the same for the whole block, and for later chunks
    const uint32_t word = lane < kItems ? bits[wordsOf(c, warp) + lane] : 0;
    uint32_t mine = __popc(word);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
    const size_t base = firstOf(c);
    uint32_t mask[kItems];
    typename Emit::Value got[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      mask[j] = __shfl_sync(0xffffffffu, word, j);
      got[j] = mask[j] >> lane & 1 ? emit.fetch(base + size_t(j) * 32) : typename Emit::Value{};
    }
    if (lane == 0) warpTotal[warp] = mine;
    __syncthreads();
    uint32_t rank = offsets[c];
    for (int w = 0; w < warp; ++w) rank += warpTotal[w];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (mask[j] >> lane & 1)
        emit.put(base + size_t(j) * 32, rank + __popc(mask[j] & before), got[j]);
      rank += __popc(mask[j]);
    }
    __syncthreads();  // warpTotal is the next chunk's
  }
}

// total = offsets[last] + counts[last]
static __global__ void totalKernel(const uint32_t* counts, const uint32_t* offsets, size_t chunks,
                                   uint32_t* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = offsets[chunks - 1] + counts[chunks - 1];
}

// Workspace carving: everything 256-byte aligned.
struct Workspace {
  char* at;
  template <typename T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(at);
    at += (count * sizeof(T) + 255) & ~size_t(255);
    return p;
  }
};

inline size_t scanTempBytes(size_t chunks) {
  size_t bytes = 0;
  CLAWCOMM_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, (uint32_t*)nullptr,
                                                    (uint32_t*)nullptr, int(chunks)));
  return bytes;
}

inline size_t chunksOf(size_t n) {
  return n == 0 ? 1 : (n + kChunk - 1) / kChunk;
}

// The workspace one select over a bound of n entries takes.
inline size_t selectBytes(size_t n) {
  const size_t chunks = chunksOf(n);
  auto round = [](size_t b) { return (b + 255) & ~size_t(255); };
  return 2 * round(chunks * 4) + round(chunks * kChunk / 8) + round(scanTempBytes(chunks));
}

// An ordered compaction over [0, n) (or [0, *nOnDevice), n the bound) with
// a test (Each<Pred>, or one of its own): emit(i, rank) for every i that
// passes, *total = how many did.
template <typename Test, typename Emit>
void selectWith(size_t n, const uint32_t* nOnDevice, Test test, Emit emit, uint32_t* total,
                Workspace ws, cudaStream_t s) {
  const size_t chunks = chunksOf(n);
  uint32_t* counts = ws.take<uint32_t>(chunks);
  uint32_t* offsets = ws.take<uint32_t>(chunks);
  uint32_t* bits = ws.take<uint32_t>(chunks * kChunk / 32);
  size_t tempBytes = scanTempBytes(chunks);
  void* temp = ws.take<char>(tempBytes);
  const int grid = gridFor(chunks * kThreads, kThreads);
  countKernel<<<grid, kThreads, 0, s>>>(chunks, n, nOnDevice, test, counts, bits);
  CLAWCOMM_CUDA_LAUNCHED();
  CLAWCOMM_CUDA_CHECK(
      cub::DeviceScan::ExclusiveSum(temp, tempBytes, counts, offsets, int(chunks), s));
  emitKernel<<<grid, kThreads, 0, s>>>(chunks, n, nOnDevice, bits, offsets, emit);
  CLAWCOMM_CUDA_LAUNCHED();
  totalKernel<<<1, 1, 0, s>>>(counts, offsets, chunks, total);
  CLAWCOMM_CUDA_LAUNCHED();
}

// The same with a predicate of one index.
template <typename Pred, typename Emit>
void select(size_t n, const uint32_t* nOnDevice, Pred pred, Emit emit, uint32_t* total,
            Workspace ws, cudaStream_t s) {
  selectWith(n, nOnDevice, each(pred), emit, total, ws, s);
}

}  // namespace compaction
}  // namespace cuda
}  // namespace clawcomm
