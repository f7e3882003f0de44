// Golomb-Rice coding of ascending int32 indices: the entropy coder for the
// index stream of a sparse message. The gaps between sorted indices of a
// random 1% of a tensor are close to geometric, whose entropy (about 8.1
// bits at 1%) a Rice code with the best parameter k reaches within a few
// percent, where LEB128 varints (varint.h) spend one or two whole bytes.
//
// Stream: one byte k (0..30), then the gaps (the first index itself, then
// each index minus the one before minus one), each as q = gap >> k in unary
// (q one-bits, a zero-bit) and the low k bits, packed little-endian from
// bit 0 of byte 1. A quotient of kEscapeQuotient or more is written as that
// many one-bits followed by the whole gap in 32 bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace clawcomm {

constexpr uint32_t kEscapeQuotient = 32;

// The k that makes the stream of `count` ascending indices shortest.
int riceParameter(const int32_t* idx, size_t count);

// Upper bound of encodeRice's output for `count` indices coded with `k`.
size_t maxRiceBytes(size_t count, int k);

// Writes the stream into `out` (at least maxRiceBytes); returns its length.
// Throws InvalidArgument if the indices are not strictly ascending and
// non-negative.
size_t encodeRice(const int32_t* idx, size_t count, int k, uint8_t* out);

// Decodes `count` indices from `in` (`bytes` long); throws InvalidArgument on
// a truncated or malformed stream.
void decodeRice(const uint8_t* in, size_t bytes, int32_t* idx, size_t count);

}  // namespace clawcomm
