// All-to-all with uneven splits in two stages, for m hosts with k ranks
// each (the 2D hierarchical all-to-all of Tutel and DeepSpeed): each pair
// of hosts exchanges one message per local index instead of k^2 small ones.
//
// Rank R(x, j) is the j-th rank of host x; this rank is R(h, i). A block
// a -> b is what rank a sends to rank b (sendBytes at a, recvBytes at b);
// b = N/n bytes each for an even split of N per rank.
//
//   0. Sizes, inside the host: R(h, i) sends each local peer R(h, j) the m
//      sizes of its blocks for R(*, j), one 8-byte count per host, and
//      learns its peers' sizes for R(*, i): every receive below then knows
//      its exact size (frames are checked on arrival).
//   1. Shuffle, inside the host: R(h, i) sends R(h, j) its m blocks for
//      R(*, j), one frame each, straight from the input; (k-1) m b bytes
//      per rank. The block for R(h, j) itself lands in R(h, j)'s output,
//      the others in its staging buffer, laid out [x][j]: region x holds
//      the blocks of R(h, 0..k-1) for R(x, i), back to back. Own blocks are
//      copied in.
//   2. Across hosts, among the i-th ranks: R(h, i) sends R(x, i) region x,
//      its host's k blocks for R(x, i), as one message, after a frame of
//      their k sizes (the receiver checks them against its receive counts).
//      Where host x's ranks are numbered consecutively those blocks are
//      consecutive in the receiver's output too, and the message lands
//      there; otherwise it lands aside and is copied into place. k (m-1) b
//      bytes per rank, k^2 (m-1) b per host link, as in the pairwise
//      all-to-all, in k (m-1) messages instead of k^2 (m-1).
//
// The shuffle's sends go out before the sizes are waited for, and stage 2's
// receives are posted before the shuffle is waited for. Not pipelined:
// stage 2 starts when stage 1 has ended (docs/algorithms.md).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "algorithms/algorithms.h"
#include "common/errors.h"

namespace clawcomm {
namespace {

// Where the ranks sit: ranks[x][j] = R(x, j); this rank is R(h, i).
struct Grid {
  std::vector<int> local, cross;
  std::vector<std::vector<int>> ranks;
  int k = 0, m = 0, i = 0, h = 0;
  bool consecutive = true;  // every host's ranks numbered one after another
};

Grid gridOf(const Channel& ch) {
  const Topology& t = ch.topology();
  Grid g;
  g.local = t.localGroup(ch.rank());
  g.cross = t.crossGroup(ch.rank());
  g.k = int(g.local.size());
  g.m = int(g.cross.size());
  g.i = t.localIndex(ch.rank());
  for (int x = 0; x < g.m; ++x) {
    if (g.cross[size_t(x)] == ch.rank()) g.h = x;
    g.ranks.push_back(t.localGroup(g.cross[size_t(x)]));
    g.consecutive = g.consecutive && g.ranks.back().back() - g.ranks.back().front() == g.k - 1;
  }
  return g;
}

std::vector<size_t> offsetsOf(const std::vector<size_t>& bytes) {
  std::vector<size_t> off(bytes.size() + 1, 0);
  for (size_t p = 0; p < bytes.size(); ++p) off[p + 1] = off[p] + bytes[p];
  return off;
}

}  // namespace

void hierarchicalAllToAll(Channel& ch, const void* in, const std::vector<size_t>& sendBytes,
                          void* out, const std::vector<size_t>& recvBytes) {
  if (!ch.topology().hierarchical()) {
    pairwiseAllToAll(ch, in, sendBytes, out, recvBytes);
    return;
  }
  const Grid g = gridOf(ch);
  const size_t k = size_t(g.k), m = size_t(g.m), i = size_t(g.i), h = size_t(g.h);
  const std::vector<size_t> sendOff = offsetsOf(sendBytes), recvOff = offsetsOf(recvBytes);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(out);
  Channel sizes(ch, g.local), shuffle(ch, g.local), cross(ch, g.cross);

  // 0. mine[j][x]: this rank's block for R(x, j); column[x][j]: R(h, j)'s
  // block for R(x, i), from each local peer.
  std::vector<uint64_t> mine(k * m), column(m * k), got(k * m);
  for (size_t j = 0; j < k; ++j) {
    for (size_t x = 0; x < m; ++x) mine[j * m + x] = sendBytes[size_t(g.ranks[x][j])];
  }
  for (size_t s = 1; s < k; ++s) {
    const size_t to = (i + s) % k, from = (i + k - s) % k;
    sizes.send(int(to), &mine[to * m], m * sizeof(uint64_t));
    sizes.recv(int(from), &got[from * m], m * sizeof(uint64_t));
  }
  // 1. The shuffle's sends, in host order to each peer.
  for (size_t s = 1; s < k; ++s) {
    const size_t j = (i + s) % k;
    for (size_t x = 0; x < m; ++x) {
      const int r = g.ranks[x][j];
      shuffle.send(int(j), src + sendOff[size_t(r)], sendBytes[size_t(r)]);
    }
  }
  std::copy(&mine[i * m], &mine[i * m] + m, &got[i * m]);
  sizes.wait();
  for (size_t x = 0; x < m; ++x) {
    for (size_t j = 0; j < k; ++j) column[x * k + j] = got[j * m + x];
  }

  // The staging regions (none for this host), then what lands aside.
  std::vector<size_t> region(m + 1, 0), aside(m + 1, 0);
  std::vector<size_t> incoming(m, 0);  // from R(y, *), by this rank's counts
  for (size_t x = 0; x < m; ++x) {
    size_t bytes = 0;
    for (size_t j = 0; j < k; ++j) bytes += column[x * k + j];
    region[x + 1] = region[x] + (x == h ? 0 : bytes);
    for (int r : g.ranks[x]) incoming[x] += recvBytes[size_t(r)];
    aside[x + 1] = aside[x] + (g.consecutive || x == h ? 0 : incoming[x]);
  }
  uint8_t* staging = ch.scratch(kAlgorithmScratch, region[m] + aside[m]);
  uint8_t* parked = staging + region[m];
  auto slot = [&](size_t x, size_t j) {
    size_t off = region[x];
    for (size_t q = 0; q < j; ++q) off += column[x * k + q];
    return staging + off;
  };

  // 2's receives: from R(y, i), the sizes, then the blocks of R(y, *).
  std::vector<uint64_t> claimed(m * k);
  for (size_t s = 1; s < m; ++s) {
    const size_t y = (h + m - s) % m;
    uint8_t* land = g.consecutive ? dst + recvOff[size_t(g.ranks[y][0])] : parked + aside[y];
    cross.recv(int(y), &claimed[y * k], k * sizeof(uint64_t));
    cross.recv(int(y), land, incoming[y]);
  }
  // 1's receives, in the order each peer sends.
  for (size_t s = 1; s < k; ++s) {
    const size_t j = (i + k - s) % k;
    for (size_t x = 0; x < m; ++x) {
      if (x == h) {
        const int r = g.ranks[h][j];
        shuffle.recv(int(j), dst + recvOff[size_t(r)], recvBytes[size_t(r)]);
      } else {
        shuffle.recv(int(j), slot(x, j), column[x * k + j]);
      }
    }
  }
  ch.progress();  // the frames (or references) out first: peers read while this rank copies
  const int me = ch.rank();
  ch.copyLocal(dst + recvOff[size_t(me)], src + sendOff[size_t(me)], recvBytes[size_t(me)]);
  for (size_t x = 0; x < m; ++x) {
    if (x == h) continue;
    const int r = g.ranks[x][i];
    ch.copyLocal(slot(x, i), src + sendOff[size_t(r)], sendBytes[size_t(r)]);
  }
  shuffle.wait();

  // 2. One message to each other host's i-th rank.
  for (size_t s = 1; s < m; ++s) {
    const size_t x = (h + s) % m;
    cross.send(int(x), &column[x * k], k * sizeof(uint64_t));
    cross.send(int(x), staging + region[x], region[x + 1] - region[x]);
  }
  cross.wait();
  for (size_t y = 0; y < m; ++y) {
    for (size_t j = 0; j < k && y != h; ++j) {
      const int r = g.ranks[y][j];
      if (claimed[y * k + j] != recvBytes[size_t(r)]) {
        throw MismatchError(CLAWCOMM_CONCAT(
            "rank ", r, " sent ", claimed[y * k + j], " bytes to rank ", me, ", which expected ",
            recvBytes[size_t(r)], " (do the ranks pass different split sizes?)"));
      }
    }
  }
  if (g.consecutive) return;
  for (size_t y = 0; y < m; ++y) {
    if (y == h) continue;
    const uint8_t* from = parked + aside[y];
    for (int r : g.ranks[y]) {
      ch.copyLocal(dst + recvOff[size_t(r)], from, recvBytes[size_t(r)]);
      from += recvBytes[size_t(r)];
    }
  }
}

}  // namespace clawcomm
