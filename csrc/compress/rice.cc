#include "compress/rice.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "common/errors.h"

namespace clawcomm {
namespace {

// The stream's bit count with parameters k-1, k and k+1 (0 where k-1 < 0),
// in one pass over the gaps.
void riceBits3(const int32_t* idx, size_t count, int k, uint64_t bits[3]) {
  bits[0] = bits[1] = bits[2] = 0;
  int64_t prev = -1;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t gap = uint32_t(int64_t(idx[i]) - prev - 1);
    prev = idx[i];
    for (int j = 0; j < 3; ++j) {
      const int kj = k - 1 + j;
      if (kj < 0) continue;
      const uint32_t q = gap >> kj;
      bits[j] += q < kEscapeQuotient ? q + 1 + uint64_t(kj) : kEscapeQuotient + 32;
    }
  }
}

class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  // Appends the low `n` (<= 32) bits of `v`.
  void put(uint64_t v, int n) {
    acc_ |= (v & ((uint64_t(1) << n) - 1)) << fill_;
    fill_ += n;
    if (fill_ >= 32) {
      const uint32_t word = uint32_t(acc_);
      std::memcpy(out_ + bytes_, &word, 4);
      bytes_ += 4;
      acc_ >>= 32;
      fill_ -= 32;
    }
  }
  void ones(uint32_t n) {
    while (n >= 32) {
      put(0xffffffffu, 32);
      n -= 32;
    }
    put((uint64_t(1) << n) - 1, int(n));
  }
  size_t finish() {
    while (fill_ > 0) {
      out_[bytes_++] = uint8_t(acc_);
      acc_ >>= 8;
      fill_ = fill_ > 8 ? fill_ - 8 : 0;
    }
    return bytes_;
  }

 private:
  uint8_t* out_;
  size_t bytes_ = 0;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

class BitReader {
 public:
  BitReader(const uint8_t* in, size_t bytes) : in_(in), bytes_(bytes) { refill(); }
  // The next `n` (<= 32) bits.
  uint32_t take(int n) {
    if (fill_ < n) refill();
    check(fill_ >= n);
    const uint32_t v = uint32_t(acc_ & ((uint64_t(1) << n) - 1));
    consume(n);
    return v;
  }
  // Counts one-bits up to the next zero-bit (consumed with them); stops at
  // `limit` ones, leaving what follows them.
  uint32_t unary(uint32_t limit) {
    uint32_t q = 0;
    while (true) {
      refill();
      check(fill_ > 0);
      // Bits above fill_ are zero, so the run of ones stops there at most.
      const int run = ~acc_ == 0 ? 64 : __builtin_ctzll(~acc_);
      if (q + uint32_t(run) >= limit) {
        consume(int(limit - q));
        return limit;
      }
      if (run < fill_) {
        consume(run + 1);
        return q + uint32_t(run);
      }
      q += uint32_t(run);
      consume(run);
    }
  }

 private:
  void consume(int n) {
    acc_ = n >= 64 ? 0 : acc_ >> n;
    fill_ -= n;
  }
  void refill() {
    while (fill_ <= 56 && pos_ < bytes_) {
      acc_ |= uint64_t(in_[pos_++]) << fill_;
      fill_ += 8;
    }
  }
  static void check(bool ok) {
    CLAWCOMM_ARG_CHECK(ok, "clawcomm::decode_rice: the stream ends before its last index");
  }
  const uint8_t* in_;
  size_t bytes_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

}  // namespace

int riceParameter(const int32_t* idx, size_t count) {
  if (count == 0) return 0;
  // Near log2 of the mean gap, then the exact count of its neighbours.
  const double mean = (double(idx[count - 1]) + 1) / double(count);
  int guess = 0;
  while (guess < 30 && double(uint64_t(1) << (guess + 1)) <= mean * 0.69) ++guess;
  // Ties keep the guess, then k-1 over k+1.
  uint64_t bits[3];
  riceBits3(idx, count, guess, bits);
  int best = guess;
  uint64_t bestBits = bits[1];
  for (int j : {0, 2}) {
    const int k = guess - 1 + j;
    if (k < 0 || k > 30) continue;
    if (bits[j] < bestBits) {
      best = k;
      bestBits = bits[j];
    }
  }
  return best;
}

size_t maxRiceBytes(size_t count, int k) {
  const size_t perGap = std::max<size_t>(size_t(k) + 1 + kEscapeQuotient, kEscapeQuotient + 32);
  return 1 + (count * perGap + 7) / 8 + 8;
}

size_t encodeRice(const int32_t* idx, size_t count, int k, uint8_t* out) {
  CLAWCOMM_ARG_CHECK(k >= 0 && k <= 30, "clawcomm::encode_rice: parameter ", k, " is not in 0..30");
  out[0] = uint8_t(k);
  BitWriter w(out + 1);
  int64_t prev = -1;
  for (size_t i = 0; i < count; ++i) {
    CLAWCOMM_ARG_CHECK(int64_t(idx[i]) > prev, "clawcomm::encode_rice: index ", idx[i],
                       " at position ", i, " is not above the previous one (", prev, ")");
    const uint32_t gap = uint32_t(int64_t(idx[i]) - prev - 1);
    prev = idx[i];
    const uint32_t q = gap >> k;
    if (q < kEscapeQuotient) {
      w.ones(q);
      w.put(0, 1);
      if (k) w.put(gap, k);
    } else {
      w.ones(kEscapeQuotient);
      w.put(gap, 32);
    }
  }
  return 1 + w.finish();
}

void decodeRice(const uint8_t* in, size_t bytes, int32_t* idx, size_t count) {
  if (count == 0) return;
  CLAWCOMM_ARG_CHECK(bytes >= 1 && in[0] <= 30, "clawcomm::decode_rice: ",
                     bytes ? "parameter byte out of range" : "empty stream");
  const int k = in[0];
  BitReader r(in + 1, bytes - 1);
  int64_t prev = -1;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t q = r.unary(kEscapeQuotient);
    const uint64_t gap =
        q < kEscapeQuotient ? (uint64_t(q) << k) | (k ? r.take(k) : 0) : r.take(32);
    const int64_t v = prev + 1 + int64_t(gap);
    CLAWCOMM_ARG_CHECK(v <= INT32_MAX, "clawcomm::decode_rice: index ", i, " overflows int32");
    idx[i] = int32_t(v);
    prev = v;
  }
}

}  // namespace clawcomm
