#include "compress/rans.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/errors.h"
#include "reduce/reduce_kernels.h"

namespace clawcomm {
namespace {

constexpr uint32_t kScale = uint32_t(1) << kRansScaleBits;
constexpr size_t kListedSymbols = 32;  // fewer distinct values than this: listed, else a bitmap
constexpr size_t kTableBytes = 10 + 1 + 32 + 2 * 256;
constexpr size_t kStateBytes = 4 * kRansStates;

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

// An encoder's view of one value: its frequency and first slot, and the
// state bound past which it sheds a word first. (A multiply-high by a
// reciprocal instead of the division, as rans_byte.h does it, took twice
// as long here: 33 bits of reciprocal for 32-bit states need 128-bit
// products.)
struct EncodeSymbol {
  uint32_t xMax = 0;
  uint32_t freq = 0;
  uint32_t start = 0;
};

EncodeSymbol encodeSymbol(uint32_t start, uint32_t freq) {
  // kRansLow << 16 / kScale * freq, at most 2^32 - 1 short of 2^32: a
  // value that holds the whole scale is never shed for.
  const uint64_t bound = (uint64_t(kRansLow >> kRansScaleBits) << 16) * freq;
  return {uint32_t(std::min<uint64_t>(bound, 0xffffffffu)), freq, start};
}

// Whether a state sheds a word is a coin toss to the branch predictor, so
// the word is always written below `p`, and kept (p moves down) only when
// shed: an unkept one is written over by the next, or by the states.
inline void encodeOne(uint32_t& x, uint16_t*& p, const EncodeSymbol& e) {
  const bool shed = x >= e.xMax;
  p[-1] = uint16_t(x);
  p -= shed;
  x = shed ? x >> 16 : x;
  x = ((x / e.freq) << kRansScaleBits) + (x % e.freq) + e.start;
}

// One decoding slot: the value, its frequency minus one, and the slot's
// offset from the value's first slot, packed as 8 + 12 + 12 bits.
inline uint32_t decodeOne(uint32_t& x, const uint32_t* slots) {
  const uint32_t e = slots[x & (kScale - 1)];
  x = (((e >> 8) & (kScale - 1)) + 1) * (x >> kRansScaleBits) + (e >> 20);
  return e & 0xff;
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
  return n == 0 ? 0 : kTableBytes + kStateBytes + 2 * ((n * kRansScaleBits + 15) / 16) + 16;
}

size_t encodeRans(const uint8_t* in, size_t n, uint8_t* out) {
  if (n == 0) return 0;
  // Four histograms: runs of one value would otherwise wait on their own
  // increments' stores.
  uint32_t part[4][256] = {};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++part[0][in[i]];
    ++part[1][in[i + 1]];
    ++part[2][in[i + 2]];
    ++part[3][in[i + 3]];
  }
  for (; i < n; ++i) ++part[0][in[i]];
  uint64_t counts[256];
  for (int s = 0; s < 256; ++s)
    counts[s] = uint64_t(part[0][s]) + part[1][s] + part[2][s] + part[3][s];
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
  uint16_t* const last = reinterpret_cast<uint16_t*>(end - (uintptr_t(end) & 1));
  uint16_t* q = last;
  uint32_t x[kRansStates];
  std::fill(x, x + kRansStates, kRansLow);
  // The last, partial round first, then whole rounds, each last state first.
  i = n;
  for (; i % kRansStates; --i) encodeOne(x[(i - 1) % kRansStates], q, symbols[in[i - 1]]);
  for (; i > 0; i -= kRansStates) {
    const uint8_t* round = in + i - kRansStates;
    for (int k = kRansStates - 1; k >= 0; --k) encodeOne(x[k], q, symbols[round[k]]);
  }
  const size_t words = 2 * size_t(last - q);
  uint8_t* b = reinterpret_cast<uint8_t*>(q) - kStateBytes;
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
  alignas(32) uint32_t slots[kScale];  // 16 KiB: in the level-1 cache
  uint32_t start = 0;
  for (int s = 0; s < 256; ++s) {
    if (!present[s]) continue;
    const uint32_t f = uint32_t(r.varint("a frequency", 14)) + 1;
    CLAWCOMM_ARG_CHECK(f <= kScale - start, "clawcomm::decode_rans: the frequencies sum past ",
                       kScale);
    for (uint32_t j = 0; j < f; ++j) slots[start + j] = uint32_t(s) | ((f - 1) << 8) | (j << 20);
    start += f;
  }
  CLAWCOMM_ARG_CHECK(start == kScale, "clawcomm::decode_rans: the frequencies sum to ", start,
                     ", not ", kScale);
  CLAWCOMM_ARG_CHECK(r.left() >= kStateBytes,
                     "clawcomm::decode_rans: the stream ends in its states");
  uint32_t x[kRansStates];
  std::memcpy(x, r.at(), kStateBytes);
  for (uint32_t v : x)
    CLAWCOMM_ARG_CHECK(v >= kRansLow, "clawcomm::decode_rans: a state is out of range");
  r.skip(kStateBytes);
  CLAWCOMM_ARG_CHECK(r.left() % 2 == 0, "clawcomm::decode_rans: ", r.left(),
                     " bytes of words, not a multiple of 2");
  const uint8_t* p = r.at();
  const uint8_t* const end = p + r.left();
  size_t i = 0;
  if (activeSimdLevel() != SimdLevel::kPortable) i = decodeRansAvx2(slots, x, p, end, out, i, n);
  // Symbol by symbol (the portable level, and what the vectors leave): a
  // state takes the next word when it falls below kRansLow.
  for (; i < n; ++i) {
    uint32_t& s = x[i % kRansStates];
    out[i] = uint8_t(decodeOne(s, slots));
    if (s >= kRansLow) continue;
    CLAWCOMM_ARG_CHECK(p < end, "clawcomm::decode_rans: the stream ends before byte ", i, " of ",
                       n);
    uint16_t w;
    std::memcpy(&w, p, 2);
    s = (s << 16) | w;
    p += 2;
  }
  CLAWCOMM_ARG_CHECK(p == end, "clawcomm::decode_rans: ", end - p, " bytes left after ", n);
  for (uint32_t v : x)
    CLAWCOMM_ARG_CHECK(v == kRansLow,
                       "clawcomm::decode_rans: the states do not end where they "
                       "began (a damaged stream)");
}

}  // namespace clawcomm
