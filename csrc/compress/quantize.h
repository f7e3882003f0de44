// Block quantisation for gradient compression: one kernel behind int8/int4
// (ZeRO++'s qgZ), QSGD, TernGrad and EF-SignSGD.
//
// Values are cut into blocks of `block`; each block travels as `bits`-bit
// codes and one float32 scale:
//
//   bits 8, 4, 2: levels v in [-q, q], q = 2^(bits-1) - 1 (127, 7, 1), the
//                 value being v * scale; the scale is the block's largest
//                 magnitude over q (kMax: int8/int4, TernGrad) or its L2
//                 norm over q (kL2: QSGD). Rounding is stochastic (floor of
//                 y + u, u uniform in [0, 1): unbiased) or to nearest.
//   bits 1:       the sign, the value being +scale or -scale, the scale the
//                 block's mean magnitude (kMeanAbs: EF-SignSGD's |x|_1 / d).
//
// With a residual (error feedback) the kernel quantises acc = x + residual
// and leaves residual = acc - decoded: what was sent plus what is kept is
// what was accumulated. Codes are packed little-end first (element j of a
// byte at bit bits * j), stored as v + 2^(bits-1) for bits >= 2 and as
// (acc >= 0) for bits 1, so a block's codes are whole bytes.
//
// The random draw for value i of block b is an integer hash of i plus a base
// from splitmix64 of (seed, b): the same seed gives the same bits whatever
// splits the work, and the loop vectorises.
#pragma once

#include <cstddef>
#include <cstdint>

namespace clawcomm {

enum class BlockScale { kMax, kL2, kMeanAbs };

struct QuantizeSpec {
  int bits = 8;        // 1, 2, 4 or 8
  size_t block = 256;  // a multiple of 8
  BlockScale scale = BlockScale::kMax;
  bool stochastic = true;  // ignored for bits 1 (a sign has nothing to round)
};

// Throws InvalidArgument (naming `op`) on bits, block or scale that do not fit.
void checkQuantizeSpec(const QuantizeSpec& spec, const char* op);

// Bytes of codes for n values (n a multiple of the block).
size_t packedBytes(const QuantizeSpec& spec, size_t n);

// Quantises x[0..n) (n a multiple of spec.block) into `codes`
// (packedBytes) and `scales` (n / block). `residual` may be null (no error
// feedback) or n floats, read and rewritten; it may alias x only when x is
// not needed after.
void quantizeBlocks(const QuantizeSpec& spec, const float* x, float* residual, size_t n,
                    uint64_t seed, uint8_t* codes, float* scales);

// out[i] = alpha * decoded[i], or out[i] += alpha * decoded[i] (accumulate):
// the float32 sum of several ranks' codes is one call per rank.
void dequantizeBlocks(const QuantizeSpec& spec, const uint8_t* codes, const float* scales, size_t n,
                      float alpha, bool accumulate, float* out);

}  // namespace clawcomm
