// Delta + LEB128 varint coding of ascending int32 indices: the tighter
// index packing for sparse gradients. Indices 1% apart in a large tensor
// become one or two bytes each instead of four.
#pragma once

#include <cstddef>
#include <cstdint>

namespace clawcomm {

// Upper bound of encodeIndices' output for `count` indices.
inline size_t maxEncodedBytes(size_t count) {
  return count * 5;
}

// Writes the gaps between consecutive indices (the first from 0) as LEB128
// varints into `out`; returns the bytes written. Throws InvalidArgument if
// the indices are not ascending and non-negative.
size_t encodeIndices(const int32_t* idx, size_t count, uint8_t* out);

// Decodes `count` indices from `in` (`bytes` long); throws InvalidArgument
// on a truncated or malformed stream.
void decodeIndices(const uint8_t* in, size_t bytes, int32_t* idx, size_t count);

}  // namespace clawcomm
