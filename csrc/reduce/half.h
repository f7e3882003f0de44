// Scalar float16 / bfloat16 <-> float32 conversions (round to nearest even).
//
// Written with plain integer operations so that loops calling them vectorise
// without F16C: the portable kernels use them, and the F16C / AVX-512 ones use
// them for the tail of a block. The CUDA kernels (csrc/cuda/) call the same
// functions, so a GPU rounds exactly as the CPU does.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/hd.h"

namespace clawcomm {

CLAWCOMM_HD float bitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

CLAWCOMM_HD uint32_t floatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

CLAWCOMM_HD float bf16ToFloat(uint16_t h) {
  return bitsToFloat(uint32_t(h) << 16);
}

CLAWCOMM_HD uint16_t floatToBf16(float f) {
  uint32_t u = floatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE binary16 -> binary32, exact (normals, subnormals, inf, NaN).
CLAWCOMM_HD float halfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t twoH = uint32_t(h) << 17;  // drop the sign
  // Normal numbers: shift exponent/mantissa into place and rebias by 2^112.
  const float normal = bitsToFloat((twoH >> 4) + (0xE0u << 23)) * bitsToFloat(0x07800000u);
  // Subnormals: use the float unit to normalise.
  const float denorm = bitsToFloat((twoH >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = twoH < (1u << 27) ? floatToBits(denorm) : floatToBits(normal);
  return bitsToFloat(sign | bits);
}

// IEEE binary32 -> binary16 with round to nearest even; overflow gives inf.
CLAWCOMM_HD uint16_t floatToHalf(float f) {
  const float scaleToInf = bitsToFloat(0x77800000u);   // 2^112
  const float scaleToZero = bitsToFloat(0x08800000u);  // 2^-110
  float base = (f < 0 ? -f : f) * scaleToInf * scaleToZero;
  const uint32_t w = floatToBits(f);
  const uint32_t shl1 = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1 & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bitsToFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = floatToBits(base);
  const uint32_t expBits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantBits = bits & 0x00000fffu;
  const uint32_t nonsign = expBits + mantBits;
  return uint16_t((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

// A 16-bit float (`kHalf`: IEEE binary16, else bfloat16) and back.
template <bool kHalf>
CLAWCOMM_HD float widen16(uint16_t h) {
  return kHalf ? halfToFloat(h) : bf16ToFloat(h);
}
template <bool kHalf>
CLAWCOMM_HD uint16_t round16(float f) {
  return kHalf ? floatToHalf(f) : floatToBf16(f);
}

}  // namespace clawcomm
