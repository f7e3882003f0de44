// What a receive does with a frame's payload as it arrives.
//
// The messenger hands each run of received bytes to the receive's sink
// straight out of the transport's memory (a shared-memory ring, a socket
// buffer), so combining costs no copy of its own. Algorithms choose the sink
// per receive:
//   copy            dst[i] = src[i]                       (bytes)
//   reduce          dst[i] = dst[i] op src[i]             (the op's dtype)
//   reduceFrom      dst[i] = local[i] op src[i]           (a reduce whose first
//                   operand is another buffer: copied a chunk at a time as the
//                   bytes arrive, so the copy needs no pass of its own)
//   reduceOnto      dst[i] = src[i] op local[i]           (the same with the
//                   arriving values as the first operand: the deterministic
//                   reductions keep every tree node's left-right order)
//   decode          dst[i] = widen(src[i]) * scale        (16-bit wire -> float32)
//   decodeAdd       dst[i] = dst[i] * scale + widen(src[i])
//   decodeAddRound  decodeAdd, then rounded[i] = round16(dst[i]) and
//                   dst[i] = widen(rounded[i]) * outScale (the 16-bit ring's
//                   last reduce-scatter step: the values every rank decodes)
// A sink is a small value; the messenger never allocates for one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace clawcomm {

struct ReceiveSink {
  enum class Kind : uint8_t {
    kCopy,
    kReduce,
    kReduceFrom,
    kReduceOnto,
    kDecode,
    kDecodeAdd,
    kDecodeAddRound
  };

  static ReceiveSink copy(void* dst);
  static ReceiveSink reduce(void* dst, DataType dtype, ReduceOp op);
  static ReceiveSink reduceFrom(void* dst, const void* local, DataType dtype, ReduceOp op);
  static ReceiveSink reduceOnto(void* dst, const void* local, DataType dtype, ReduceOp op);
  static ReceiveSink decode(float* dst, DataType wire, float scale = 1.0f);
  static ReceiveSink decodeAdd(float* dst, DataType wire, float dstScale = 1.0f);
  static ReceiveSink decodeAddRound(float* dst, DataType wire, uint16_t* rounded, float dstScale,
                                    float outScale);

  // The unit the sink works in: payload bytes are handed over in multiples
  // of it (the transport never splits an aligned 8-byte word, see
  // transport/transport.h), so an element is never cut in two.
  size_t granule() const;

  // Takes payload bytes [offset, offset + n) of the frame; n is a multiple
  // of granule().
  void take(size_t offset, const uint8_t* src, size_t n) const;

  Kind kind = Kind::kCopy;
  DataType dtype = DataType::kUInt8;  // reduce: the elements; decode*: the wire format
  ReduceOp op = ReduceOp::kSum;
  uint8_t* dst = nullptr;  // copy, reduce: bytes; decode*: float32 elements
  uint16_t* rounded = nullptr;
  const uint8_t* local = nullptr;  // reduceFrom, reduceOnto
  float scale = 1.0f;
  float outScale = 1.0f;
};

}  // namespace clawcomm
