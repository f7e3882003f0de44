// clawcomm's CUDA kernels: the API, in plain C++ (no CUDA or torch headers),
// so the bindings and the adapter call them like any other function.
//
// Every call is asynchronous on `stream` (a cudaStream_t; null is the legacy
// default stream), takes device pointers, and throws clawcomm::Error when a
// launch fails. The math per element is the CPU's (reduce/ops.h,
// compress/sampling.h), so the CPU kernels are the reference every kernel is
// validated against (tests/test_gpu_kernels.py) before it is timed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "compress/quantize.h"

namespace clawcomm {
namespace cuda {

using Stream = void*;

// Whether this build has the CUDA kernels (false: every call here throws,
// saying so; cuda_unavailable.cc).
bool built();

// --- Reductions and conversions (cuda/reduce_kernels.cu) -------------------

// dst[i] = dst[i] op src[i] for every dtype and operator the CPU kernels
// take (AVG reduces as SUM; the caller divides). float16 and bfloat16 reduce
// in float32 and round once, as on the CPU.
void reduceInto(DataType type, ReduceOp op, void* dst, const void* src, size_t count,
                Stream stream);
// x /= divisor (AVG's last step), for floating-point types.
void divideInPlace(DataType type, void* buf, size_t count, double divisor, Stream stream);
// The 16-bit wire: widen times scale; round x * scale; dst * dstScale +
// widen(src); and the ring's last reduce-scatter step (addFrom16, then
// out = round16(dst), dst = widen(out) * outScale).
void toFloat32(DataType wire, const void* src, float* dst, size_t count, float scale,
               Stream stream);
void fromFloat32(DataType wire, const float* src, void* dst, size_t count, float scale,
                 Stream stream);
void addFrom16(DataType wire, float* dst, const void* src, size_t count, float dstScale,
               Stream stream);
void addFrom16AndRound(DataType wire, float* dst, const void* src, void* out, size_t count,
                       float dstScale, float outScale, Stream stream);

// --- Compression (cuda/compress_kernels.cu) --------------------------------

// compress/feedback16.h on the GPU: one pass, grad + residual -> payload of
// round16((grad + residual) * scale) and the new residual.
void encode16WithFeedback(DataType wire, const float* grad, float* residual, uint16_t* payload,
                          size_t n, float scale, Stream stream);

enum class TopkMethod { kExact, kSampled };

// Device memory a top-k of n entries needs as scratch.
size_t topkWorkspaceBytes(size_t n);

// Top-k with error feedback, as compress/topk.h's topkWithFeedback: the
// entries of acc = grad + residual (grad may be null: acc = residual) with
// the largest magnitudes go to (idx ascending, val), the rest of acc becomes
// the new residual, and grad is zeroed. kSampled takes the threshold from
// the same sample the CPU takes for `seed` and then keeps the largest k of
// the candidates; kExact finds the k-th largest magnitude by radix select.
// Both give the CPU's result (ties: lower index first). `count` (device
// memory, one uint32) receives how many were selected. idx and val hold k
// entries; `workspace` holds topkWorkspaceBytes(n).
void topkWithFeedback(float* grad, float* residual, size_t n, size_t k, TopkMethod method,
                      uint64_t seed, int32_t* idx, float* val, uint32_t* count, void* workspace,
                      Stream stream);

// dense[idx[i]] += val[i] * scale for i < m. The atomic version is fast but
// adds colliding entries in whatever order the hardware takes them, so
// float sums can differ in the last bits from run to run; the deterministic
// one sorts the pairs by index (stable) and adds each index's values in
// their given order, which the CPU's scatterAdd also does. `workspace`
// holds scatterAddWorkspaceBytes(m) (deterministic only).
void scatterAddAtomic(float* dense, size_t n, const int32_t* idx, const float* val, size_t m,
                      float scale, Stream stream);
size_t scatterAddWorkspaceBytes(size_t m);
void scatterAddDeterministic(float* dense, size_t n, const int32_t* idx, const float* val, size_t m,
                             float scale, void* workspace, Stream stream);

// --- Block quantisation (cuda/quantize_kernels.cu) -------------------------

// compress/quantize.h's quantizeBlocks and dequantizeBlocks on the GPU: the
// same codes, scales and residual for the same seed (the per-value math is
// compress/quantize_math.h's). n is a multiple of spec.block; residual may
// be null, or n floats read and rewritten (it may alias x).
void quantizeBlocks(const QuantizeSpec& spec, const float* x, float* residual, size_t n,
                    uint64_t seed, uint8_t* codes, float* scales, Stream stream);
void dequantizeBlocks(const QuantizeSpec& spec, const uint8_t* codes, const float* scales, size_t n,
                      float alpha, bool accumulate, float* out, Stream stream);

}  // namespace cuda
}  // namespace clawcomm
