// Collective algorithms, one per file, each a free function over a Channel.
//
// Buffers are raw bytes; element type and reduce operator come from the
// channel's signature. Steps and bytes on the wire for each are written down
// in docs/algorithms.md, and narrated above each implementation.
#pragma once

#include <cstddef>
#include <vector>

#include "algorithms/channel.h"
#include "algorithms/topology.h"
#include "common/cost_model.h"

namespace clawcomm {

// All-reduce of `count` elements in place. AVG is left as a SUM; the caller
// divides.
void ringAllReduce(Channel& ch, void* buf, size_t count);
void treeAllReduce(Channel& ch, void* buf, size_t count);
// The mesh (mesh_all_reduce.cc): every rank sends its input to every peer
// and folds all n in rank order (one-shot, any layout); or the direct
// reduce-scatter, then the direct all-gather (two-shot, one host).
void oneShotAllReduce(Channel& ch, void* buf, size_t count);
void twoShotAllReduce(Channel& ch, void* buf, size_t count);
// Shared memory inside each host, the network across them
// (hierarchical_all_reduce.cc); the ring where the channel's topology is
// not two or more hosts with the same number (two or more) of ranks each.
void hierarchicalAllReduce(Channel& ch, void* buf, size_t count);
// The hierarchical all-reduce cuts buffers into pieces of about this size
// (at most kHierarchicalMaxPieces) to overlap its phases.
constexpr size_t kHierarchicalPieceBytes = size_t(4) << 20;
constexpr size_t kHierarchicalMaxPieces = 16;
size_t hierarchicalPieces(size_t bytes);
// The hierarchical all-reduce's algorithm across hosts for a shard of
// `shardBytes`: `hosts` ranks, one per host, whose links each carry
// `streams` such all-reduces at once.
Algorithm crossHostAlgorithm(size_t shardBytes, int hosts, int streams, const CostModel& model);
// All-reduce (sum) of float32 `buf` with 16-bit values on the wire: the
// channel's dtype (kFloat16 or kBFloat16) is the wire format. Every rank's
// input is first multiplied by `prescale` and the result by `postscale`
// (1 leaves them alone), each inside the conversion kernels.
void ringAllReduce16BitWire(Channel& ch, float* buf, size_t count, float prescale, float postscale);
// Its reduce-scatter phase alone: rank r gets chunk r (evenCounts) in `out`;
// `buf` is overwritten with partial sums.
void ringReduceScatter16BitWire(Channel& ch, float* buf, size_t count, float prescale,
                                float postscale, float* out);

// In place over a buffer that holds one chunk per rank, back to back, of
// counts[r] elements: afterwards chunk `rank` holds the reduction of every
// rank's chunk `rank` (the other chunks hold partial sums).
void ringReduceScatter(Channel& ch, void* buf, const std::vector<size_t>& counts);

// In place over the same layout: chunk `rank` is this rank's input;
// afterwards every chunk holds its owner's input.
void ringAllGather(Channel& ch, void* buf, const std::vector<size_t>& counts);

// The same over hosts (hierarchical_gather_scatter.cc): inside each host
// over shared memory, across hosts among the ranks of one local index.
// Need topology().hierarchical() and the whole group's channel.
void hierarchicalReduceScatter(Channel& ch, void* buf, const std::vector<size_t>& counts);
void hierarchicalAllGather(Channel& ch, void* buf, const std::vector<size_t>& counts);
// The same for a group on one host, in one step from the caller's buffers
// (direct_gather_scatter.cc): rank r's reduced chunk lands in `out`, the
// gathered chunks in `out` at their offsets; `in` is only read. `in` may be
// `out`'s own chunk for the all-gather.
void directReduceScatter(Channel& ch, const void* in, void* out, const std::vector<size_t>& counts);
void directAllGather(Channel& ch, const void* in, void* out, const std::vector<size_t>& counts);
// Direct algorithms run on one host of at most this many ranks (beyond,
// CLAWCOMM_SHM_PEERS may leave pairs on TCP): directLayout.
constexpr int kDirectMaxRanks = 16;
bool directLayout(const Topology& topo);

void binomialBroadcast(Channel& ch, void* buf, size_t bytes, int root);
// The root sends to every peer at once; on one host, by single copy from
// the single-copy size up (direct_broadcast.cc).
void directBroadcast(Channel& ch, void* buf, size_t bytes, int root);

// Reduces into `buf` on `root`. `buf` is the accumulator of every rank with
// children in the tree, so such non-roots pass a scratch copy of their
// input; a leaf only sends it.
void binomialReduce(Channel& ch, void* buf, size_t count, int root);

// Rank r's `bytes` from `in` land at out + r * bytes on `root`.
void linearGather(Channel& ch, const void* in, void* out, size_t bytes, int root);
// Rank r receives in + r * bytes from `root` into `out`.
void linearScatter(Channel& ch, const void* in, void* out, size_t bytes, int root);

// Uneven all-to-all: sendBytes[p] bytes (at the running offset in `in`) go to
// rank p, recvBytes[p] bytes from rank p land at the running offset in `out`.
void pairwiseAllToAll(Channel& ch, const void* in, const std::vector<size_t>& sendBytes, void* out,
                      const std::vector<size_t>& recvBytes);
// The same in two stages over hosts (hierarchical_all_to_all.cc): a
// shuffle inside each host over shared memory, then one message from each
// rank to the rank of the same local index on every other host. Pairwise
// where the channel's topology is not hierarchical().
void hierarchicalAllToAll(Channel& ch, const void* in, const std::vector<size_t>& sendBytes,
                          void* out, const std::vector<size_t>& recvBytes);

void disseminationBarrier(Channel& ch);

// The deterministic reductions (deterministic.cc, CLAWCOMM_DETERMINISTIC):
// each chunk's owner adds every rank's chunk in one fixed binary tree over
// the ranks, on any layout and transport. The reduce-scatter: rank r's
// reduced chunk (counts[r] elements) lands in `out`, which may be its own
// chunk of `in`; `in` is otherwise only read. The all-reduce: in place, AVG
// left as a SUM. The reduce: into `buf` on `root`; non-roots' `buf` is only
// read.
void deterministicReduceScatter(Channel& ch, const void* in, void* out,
                                const std::vector<size_t>& counts);
void deterministicAllReduce(Channel& ch, void* buf, size_t count);
void deterministicReduce(Channel& ch, void* buf, size_t count, int root);

// Broadcast and reduce with the message split among the ranks
// (split_broadcast_reduce.cc): the root scatters, then the layout's
// all-gather; the layout's reduce-scatter, then the root gathers (non-roots'
// `buf` is left as it was). `count` elements of the channel's dtype.
void scatterAllGatherBroadcast(Channel& ch, void* buf, size_t count, int root);
void reduceScatterGatherReduce(Channel& ch, void* buf, size_t count, int root);

// One algorithm of one collective: a row of the table in selection.cc, by
// the name CLAWCOMM_ALGO and the flight record give it.
struct CollectiveAlgorithm {
  OpType op;
  Algorithm id;
  const char* name;
};
// Every collective algorithm CLAWCOMM_ALGO can name (all-reduce,
// reduce-scatter, all-gather, broadcast, reduce and all-to-all have a
// choice).
const std::vector<CollectiveAlgorithm>& collectiveAlgorithms();

// The cost model's prediction, in seconds, for `op` by `algo` over `topo`
// (docs/algorithms.md); `bytes`: the whole buffer (all-reduce, broadcast,
// reduce: the message; reduce-scatter: the input; all-gather: the output;
// all-to-all: what each rank sends, bytes/n to each rank).
// Infinite where the algorithm cannot run on the layout.
double collectiveCost(OpType op, Algorithm algo, double bytes, const Topology& topo,
                      const CostModel& model);

// The cost model's prediction, in seconds, for any collective as it runs:
// collectiveCost's where `algo` has a formula there; the 16-bit-wire ring
// as the ring on its 2-byte elements; a deterministic reduction as the
// layout's reduce-scatter, then its all-gather (all-reduce) or a gather at
// the root (reduce); gather and scatter as the root exchanging each piece
// in turn; the barrier as ceil(log2 n) empty messages. `bytes` as for
// collectiveCost (gather and scatter: all the pieces).
double operationCost(OpType op, Algorithm algo, double bytes, const Topology& topo,
                     const CostModel& model);
// One message of `bytes` from rank `from` to rank `to`.
double pointToPointCost(int from, int to, double bytes, const Topology& topo,
                        const CostModel& model);

// `op`'s algorithm for `bytes` over `topo`: under CLAWCOMM_DETERMINISTIC=1
// the deterministic one for a reduction (all-reduce, reduce-scatter,
// reduce), whatever CLAWCOMM_ALGO says; else the one CLAWCOMM_ALGO names for
// it (an item "op:name", or a bare name that is one of op's algorithms;
// one the layout cannot run gives the ring, or the all-to-all's pairwise
// one), else the cheapest by the cost model; kDefault for an op without a
// choice. The all-to-all's does not depend on `bytes`, which differ from
// rank to rank with uneven splits: it is the layout's (selection.cc).
Algorithm chooseAlgorithm(OpType op, size_t bytes, const Topology& topo, const Settings& settings);

// One all-reduce algorithm: a row of the table in selection.cc.
struct AllReduceAlgorithm {
  Algorithm id;
  const char* name;  // what CLAWCOMM_ALGO and all_reduce_algorithm() say
  void (*run)(Channel& ch, void* buf, size_t count);
};

// Every all-reduce algorithm CLAWCOMM_ALGO can name, and one by its id.
const std::vector<AllReduceAlgorithm>& allReduceAlgorithms();
const AllReduceAlgorithm& allReduceById(Algorithm id);

// The cost model's prediction, in seconds, for an all-reduce of `bytes` per
// rank over `topo` (docs/algorithms.md derives each formula; the
// hierarchical one is infinite where it does not apply).
double allReduceCost(Algorithm algo, double bytes, const Topology& topo, const CostModel& model);

// The all-reduce of `bytes` over `topo`: the deterministic one under
// CLAWCOMM_DETERMINISTIC=1, else CLAWCOMM_ALGO's, or with auto the
// one the cost model predicts fastest (CLAWCOMM_TREE_MAX_BYTES overrides the
// model with a fixed crossover between tree and ring).
const AllReduceAlgorithm& chooseAllReduce(size_t bytes, const Topology& topo,
                                          const Settings& settings);

// Checks a CLAWCOMM_ALGO value: "auto", or a comma-separated list of
// algorithm names and op:name items (InvalidArgument naming the choices).
void checkAlgorithmSetting(const std::string& value);

}  // namespace clawcomm
