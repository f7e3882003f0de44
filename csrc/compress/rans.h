// Static rANS (range asymmetric numeral systems, Duda) coding of a byte
// string: the entropy coder for the quantisers' packed codes and the top
// byte plane of sparse values. A table of the message's byte frequencies,
// scaled to 1 << kRansScaleBits, travels with it; the coder then spends
// close to the order-0 entropy (within about 1% on the codes measured in
// docs/coding.md), below one bit per byte where one byte value dominates,
// where a Huffman code spends at least a whole bit.
//
// kRansStates states interleave over one stream (symbol i belongs to state
// i % kRansStates), so decoding runs that many independent dependency
// chains at once: on AVX2, two vectors of eight (rans_avx2.cc). The states
// are 32 bits and renormalise by 16-bit words, as in Fabian Giesen's
// public-domain rans_word_sse41.h: a state lives in [kRansLow,
// kRansLow << 16), and a symbol moves at most one word.
//
// Stream: the input's length (a LEB128 varint); one byte, the number of
// distinct byte values minus one; the values themselves (one byte each)
// where there are fewer than 32, else a 32-byte bitmap; each value's
// frequency minus one as a LEB128 varint, in ascending order of value; the
// final states (little-endian uint32, state 0 first); then the
// renormalisation words (little-endian uint16), in the order the decoder
// takes them: symbol by symbol. An empty input gives an empty stream.
#pragma once

#include <cstddef>
#include <cstdint>

namespace clawcomm {

constexpr int kRansScaleBits = 12;
constexpr int kRansStates = 16;
constexpr uint32_t kRansLow = uint32_t(1) << 16;

// Upper bound of encodeRans's output for `n` input bytes (a symbol costs
// at most kRansScaleBits bits, the length and the table at most
// 10 + 1 + 32 + 2 * 256 bytes).
size_t maxRansBytes(size_t n);

// Writes the stream of `in` (`n` bytes) into `out` (at least
// maxRansBytes(n)); returns its length.
size_t encodeRans(const uint8_t* in, size_t n, uint8_t* out);

// Decodes `n` bytes from `in` (`bytes` long) into `out`; throws
// InvalidArgument on a stream of another length, one that is cut short, has
// bytes left over or a malformed table, or does not end in the states the
// encoder started from (most damage to the words shows there).
void decodeRans(const uint8_t* in, size_t bytes, uint8_t* out, size_t n);

// The vector part of decodeRans (rans_avx2.cc): decodes whole rounds of
// kRansStates symbols from `i` while a word for every state is left;
// `slots` is the decoding table (value | (frequency - 1) << 8 | offset <<
// 20 per slot), `x` the states, `p` the next word. Returns the new `i`.
size_t decodeRansAvx2(const uint32_t* slots, uint32_t* x, const uint8_t*& p, const uint8_t* end,
                      uint8_t* out, size_t i, size_t n);

}  // namespace clawcomm
