// Gradient compression on the GPU: the 16-bit error-feedback pass, top-k
// with error feedback (sampled threshold or exact radix select, then an
// ordered compaction), and the scatter-add that sums gathered pairs. The
// CPU versions (compress/) are the reference: same sample, same threshold,
// same tie rule, same bits.
//
// Top-k of n entries, step by step (bytes are per entry):
//   1. fold: residual = grad + residual, grad = 0            (read 8, write 8)
//   2. threshold:
//      sampled: gather the CPU's sample (compress/sampling.h) and radix-select
//               its k-th value as the CPU does with nth_element  (~0.2% of n)
//      exact:   radix-select the k-th largest |residual|: four passes of
//               8-bit digits, each a histogram then a pick     (read 4 x 4)
//   3. candidates: every entry with |residual| >= threshold, in index order,
//      taken out of the residual (ordered compaction, cuda/compaction.cuh:
//      a counting pass over the data, an emitting pass over its verdict
//      bits)                                                   (read 4)
//      With a sampled threshold, step 1 is done by the counting pass (the
//      sample reads grad + residual where it samples), so the gradient and
//      the residual are read once: steps 1-3 read 8 and write 8.
//   4. if more than k: radix-select the k-th largest candidate, keep those
//      above it and the lowest-index ties, put the rest back.
// The threshold and every count stay in device memory, so the whole
// selection is queued on the stream with no host round trip.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "common/errors.h"
#include "compress/sampling.h"
#include "cuda/check.h"
#include "cuda/compaction.cuh"
#include "cuda/kernels.h"
#include "reduce/ops.h"

namespace clawcomm {
namespace cuda {
namespace {

using compaction::kItems;
using compaction::Workspace;

constexpr int kThreads = 256;
constexpr int kDigits = 256;  // radix select: 8-bit digits

// The device-resident state of one selection.
struct SelectState {
  uint32_t prefix;      // radix select: the digits fixed so far
  uint32_t mask;        // which bits of prefix are fixed
  uint32_t kLeft;       // rank still to find among entries matching prefix
  uint32_t candidates;  // how many passed the threshold
  uint32_t above;       // candidates strictly above the k-th candidate
  uint32_t kept;        // what was selected (<= k)
  uint32_t histogram[kDigits];
};

__device__ __forceinline__ uint32_t magnitudeBits(float v) {
  return floatToBits(v) & 0x7fffffffu;  // |v| as bits: ordered like the value
}

// --- 16-bit error feedback ---------------------------------------------------

template <bool kHalf>
__global__ void feedback16Kernel(const float* __restrict__ grad, float* residual,
                                 uint16_t* __restrict__ payload, size_t n, float scale,
                                 float inverse) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const auto f = ops::feedback16<kHalf>(grad[i], residual[i], scale, inverse);
    payload[i] = f.payload;
    residual[i] = f.residual;
  }
}

// --- top-k ----------------------------------------------------------------

__global__ void foldKernel(float* __restrict__ grad, float* __restrict__ residual, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    residual[i] += grad[i];
    grad[i] = 0.0f;
  }
}

// The CPU's sample: run j is acc[start_j .. start_j + 16), where acc is
// residual + grad (the fold to come), or the residual alone (grad null:
// folded already).
__global__ void sampleKernel(const float* __restrict__ residual, const float* __restrict__ grad,
                             size_t n, uint64_t seed, size_t runs, float* __restrict__ out) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t t = size_t(blockIdx.x) * blockDim.x + threadIdx.x; t < runs * kSampleRun;
       t += stride) {
    const size_t i = sampleStart(seed, t / kSampleRun, n) + t % kSampleRun;
    out[t] = fabsf(grad ? residual[i] + grad[i] : residual[i]);
  }
}

__global__ void selectInitKernel(SelectState* st, uint32_t k) {
  if (threadIdx.x == 0) {
    st->prefix = 0;
    st->mask = 0;
    st->kLeft = k;
  }
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) st->histogram[d] = 0;
}

// One radix-select pass: histogram the digit at `shift` of every magnitude
// whose higher digits match the prefix. `n` entries, or *nOnDevice if set.
__global__ void histogramKernel(const float* __restrict__ v, size_t n, const uint32_t* nOnDevice,
                                int shift, SelectState* st) {
  __shared__ uint32_t local[kDigits];
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) local[d] = 0;
  __syncthreads();
  const size_t count = nOnDevice ? *nOnDevice : n;
  const uint32_t prefix = st->prefix, mask = st->mask;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint32_t key = magnitudeBits(v[i]);
    if ((key & mask) == prefix) atomicAdd(&local[(key >> shift) & (kDigits - 1)], 1u);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    if (local[d]) atomicAdd(&st->histogram[d], local[d]);
  }
}

// Fixes the digit at `shift`: the one whose bucket holds the kLeft-th
// largest, counting from the top digit down (digit 0 if the buckets above
// it hold fewer). One thread per digit: thread t holds digit 255 - t, and a
// scan gives the entries in the digits above it; the one thread whose
// bucket the kLeft-th falls in (or digit 255 when kLeft is 0) writes.
__global__ void pickKernel(int shift, SelectState* st) {
  using Scan = cub::BlockScan<uint32_t, kDigits>;
  __shared__ typename Scan::TempStorage temp;
  const int d = kDigits - 1 - int(threadIdx.x);
  const uint32_t kLeft = st->kLeft;
  const uint32_t here = st->histogram[d];
  st->histogram[d] = 0;  // for the next pass
  uint32_t above;
  Scan(temp).ExclusiveSum(here, above);
  const bool notYet = threadIdx.x == 0 || kLeft > above;  // no digit above stopped
  const bool stops = d == 0 || kLeft <= above + here;
  if (notYet && stops) {
    st->kLeft = kLeft - above;
    st->prefix |= uint32_t(d) << shift;
    st->mask |= uint32_t(kDigits - 1) << shift;
  }
}

// Radix select: st->prefix becomes the bits of the k-th largest magnitude
// of v[0 .. n) (or [0, *nOnDevice)).
void radixSelect(const float* v, size_t n, const uint32_t* nOnDevice, uint32_t k, SelectState* st,
                 cudaStream_t s) {
  selectInitKernel<<<1, kThreads, 0, s>>>(st, k);
  CLAWCOMM_CUDA_LAUNCHED();
  for (int shift = 24; shift >= 0; shift -= 8) {
    histogramKernel<<<gridFor(n, kThreads), kThreads, 0, s>>>(v, n, nOnDevice, shift, st);
    CLAWCOMM_CUDA_LAUNCHED();
    pickKernel<<<1, kDigits, 0, s>>>(shift, st);
    CLAWCOMM_CUDA_LAUNCHED();
  }
}

struct AtOrAbove {  // |residual[i]| >= the selected threshold
  const float* v;
  const SelectState* st;
  __device__ bool operator()(size_t i) const { return magnitudeBits(v[i]) >= st->prefix; }
};

// The fold (residual += grad, grad = 0) and AtOrAbove's verdict, in one
// read of both arrays: a compaction test (cuda/compaction.cuh) that loads
// all its entries before it stores any.
struct FoldAtOrAbove {
  float* grad;
  float* residual;
  const SelectState* st;
  __device__ void operator()(size_t base, size_t count, bool (&pass)[kItems]) const {
    const uint32_t threshold = st->prefix;
    float r[kItems], g[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + size_t(j) * 32;
      r[j] = i < count ? residual[i] : 0.0f;
      g[j] = i < count ? grad[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + size_t(j) * 32;
      pass[j] = false;
      if (i < count) {
        const float acc = r[j] + g[j];
        residual[i] = acc;
        grad[i] = 0.0f;
        pass[j] = magnitudeBits(acc) >= threshold;
      }
    }
  }
};

// The emitters of the compactions (cuda/compaction.cuh): fetch what an
// entry carries, then put it at its rank.
struct TakeCandidate {  // moves residual[i] into the candidate list
  float* residual;
  int32_t* idx;
  float* val;
  using Value = float;
  __device__ float fetch(size_t i) const { return residual[i]; }
  __device__ void put(size_t i, uint32_t rank, float v) const {
    idx[rank] = int32_t(i);
    val[rank] = v;
    residual[i] = 0.0f;
  }
};

// Counts candidates strictly above the k-th largest candidate.
__global__ void countAboveKernel(const float* __restrict__ val, SelectState* st) {
  const uint32_t count = st->candidates;
  const uint32_t t = st->prefix;
  uint32_t mine = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    mine += magnitudeBits(val[j]) > t;
  }
  if (mine) atomicAdd(&st->above, mine);
}

struct IsTie {  // a candidate equal to the k-th largest
  const float* val;
  const SelectState* st;
  __device__ bool operator()(size_t j) const { return magnitudeBits(val[j]) == st->prefix; }
};

struct RecordTieRank {
  uint32_t* tieRank;
  using Value = uint8_t;  // nothing to fetch
  __device__ uint8_t fetch(size_t) const { return 0; }
  __device__ void put(size_t j, uint32_t rank, uint8_t) const { tieRank[j] = rank; }
};

// Kept: everything when there are at most k candidates; else the ones above
// the k-th largest, and ties in index order while places are left.
struct Kept {
  const float* val;
  const uint32_t* tieRank;
  const SelectState* st;
  uint32_t k;
  __device__ bool operator()(size_t j) const {
    if (st->candidates <= k) return true;
    const uint32_t m = magnitudeBits(val[j]);
    return m > st->prefix || (m == st->prefix && tieRank[j] < k - st->above);
  }
};

struct EmitKept {
  const int32_t* candIdx;
  const float* candVal;
  int32_t* idx;
  float* val;
  struct Value {
    int32_t idx;
    float val;
  };
  __device__ Value fetch(size_t j) const { return {candIdx[j], candVal[j]}; }
  __device__ void put(size_t, uint32_t rank, Value v) const {
    idx[rank] = v.idx;
    val[rank] = v.val;
  }
};

// Candidates that were not kept go back into the residual.
__global__ void putBackKernel(Kept kept, const int32_t* __restrict__ candIdx,
                              const float* __restrict__ candVal, float* residual,
                              const SelectState* st) {
  const uint32_t count = st->candidates;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    if (!kept(j)) residual[candIdx[j]] = candVal[j];
  }
}

__global__ void zeroKernel(SelectState* st) {
  if (threadIdx.x == 0) {
    st->above = 0;
    st->candidates = 0;
    st->kept = 0;
  }
}

__global__ void copyCountKernel(const SelectState* st, uint32_t* out) {
  if (threadIdx.x == 0) *out = st->kept;
}

// --- scatter-add -------------------------------------------------------------

__global__ void scatterAtomicKernel(float* dense, size_t n, const int32_t* __restrict__ idx,
                                    const float* __restrict__ val, size_t m, float scale) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < m; i += stride) {
    const int32_t x = idx[i];
    if (x >= 0 && size_t(x) < n) atomicAdd(dense + x, scale == 1.0f ? val[i] : val[i] * scale);
  }
}

// Over index-sorted pairs: the first pair of each run of one index adds the
// run's values in order, as the CPU's loop does.
__global__ void scatterRunsKernel(float* dense, size_t n, const int32_t* __restrict__ idx,
                                  const float* __restrict__ val, size_t m, float scale) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < m; i += stride) {
    const int32_t x = idx[i];
    if ((i > 0 && idx[i - 1] == x) || x < 0 || size_t(x) >= n) continue;
    float acc = dense[x];
    for (size_t j = i; j < m && idx[j] == x; ++j) acc += scale == 1.0f ? val[j] : val[j] * scale;
    dense[x] = acc;
  }
}

size_t sortTempBytes(size_t m) {
  size_t bytes = 0;
  CLAWCOMM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int32_t*)nullptr,
                                                      (int32_t*)nullptr, (const float*)nullptr,
                                                      (float*)nullptr, int(m)));
  return bytes;
}

}  // namespace

void encode16WithFeedback(DataType wire, const float* grad, float* residual, uint16_t* payload,
                          size_t n, float scale, Stream stream) {
  CLAWCOMM_ARG_CHECK(wire == DataType::kFloat16 || wire == DataType::kBFloat16,
                     "clawcomm::cuda::encode16_feedback: the wire format must be float16 or "
                     "bfloat16, not ",
                     dataTypeName(wire));
  CLAWCOMM_ARG_CHECK(std::isfinite(scale) && scale != 0.0f,
                     "clawcomm::cuda::encode16_feedback: ", "scale ", scale,
                     " is not a finite non-zero factor");
  if (n == 0) return;
  const float inverse = 1.0f / scale;
  const int grid = gridFor(n, kThreads);
  if (wire == DataType::kFloat16) {
    feedback16Kernel<true>
        <<<grid, kThreads, 0, asStream(stream)>>>(grad, residual, payload, n, scale, inverse);
  } else {
    feedback16Kernel<false>
        <<<grid, kThreads, 0, asStream(stream)>>>(grad, residual, payload, n, scale, inverse);
  }
  CLAWCOMM_CUDA_LAUNCHED();
}

size_t topkWorkspaceBytes(size_t n) {
  auto round = [](size_t b) { return (b + 255) & ~size_t(255); };
  const size_t sample = sampleRuns(n) * kSampleRun;
  return round(sizeof(SelectState)) + round(sample * 4) + 2 * round(n * 4) + round(n * 4) +
         3 * compaction::selectBytes(n);
}

void topkWithFeedback(float* grad, float* residual, size_t n, size_t k, TopkMethod method,
                      uint64_t seed, int32_t* idx, float* val, uint32_t* count, void* workspace,
                      Stream stream) {
  CLAWCOMM_ARG_CHECK(n <= size_t(INT32_MAX), "clawcomm::cuda::topk: ", n,
                     " elements do not fit 32-bit indices");
  const cudaStream_t s = asStream(stream);
  k = std::min(k, n);
  Workspace ws{static_cast<char*>(workspace)};
  auto* st = ws.take<SelectState>(1);
  zeroKernel<<<1, 1, 0, s>>>(st);
  CLAWCOMM_CUDA_LAUNCHED();
  // 1. fold the gradient into the residual: here, or in step 3's counting
  // pass when the threshold comes from a sample (which reads grad + residual)
  const bool sampled = method == TopkMethod::kSampled && sampleSize(n) < n;
  const bool foldInSelect = grad && n && k > 0 && sampled;
  if (grad && n && !foldInSelect) {
    foldKernel<<<gridFor(n, kThreads), kThreads, 0, s>>>(grad, residual, n);
    CLAWCOMM_CUDA_LAUNCHED();
  }
  if (k == 0) {
    copyCountKernel<<<1, 1, 0, s>>>(st, count);
    CLAWCOMM_CUDA_LAUNCHED();
    return;
  }
  // 2. the threshold, into st->prefix
  const size_t runs = sampleRuns(n);
  float* sample = ws.take<float>(runs * kSampleRun);
  if (sampled) {
    sampleKernel<<<gridFor(runs * kSampleRun, kThreads), kThreads, 0, s>>>(
        residual, foldInSelect ? grad : nullptr, n, seed, runs, sample);
    CLAWCOMM_CUDA_LAUNCHED();
    const size_t drawn = runs * kSampleRun;
    radixSelect(sample, drawn, nullptr, uint32_t(sampleRank(k, drawn, n)), st, s);
  } else {
    radixSelect(residual, n, nullptr, uint32_t(k), st, s);
  }
  // 3. candidates in index order, out of the residual
  int32_t* candIdx = ws.take<int32_t>(n);
  float* candVal = ws.take<float>(n);
  uint32_t* tieRank = ws.take<uint32_t>(n);
  const size_t selectBytes = compaction::selectBytes(n);
  Workspace scratch{ws.at};
  const TakeCandidate take{residual, candIdx, candVal};
  if (foldInSelect) {
    compaction::selectWith(n, nullptr, FoldAtOrAbove{grad, residual, st}, take, &st->candidates,
                           scratch, s);
  } else {
    compaction::select(n, nullptr, AtOrAbove{residual, st}, take, &st->candidates, scratch, s);
  }
  // 4. the k largest candidates (ties: lower index first); the rest go back
  radixSelect(candVal, n, &st->candidates, uint32_t(k), st, s);
  countAboveKernel<<<gridFor(n, kThreads), kThreads, 0, s>>>(candVal, st);
  CLAWCOMM_CUDA_LAUNCHED();
  uint32_t* ties = reinterpret_cast<uint32_t*>(sample);  // reused: the sample is done with
  Workspace scratch2{ws.at + selectBytes};
  compaction::select(n, &st->candidates, IsTie{candVal, st}, RecordTieRank{tieRank}, ties, scratch2,
                     s);
  const Kept kept{candVal, tieRank, st, uint32_t(k)};
  putBackKernel<<<gridFor(n, kThreads), kThreads, 0, s>>>(kept, candIdx, candVal, residual, st);
  CLAWCOMM_CUDA_LAUNCHED();
  Workspace scratch3{ws.at + 2 * selectBytes};
  compaction::select(n, &st->candidates, kept, EmitKept{candIdx, candVal, idx, val}, &st->kept,
                     scratch3, s);
  copyCountKernel<<<1, 1, 0, s>>>(st, count);
  CLAWCOMM_CUDA_LAUNCHED();
}

void scatterAddAtomic(float* dense, size_t n, const int32_t* idx, const float* val, size_t m,
                      float scale, Stream stream) {
  if (m == 0) return;
  scatterAtomicKernel<<<gridFor(m, kThreads), kThreads, 0, asStream(stream)>>>(dense, n, idx, val,
                                                                               m, scale);
  CLAWCOMM_CUDA_LAUNCHED();
}

size_t scatterAddWorkspaceBytes(size_t m) {
  return 2 * ((m * 4 + 255) & ~size_t(255)) + sortTempBytes(m);
}

void scatterAddDeterministic(float* dense, size_t n, const int32_t* idx, const float* val, size_t m,
                             float scale, void* workspace, Stream stream) {
  if (m == 0) return;
  const cudaStream_t s = asStream(stream);
  Workspace ws{static_cast<char*>(workspace)};
  int32_t* sortedIdx = ws.take<int32_t>(m);
  float* sortedVal = ws.take<float>(m);
  size_t tempBytes = sortTempBytes(m);
  // LSD radix sort is stable: equal indices keep their order.
  CLAWCOMM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws.at, tempBytes, idx, sortedIdx, val,
                                                      sortedVal, int(m), 0, 32, s));
  scatterRunsKernel<<<gridFor(m, kThreads), kThreads, 0, s>>>(dense, n, sortedIdx, sortedVal, m,
                                                              scale);
  CLAWCOMM_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace clawcomm
