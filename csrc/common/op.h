// What every rank must agree on for one operation.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace clawcomm {

enum class OpType : uint8_t {
  kAllReduce = 0,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
  kCount,  // not an op: how many there are (a new op goes above)
};
constexpr int kNumOpTypes = int(OpType::kCount);

const char* opTypeName(OpType t);

// Which algorithm moves an operation's bytes. Every frame carries it, so
// ranks that chose differently fail with a clear error instead of mixing
// two algorithms' messages. The all-reduce algorithms and their cost model
// are a table in algorithms/selection.cc.
enum class Algorithm : uint8_t {
  kDefault = 0,               // the op's only algorithm
  kRing = 1,                  // ring all-reduce (reduce-scatter + all-gather)
  kTree = 2,                  // recursive doubling
  kRing16BitWire = 3,         // ring all-reduce of float32 with a 16-bit wire
  kHierarchical = 4,          // shared memory inside hosts, the network across
  kIpcOneShot = 5,            // device memory through IPC: every rank reduces every input
  kIpcTwoShot = 6,            // device memory through IPC: reduce-scatter + all-gather
  kIpc = 7,                   // device memory through IPC, the op's only algorithm there
  kDirect = 8,                // one host: every rank exchanges with every peer in one step
  kScatterAllGather = 9,      // broadcast: scatter from the root, then all-gather
  kReduceScatterGather = 10,  // reduce: reduce-scatter, then gather at the root
  kOneShot = 11,              // all-reduce: every rank sends to every peer, folds all inputs
  kTwoShot = 12,              // all-reduce: direct reduce-scatter, then direct all-gather
  kPairwise = 13,             // all-to-all: every rank exchanges with every peer at once
  kDeterministic = 14,        // reductions: every chunk's owner adds all inputs in one tree
};

const char* algorithmName(Algorithm a);

// "clawcomm::all_reduce: ", the start of every error an operation raises.
std::string opPrefix(OpType t);
// Argument checks every front end shares (the communicator's operations, the
// device collectives): InvalidArgument naming the op and the value.
void checkDataType(OpType op, DataType dtype);
void checkReduceOp(OpType op, DataType dtype, ReduceOp redop);

// The signature a collective carries in every frame header; the receiver
// compares it with its own and fails both ranks on any difference.
struct OpSignature {
  OpType type = OpType::kBarrier;
  DataType dtype = DataType::kUInt8;
  ReduceOp redop = ReduceOp::kSum;
  int32_t root = -1;   // -1 for unrooted ops
  uint64_t count = 0;  // elements all ranks must agree on (0: not compared)
  uint64_t seq = 0;    // collective sequence number in this communicator
  Algorithm algo = Algorithm::kDefault;

  bool sameAs(const OpSignature& o) const {
    return type == o.type && dtype == o.dtype && redop == o.redop && root == o.root &&
           count == o.count && seq == o.seq && algo == o.algo;
  }
  // "all_reduce #5 of 4096 float32 elements (sum)"
  std::string describe() const;
};

}  // namespace clawcomm
