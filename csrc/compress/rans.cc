#include "compress/rans.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/errors.h"

namespace clawcomm {
namespace {

constexpr uint32_t kScale = uint32_t(1) << kRansScaleBits;
constexpr size_t kListedSymbols = 32;  // fewer distinct values than this: listed, else a bitmap
constexpr size_t kTableBytes = 10 + 1 + 32 + 2 * 256;
constexpr size_t kStateBytes = 8 * kRansStates;

// Frequencies summing to kScale, every present value at least 1, close to
// counts * kScale / n: rounded, then moved one at a time where that costs
// the fewest bits (a value's count over its frequency: the derivative of
// its code length).
void scaleFrequencies(const uint64_t counts[256], size_t n, uint32_t freq[256]) {
  int64_t sum = 0;
  for (int s = 0; s < 256; ++s) {
    freq[s] = 0;
    if (!counts[s]) continue;
    const double exact = double(counts[s]) * kScale / double(n);
    freq[s] = std::max<uint32_t>(1, uint32_t(std::llround(exact)));
    sum += freq[s];
  }
  while (sum != int64_t(kScale)) {
    const bool take = sum > int64_t(kScale);
    int best = -1;
    double bestCost = 0;
    for (int s = 0; s < 256; ++s) {
      if (!freq[s] || (take && freq[s] == 1)) continue;
      // Taking one from s costs about counts/(f - 0.5) bits; giving one
      // saves about counts/(f + 0.5).
      const double cost =
          take ? double(counts[s]) / (freq[s] - 0.5) : -double(counts[s]) / (freq[s] + 0.5);
      if (best < 0 || cost < bestCost) {
        best = s;
        bestCost = cost;
      }
    }
    freq[best] += take ? uint32_t(-1) : 1u;
    sum += take ? -1 : 1;
  }
}

// An encoder's view of one value: the state bound past which it shifts out
// a word, and the division by its frequency as a multiply-high and a shift
// (Giesen's reciprocal form, exact for states below 2^63).
struct EncodeSymbol {
  uint64_t xMax = 0;
  uint64_t reciprocal = 0;
  uint32_t bias = 0;
  uint32_t complement = 0;  // kScale - frequency
  uint32_t shift = 0;
};

EncodeSymbol encodeSymbol(uint32_t start, uint32_t freq) {
  EncodeSymbol e;
  e.xMax = ((kRansLow >> kRansScaleBits) << 32) * freq;
  e.complement = kScale - freq;
  if (freq < 2) {
    e.reciprocal = ~uint64_t(0);
    e.shift = 0;
    e.bias = start + kScale - 1;
  } else {
    uint32_t shift = 0;
    while (freq > (uint32_t(1) << shift)) ++shift;
    // ceil(2^(63 + shift) / freq)
    e.reciprocal = uint64_t(((unsigned __int128)1 << (63 + shift)) / freq + 1);
    if (((unsigned __int128)1 << (63 + shift)) % freq == 0) --e.reciprocal;
    e.shift = shift - 1;
    e.bias = start;
  }
  return e;
}

inline void encodeOne(uint64_t& x, uint32_t*& p, const EncodeSymbol& e) {
  if (x >= e.xMax) {
    *--p = uint32_t(x);
    x >>= 32;
  }
  const uint64_t q = uint64_t(((unsigned __int128)x * e.reciprocal) >> 64) >> e.shift;
  x += e.bias + q * e.complement;
}

// Decoding: per slot of the scale, its value, and its frequency and its
// offset from the value's first slot packed as 13 + 12 bits (the value
// apart: it is not on the states' dependency chain).
struct DecodeTable {
  uint32_t slot[kScale];
  uint8_t value[kScale];
};

inline uint32_t decodeOne(uint64_t& x, const DecodeTable& t) {
  const uint32_t s = uint32_t(x) & (kScale - 1);
  const uint32_t e = t.slot[s];
  x = uint64_t(e & 0x1fff) * (x >> kRansScaleBits) + (e >> 13);
  return t.value[s];
}

void putVarint(uint8_t*& p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = uint8_t(v | 0x80);
    v >>= 7;
  }
  *p++ = uint8_t(v);
}

class Reader {
 public:
  Reader(const uint8_t* in, size_t bytes) : p_(in), end_(in + bytes) {}
  uint8_t byte(const char* what) {
    CLAWCOMM_ARG_CHECK(p_ < end_, "clawcomm::decode_rans: the stream ends in ", what);
    return *p_++;
  }
  // A LEB128 varint of at most `bits` bits.
  uint64_t varint(const char* what, int bits) {
    uint64_t v = 0;
    for (int shift = 0; shift < bits; shift += 7) {
      const uint8_t b = byte(what);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw InvalidArgument(CLAWCOMM_CONCAT("clawcomm::decode_rans: ", what, " is out of range"));
  }
  const uint8_t* at() const { return p_; }
  void skip(size_t n) { p_ += n; }
  size_t left() const { return size_t(end_ - p_); }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

}  // namespace

size_t maxRansBytes(size_t n) {
  return n == 0 ? 0 : kTableBytes + kStateBytes + 4 * ((n * kRansScaleBits + 31) / 32) + 16;
}

size_t encodeRans(const uint8_t* in, size_t n, uint8_t* out) {
  if (n == 0) return 0;
  uint64_t counts[256] = {};
  for (size_t i = 0; i < n; ++i) ++counts[in[i]];
  uint32_t freq[256];
  scaleFrequencies(counts, n, freq);

  uint8_t* p = out;
  putVarint(p, n);
  size_t distinct = 0;
  for (int s = 0; s < 256; ++s) distinct += freq[s] != 0;
  *p++ = uint8_t(distinct - 1);
  if (distinct < kListedSymbols) {
    for (int s = 0; s < 256; ++s)
      if (freq[s]) *p++ = uint8_t(s);
  } else {
    std::memset(p, 0, 32);
    for (int s = 0; s < 256; ++s)
      if (freq[s]) p[s >> 3] |= uint8_t(1u << (s & 7));
    p += 32;
  }
  EncodeSymbol symbols[256];
  uint32_t start = 0;
  for (int s = 0; s < 256; ++s) {
    if (!freq[s]) continue;
    putVarint(p, freq[s] - 1);
    symbols[s] = encodeSymbol(start, freq[s]);
    start += freq[s];
  }

  // The renormalisation words go backward from the end of `out`, symbols
  // last to first, then the states; all of it then moves down to `p`.
  uint8_t* const end = out + maxRansBytes(n);
  uint32_t* q = reinterpret_cast<uint32_t*>(end - (uintptr_t(end) & 3));
  uint64_t x[kRansStates];
  std::fill(x, x + kRansStates, kRansLow);
  for (size_t i = n; i-- > 0;) encodeOne(x[i % kRansStates], q, symbols[in[i]]);
  uint8_t* b = reinterpret_cast<uint8_t*>(q);
  const size_t words = size_t(reinterpret_cast<uint8_t*>(end - (uintptr_t(end) & 3)) - b);
  b -= kStateBytes;
  std::memcpy(b, x, kStateBytes);
  std::memmove(p, b, kStateBytes + words);
  return size_t(p - out) + kStateBytes + words;
}

void decodeRans(const uint8_t* in, size_t bytes, uint8_t* out, size_t n) {
  if (n == 0) {
    CLAWCOMM_ARG_CHECK(bytes == 0, "clawcomm::decode_rans: ", bytes, " bytes for an empty output");
    return;
  }
  Reader r(in, bytes);
  const uint64_t held = r.varint("its length", 64);
  CLAWCOMM_ARG_CHECK(held == n, "clawcomm::decode_rans: the stream holds ", held, " bytes, not ",
                     n);
  const size_t distinct = size_t(r.byte("its table")) + 1;
  bool present[256] = {};
  if (distinct < kListedSymbols) {
    int prev = -1;
    for (size_t i = 0; i < distinct; ++i) {
      const int s = r.byte("its table");
      CLAWCOMM_ARG_CHECK(s > prev, "clawcomm::decode_rans: the table's values are not ascending");
      present[s] = true;
      prev = s;
    }
  } else {
    CLAWCOMM_ARG_CHECK(r.left() >= 32, "clawcomm::decode_rans: the stream ends in its table");
    size_t seen = 0;
    for (int s = 0; s < 256; ++s) {
      present[s] = (r.at()[s >> 3] >> (s & 7)) & 1;
      seen += present[s];
    }
    CLAWCOMM_ARG_CHECK(seen == distinct, "clawcomm::decode_rans: the table's bitmap has ", seen,
                       " values, its count says ", distinct);
    r.skip(32);
  }
  DecodeTable table;  // 20 KiB: in the level-1 cache
  uint32_t start = 0;
  for (int s = 0; s < 256; ++s) {
    if (!present[s]) continue;
    const uint32_t f = uint32_t(r.varint("a frequency", 14)) + 1;
    CLAWCOMM_ARG_CHECK(f <= kScale - start, "clawcomm::decode_rans: the frequencies sum past ",
                       kScale);
    for (uint32_t j = 0; j < f; ++j) {
      table.slot[start + j] = f | (j << 13);
      table.value[start + j] = uint8_t(s);
    }
    start += f;
  }
  CLAWCOMM_ARG_CHECK(start == kScale, "clawcomm::decode_rans: the frequencies sum to ", start,
                     ", not ", kScale);
  CLAWCOMM_ARG_CHECK(r.left() >= kStateBytes,
                     "clawcomm::decode_rans: the stream ends in its "
                     "states");
  uint64_t x[kRansStates];
  std::memcpy(x, r.at(), kStateBytes);
  for (uint64_t v : x)
    CLAWCOMM_ARG_CHECK(v >= kRansLow && (v >> 63) == 0,
                       "clawcomm::decode_rans: a state is out of range");
  r.skip(kStateBytes);
  CLAWCOMM_ARG_CHECK(r.left() % 4 == 0, "clawcomm::decode_rans: ", r.left(),
                     " bytes of words, not a multiple of 4");
  const uint8_t* p = r.at();
  const uint8_t* const end = p + r.left();

  // A symbol's renormalisation takes one word or none. While a word for
  // every state is left, a round of kRansStates symbols decodes without a
  // bounds check or a branch: each state's word is found from how many the
  // states before it take, so the states' chains do not wait on each other
  // through the stream position.
  constexpr size_t kRound = kRansStates;
  size_t i = 0;
  for (; i + kRound <= n && size_t(end - p) >= 4 * kRound; i += kRound) {
    uint8_t symbols[kRound];
    for (size_t k = 0; k < kRound; ++k) symbols[k] = uint8_t(decodeOne(x[k], table));
    std::memcpy(out + i, symbols, kRound);
    // (Masks instead of the conditional measured 5% slower here, on codes
    // of 6.6 bits a byte, where a state takes a word one symbol in five.)
    size_t at = 0;
    for (size_t k = 0; k < kRound; ++k) {
      const bool take = x[k] < kRansLow;
      uint32_t w;
      std::memcpy(&w, p + 4 * at, 4);
      x[k] = take ? (x[k] << 32) | w : x[k];
      at += take;
    }
    p += 4 * at;
  }
  for (; i < n; ++i) {
    uint64_t& s = x[i % kRansStates];
    out[i] = uint8_t(decodeOne(s, table));
    if (s >= kRansLow) continue;
    CLAWCOMM_ARG_CHECK(p < end, "clawcomm::decode_rans: the stream ends before byte ", i, " of ",
                       n);
    uint32_t w;
    std::memcpy(&w, p, 4);
    s = (s << 32) | w;
    p += 4;
  }
  CLAWCOMM_ARG_CHECK(p == end, "clawcomm::decode_rans: ", end - p, " bytes left after ", n);
  for (uint64_t v : x)
    CLAWCOMM_ARG_CHECK(v == kRansLow,
                       "clawcomm::decode_rans: the states do not end where they "
                       "began (a damaged stream)");
}

}  // namespace clawcomm
