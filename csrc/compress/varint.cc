#include "compress/varint.h"

#include "common/errors.h"

namespace clawcomm {

size_t encodeIndices(const int32_t* idx, size_t count, uint8_t* out) {
  uint8_t* p = out;
  int32_t prev = 0;
  for (size_t i = 0; i < count; ++i) {
    CLAWCOMM_ARG_CHECK(idx[i] >= prev && (i == 0 || idx[i] > prev),
                       "clawcomm::encode_indices: index ", idx[i], " at position ", i,
                       " is not above the previous one (", prev, ")");
    uint32_t gap = uint32_t(idx[i] - prev);
    prev = idx[i];
    while (gap >= 0x80) {
      *p++ = uint8_t(gap | 0x80);
      gap >>= 7;
    }
    *p++ = uint8_t(gap);
  }
  return size_t(p - out);
}

void decodeIndices(const uint8_t* in, size_t bytes, int32_t* idx, size_t count) {
  const uint8_t* p = in;
  const uint8_t* end = in + bytes;
  uint32_t value = 0;
  for (size_t i = 0; i < count; ++i) {
    uint32_t gap = 0;
    int shift = 0;
    while (true) {
      CLAWCOMM_ARG_CHECK(p < end && shift < 35, "clawcomm::decode_indices: stream ends or ",
                         "overflows at index ", i, " of ", count);
      const uint8_t b = *p++;
      gap |= uint32_t(b & 0x7f) << shift;
      shift += 7;
      if (!(b & 0x80)) break;
    }
    value += gap;
    idx[i] = int32_t(value);
  }
}

}  // namespace clawcomm
