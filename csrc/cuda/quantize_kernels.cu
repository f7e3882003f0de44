// Block quantisation on the GPU (int8/int4, QSGD, TernGrad, EF-SignSGD):
// compress/quantize.h's codes, scales and residuals, bit for bit, from the
// per-value math both share (compress/quantize_math.h).
//
// Quantise: one warp per block of values.
//   1. the scale: lanes 0..7 each reduce every 8th value in order, and every
//      lane combines the eight partials 0..7 by shuffles: the CPU's order,
//      so the same float32 scale;
//   2. the codes: each lane writes whole bytes (8 / bits values each),
//      drawing its values' uniforms from the block's stream by index, and
//      rewrites their residuals.
// Dequantise: one thread per value, grid-stride.
//
// Bytes touched per value: read 4 (8 with a residual, which is written
// back: 4 more), write bits / 8; the scale pass re-reads the block from L1.
#include <cuda_runtime.h>

#include "compress/quantize_math.h"
#include "cuda/check.h"
#include "cuda/kernels.h"

namespace clawcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <int kBits, bool kStochastic>
__global__ void quantizeKernel(const float* x, float* residual, size_t blocks, size_t block,
                               BlockScale kind, uint64_t seed, uint8_t* __restrict__ codes,
                               float* __restrict__ scales) {
  const size_t b = size_t(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
  const int lane = int(threadIdx.x % kWarp);
  if (b >= blocks) return;  // the whole warp: nothing below waits on the others
  const float* xb = x + b * block;
  float* rb = residual ? residual + b * block : nullptr;
  float part = 0.0f;
  if (lane < quant::kScaleLanes) {
    for (size_t i = size_t(lane); i < block; i += quant::kScaleLanes) {
      part = quant::addToScale(kind, part, rb ? xb[i] + rb[i] : xb[i]);
    }
  }
  float total = 0.0f;  // every lane combines the same partials in the same order
  for (int l = 0; l < quant::kScaleLanes; ++l) {
    total = quant::combineScale(kind, total, __shfl_sync(kFullMask, part, l));
  }
  const float scale = quant::finishScale(kind, kBits, total, block);
  if (lane == 0) scales[b] = scale;
  const float inverse = quant::inverseOf(scale);
  const uint32_t base = quant::blockBase(seed, b);
  constexpr int kPerByte = 8 / kBits;
  const size_t bytes = block / kPerByte;
  uint8_t* cb = codes + b * bytes;
  for (size_t j = size_t(lane); j < bytes; j += kWarp) {
    uint32_t byte = 0;
    for (int t = 0; t < kPerByte; ++t) {
      const size_t i = j * kPerByte + size_t(t);
      const float a = rb ? xb[i] + rb[i] : xb[i];
      const float u = kBits > 1 && kStochastic ? quant::uniformAt(base, uint32_t(i)) : 0.5f;
      float decoded;
      byte |= uint32_t(quant::encodeValue<kBits>(a, scale, inverse, u, &decoded)) << (kBits * t);
      if (rb) rb[i] = a - decoded;
    }
    cb[j] = uint8_t(byte);
  }
}

template <int kBits>
__global__ void dequantizeKernel(const uint8_t* __restrict__ codes,
                                 const float* __restrict__ scales, size_t n, size_t block,
                                 float alpha, bool accumulate, float* __restrict__ out) {
  constexpr int kPerByte = 8 / kBits;
  constexpr uint32_t mask = (1u << kBits) - 1;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int c = int((uint32_t(codes[i / kPerByte]) >> (kBits * (i % kPerByte))) & mask);
    const float v = quant::decodeValue<kBits>(c, scales[i / block] * alpha);
    out[i] = accumulate ? out[i] + v : v;
  }
}

template <int kBits>
void launchQuantize(const QuantizeSpec& spec, const float* x, float* residual, size_t blocks,
                    uint64_t seed, uint8_t* codes, float* scales, cudaStream_t s) {
  const size_t grid = (blocks + kThreads / kWarp - 1) / (kThreads / kWarp);
  if (spec.stochastic) {
    quantizeKernel<kBits, true><<<unsigned(grid), kThreads, 0, s>>>(
        x, residual, blocks, spec.block, spec.scale, seed, codes, scales);
  } else {
    quantizeKernel<kBits, false><<<unsigned(grid), kThreads, 0, s>>>(
        x, residual, blocks, spec.block, spec.scale, seed, codes, scales);
  }
  CLAWCOMM_CUDA_LAUNCHED();
}

template <int kBits>
void launchDequantize(const QuantizeSpec& spec, const uint8_t* codes, const float* scales, size_t n,
                      float alpha, bool accumulate, float* out, cudaStream_t s) {
  dequantizeKernel<kBits><<<gridFor(n, kThreads), kThreads, 0, s>>>(codes, scales, n, spec.block,
                                                                    alpha, accumulate, out);
  CLAWCOMM_CUDA_LAUNCHED();
}

void checkLength(const QuantizeSpec& spec, size_t n, const char* op) {
  checkQuantizeSpec(spec, op);
  CLAWCOMM_ARG_CHECK(n % spec.block == 0, "clawcomm::cuda::", op, ": ", n,
                     " values are not a whole number of blocks of ", spec.block);
}

}  // namespace

void quantizeBlocks(const QuantizeSpec& spec, const float* x, float* residual, size_t n,
                    uint64_t seed, uint8_t* codes, float* scales, Stream stream) {
  checkLength(spec, n, "quantize");
  if (n == 0) return;
  const size_t blocks = n / spec.block;
  const cudaStream_t s = asStream(stream);
  switch (spec.bits) {
    case 1: return launchQuantize<1>(spec, x, residual, blocks, seed, codes, scales, s);
    case 2: return launchQuantize<2>(spec, x, residual, blocks, seed, codes, scales, s);
    case 4: return launchQuantize<4>(spec, x, residual, blocks, seed, codes, scales, s);
    default: return launchQuantize<8>(spec, x, residual, blocks, seed, codes, scales, s);
  }
}

void dequantizeBlocks(const QuantizeSpec& spec, const uint8_t* codes, const float* scales, size_t n,
                      float alpha, bool accumulate, float* out, Stream stream) {
  checkLength(spec, n, "dequantize");
  if (n == 0) return;
  const cudaStream_t s = asStream(stream);
  switch (spec.bits) {
    case 1: return launchDequantize<1>(spec, codes, scales, n, alpha, accumulate, out, s);
    case 2: return launchDequantize<2>(spec, codes, scales, n, alpha, accumulate, out, s);
    case 4: return launchDequantize<4>(spec, codes, scales, n, alpha, accumulate, out, s);
    default: return launchDequantize<8>(spec, codes, scales, n, alpha, accumulate, out, s);
  }
}

}  // namespace cuda
}  // namespace clawcomm
