#include "messenger/sink.h"

#include <cstring>

#include "reduce/reduce_kernels.h"

namespace clawcomm {

ReceiveSink ReceiveSink::copy(void* dst) {
  ReceiveSink s;
  s.dst = static_cast<uint8_t*>(dst);
  return s;
}

ReceiveSink ReceiveSink::reduce(void* dst, DataType dtype, ReduceOp op) {
  ReceiveSink s = copy(dst);
  s.kind = Kind::kReduce;
  s.dtype = dtype;
  s.op = op;
  return s;
}

ReceiveSink ReceiveSink::reduceFrom(void* dst, const void* local, DataType dtype, ReduceOp op) {
  ReceiveSink s = reduce(dst, dtype, op);
  s.kind = Kind::kReduceFrom;
  s.local = static_cast<const uint8_t*>(local);
  return s;
}

ReceiveSink ReceiveSink::reduceOnto(void* dst, const void* local, DataType dtype, ReduceOp op) {
  ReceiveSink s = reduceFrom(dst, local, dtype, op);
  s.kind = Kind::kReduceOnto;
  return s;
}

ReceiveSink ReceiveSink::decode(float* dst, DataType wire, float scale) {
  ReceiveSink s = copy(dst);
  s.kind = Kind::kDecode;
  s.dtype = wire;
  s.scale = scale;
  return s;
}

ReceiveSink ReceiveSink::decodeAdd(float* dst, DataType wire, float dstScale) {
  ReceiveSink s = decode(dst, wire, dstScale);
  s.kind = Kind::kDecodeAdd;
  return s;
}

ReceiveSink ReceiveSink::decodeAddRound(float* dst, DataType wire, uint16_t* rounded,
                                        float dstScale, float outScale) {
  ReceiveSink s = decode(dst, wire, dstScale);
  s.kind = Kind::kDecodeAddRound;
  s.rounded = rounded;
  s.outScale = outScale;
  return s;
}

size_t ReceiveSink::granule() const {
  switch (kind) {
    case Kind::kCopy: return 1;
    case Kind::kReduce:
    case Kind::kReduceFrom:
    case Kind::kReduceOnto: return elementSize(dtype);
    default: return 2;  // one 16-bit wire value
  }
}

void ReceiveSink::take(size_t offset, const uint8_t* src, size_t n) const {
  if (n == 0) return;
  const size_t at = offset / 2;  // decode*: the first element
  float* f32 = reinterpret_cast<float*>(dst);
  switch (kind) {
    case Kind::kCopy: std::memcpy(dst + offset, src, n); return;
    case Kind::kReduce: reduceInto(dtype, op, dst + offset, src, n / elementSize(dtype)); return;
    case Kind::kReduceFrom:
      // In cache for the reduction next; `local` may be `dst` (an in-place
      // reduce-scatter's own chunk).
      if (dst != local) std::memcpy(dst + offset, local + offset, n);
      reduceInto(dtype, op, dst + offset, src, n / elementSize(dtype));
      return;
    case Kind::kReduceOnto: {
      // Through an L1 block, so that `local` may be `dst` (an in-place
      // all-reduce's own chunk): each piece of it is read before written.
      constexpr size_t kPiece = 4096;  // a multiple of every element size
      alignas(64) uint8_t piece[kPiece];
      for (size_t at = 0; at < n; at += kPiece) {
        const size_t m = n - at < kPiece ? n - at : kPiece;
        std::memcpy(piece, src + at, m);
        reduceInto(dtype, op, piece, local + offset + at, m / elementSize(dtype));
        std::memcpy(dst + offset + at, piece, m);
      }
      return;
    }
    case Kind::kDecode: toFloat32(dtype, src, f32 + at, n / 2, scale); return;
    case Kind::kDecodeAdd: addFrom16(dtype, f32 + at, src, n / 2, scale); return;
    case Kind::kDecodeAddRound:
      addFrom16AndRound(dtype, f32 + at, src, rounded + at, n / 2, scale, outScale);
      return;
  }
}

}  // namespace clawcomm
