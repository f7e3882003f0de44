#include "common/op.h"

#include "common/errors.h"

namespace clawcomm {

const char* opTypeName(OpType t) {
  switch (t) {
    case OpType::kAllReduce: return "all_reduce";
    case OpType::kReduceScatter: return "reduce_scatter";
    case OpType::kAllGather: return "all_gather";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kReduce: return "reduce";
    case OpType::kGather: return "gather";
    case OpType::kScatter: return "scatter";
    case OpType::kAllToAll: return "all_to_all";
    case OpType::kBarrier: return "barrier";
    case OpType::kSend: return "send";
    case OpType::kRecv: return "recv";
    case OpType::kCount: break;
  }
  return "unknown-op";
}

const char* algorithmName(Algorithm a) {
  switch (a) {
    case Algorithm::kDefault: return "default";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kRing16BitWire: return "ring with a 16-bit wire";
    case Algorithm::kHierarchical: return "hierarchical";
    case Algorithm::kIpcOneShot: return "CUDA IPC one-shot";
    case Algorithm::kIpcTwoShot: return "CUDA IPC two-shot";
    case Algorithm::kIpc: return "CUDA IPC";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kScatterAllGather: return "scatter_allgather";
    case Algorithm::kReduceScatterGather: return "reducescatter_gather";
    case Algorithm::kOneShot: return "oneshot";
    case Algorithm::kTwoShot: return "twoshot";
    case Algorithm::kPairwise: return "pairwise";
    case Algorithm::kDeterministic: return "deterministic";
  }
  return "unknown-algorithm";
}

std::string opPrefix(OpType t) {
  return CLAWCOMM_CONCAT("clawcomm::", opTypeName(t), ": ");
}

void checkDataType(OpType op, DataType dtype) {
  CLAWCOMM_ARG_CHECK(dtype < DataType::kNumTypes, opPrefix(op), "unsupported dtype code ",
                     int(dtype));
}

void checkReduceOp(OpType op, DataType dtype, ReduceOp redop) {
  checkDataType(op, dtype);
  CLAWCOMM_ARG_CHECK(reduceOpSupported(dtype, redop), opPrefix(op), "reduce op ",
                     reduceOpName(redop), " is not defined on ", dataTypeName(dtype),
                     redop == ReduceOp::kAvg ? " (avg needs a floating point dtype)"
                                             : " (bitwise ops need an integer or bool dtype)");
}

std::string OpSignature::describe() const {
  std::string s = CLAWCOMM_CONCAT(opTypeName(type), " #", seq);
  if (type != OpType::kBarrier && type != OpType::kAllToAll) {
    s += CLAWCOMM_CONCAT(" of ", count, " ", dataTypeName(dtype), " elements");
  } else if (type == OpType::kAllToAll) {
    s += CLAWCOMM_CONCAT(" of ", dataTypeName(dtype));
  }
  const bool reducing =
      type == OpType::kAllReduce || type == OpType::kReduceScatter || type == OpType::kReduce;
  if (reducing) s += CLAWCOMM_CONCAT(" (", reduceOpName(redop), ")");
  if (root >= 0) s += CLAWCOMM_CONCAT(" (root ", root, ")");
  if (algo != Algorithm::kDefault)
    s += CLAWCOMM_CONCAT(" with the ", algorithmName(algo), " algorithm");
  return s;
}

}  // namespace clawcomm
