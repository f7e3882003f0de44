// Broadcast and reduce for large messages, with the message split among the
// ranks (van de Geijn's broadcast, Rabenseifner's reduce), so that no rank
// moves the whole message more than about twice, whatever the group size:
//
//   broadcast, scatter + all-gather: the root sends chunk p (N/n bytes) to
//   each rank p, then every rank gathers every chunk (the all-gather the
//   layout calls for: direct on one host, hierarchical over hosts, else the
//   ring). The root sends (n-1)/n N instead of the binomial tree's
//   N ceil(log2 n); every rank receives about 2 (n-1)/n N.
//
//   reduce, reduce-scatter + gather: every rank ends with its chunk reduced
//   (the reduce-scatter the layout calls for), and the root gathers the
//   chunks. The root receives about 2 (n-1)/n N and reduces (n-1)/n N,
//   instead of the tree's N ceil(log2 n) of each; non-roots' buffers are left
//   as they were.
//
// The cost model (selection.cc) picks them over the binomial trees where they
// pay: from a few ranks and large messages. Chunks are cut by elements, the
// first N mod n chunks one element larger.
#include <cstdint>
#include <cstring>
#include <numeric>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"

namespace clawcomm {

void scatterAllGatherBroadcast(Channel& ch, void* buf, size_t count, int root) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> counts = evenCounts(count, n);
  const std::vector<size_t> off = byteOffsets(counts, es);
  uint8_t* b = static_cast<uint8_t*>(buf);
  if (r == root) {
    for (int p = 0; p < n; ++p) {
      if (p != root) ch.send(p, b + off[size_t(p)], counts[size_t(p)] * es);
    }
  } else {
    ch.recv(root, b + off[size_t(r)], counts[size_t(r)] * es);
  }
  ch.wait();
  const Topology& topo = ch.topology();
  if (directLayout(topo)) {
    directAllGather(ch, b + off[size_t(r)], b, counts);
  } else if (topo.hierarchical()) {
    hierarchicalAllGather(ch, b, counts);
  } else {
    ringAllGather(ch, b, counts);
  }
}

void reduceScatterGatherReduce(Channel& ch, void* buf, size_t count, int root) {
  const int n = ch.size(), r = ch.rank();
  const size_t es = ch.elementBytes();
  const std::vector<size_t> counts = evenCounts(count, n);
  const std::vector<size_t> off = byteOffsets(counts, es);
  uint8_t* b = static_cast<uint8_t*>(buf);
  const Topology& topo = ch.topology();
  // This rank's reduced chunk, in scratch: `buf` is only read until the root
  // gathers into it.
  const uint8_t* mine;
  if (directLayout(topo)) {
    uint8_t* chunk = ch.scratch(kOpScratch, counts[size_t(r)] * es);
    directReduceScatter(ch, b, chunk, counts);
    mine = chunk;
  } else {
    uint8_t* work = ch.scratch(kOpScratch, count * es);
    if (count) std::memcpy(work, b, count * es);
    if (topo.hierarchical()) {
      hierarchicalReduceScatter(ch, work, counts);
    } else {
      ringReduceScatter(ch, work, counts);
    }
    mine = work + off[size_t(r)];
  }
  if (r != root) {
    ch.send(root, mine, counts[size_t(r)] * es);
  } else {
    for (int p = 0; p < n; ++p) {
      if (p != root) ch.recv(p, b + off[size_t(p)], counts[size_t(p)] * es);
    }
    if (counts[size_t(r)]) std::memcpy(b + off[size_t(r)], mine, counts[size_t(r)] * es);
  }
  ch.wait();
}

}  // namespace clawcomm
