// ClawcommBackend's collectives (backend.h): checks, layout, one engine
// operation each, or the CUDA IPC path where it applies.
#include "torch/backend.h"

namespace clawcomm {
namespace adapter {

c10::intrusive_ptr<c10d::Work> ClawcommBackend::allreduce(TensorList& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  const auto blocking = blockingIf(opts);
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduceSparse(tensors[0], opts);
  }
  const DataType dt = checkTensors(op, tensors);
  const at::Tensor& t = single(op, tensors);
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  if (auto work = device_->allReduce(t, dt, redop, isAsync(opts))) return track(work);
  at::Tensor buf = asBuffer(t);
  return launch(OpType::ALLREDUCE, {t}, {updates(buf)}, copyBack(buf, t), [&](auto cb) {
    return comm_->allReduce(buf.data_ptr(), size_t(buf.numel()), dt, redop, cb);
  });
}

// A sparse COO tensor, summed as gloo does: every rank's (index, value)
// pairs are gathered, in rank order, and coalesced (duplicates added), so
// every rank gets the same tensor. Two small all-gathers run first, on this
// thread (each rank's pair count and shape, then the indices); the values'
// all-gather is the Work, and the sum replaces `t` when it completes.
c10::intrusive_ptr<c10d::Work> ClawcommBackend::allreduceSparse(
    at::Tensor& t, const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  TORCH_CHECK_VALUE(t.device().is_cpu(), "clawcomm::allreduce: sparse tensors are summed on the ",
                    "cpu only, got one on ", t.device());
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  TORCH_CHECK_VALUE(redop == ReduceOp::kSum, "clawcomm::allreduce: sparse tensors are summed ",
                    "only (ReduceOp.SUM), got ", reduceOpName(redop));
  const DataType dt = toDataType(op, t.scalar_type());
  const at::Tensor in = t.coalesce();
  const int64_t n = getSize(), sparseDim = in.sparse_dim(), nnz = in._nnz();
  int64_t perValue = 1;
  for (int64_t d = sparseDim; d < in.dim(); ++d) perValue *= in.size(d);
  if (comm_->estimating()) {
    // Priced as the values' all-gather, as if every rank had as many pairs:
    // the other ranks' counts are not exchanged while nothing moves.
    const std::vector<size_t> counts(size_t(n), size_t(nnz * perValue));
    return launch(OpType::ALLREDUCE, {t}, {}, nullptr,
                  [&](auto cb) { return comm_->allGather(nullptr, nullptr, counts, dt, cb); });
  }

  // 1. Pair counts, and the shape, which must be the same everywhere.
  at::Tensor meta = at::empty({2 + in.dim()}, at::kLong);
  meta[0] = nnz;
  meta[1] = sparseDim;
  for (int64_t d = 0; d < in.dim(); ++d) meta[2 + d] = in.size(d);
  at::Tensor metas = at::empty({n, meta.numel()}, at::kLong);
  blockOn(comm_->allGather(meta.data_ptr(), metas.data_ptr(),
                           std::vector<size_t>(size_t(n), size_t(meta.numel())), DataType::kInt64,
                           nullptr));
  std::vector<size_t> indexCounts, valueCounts;
  int64_t total = 0;
  const auto shapeOf = [&](int64_t r) {  // [sparse dims, sizes...] of rank r
    return c10::IntArrayRef(metas.data_ptr<int64_t>() + r * meta.numel() + 1, 1 + in.dim());
  };
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_VALUE(shapeOf(r) == shapeOf(getRank()), "clawcomm::allreduce: rank ", r,
                      " passed a sparse tensor of [sparse dims, sizes...] ", shapeOf(r), ", rank ",
                      getRank(), " ", shapeOf(getRank()));
    const int64_t theirs = metas[r][0].item<int64_t>();
    indexCounts.push_back(size_t(theirs * sparseDim));
    valueCounts.push_back(size_t(theirs * perValue));
    total += theirs;
  }

  // 2. Indices, as [pairs, sparse dims] rows.
  at::Tensor indices = in.indices().t().contiguous();
  at::Tensor allIndices = at::empty({total, sparseDim}, at::kLong);
  blockOn(comm_->allGather(indices.data_ptr(), allIndices.data_ptr(), indexCounts, DataType::kInt64,
                           nullptr));

  // 3. Values, then the sum.
  std::vector<int64_t> valueShape = {total};
  for (int64_t d = sparseDim; d < in.dim(); ++d) valueShape.push_back(in.size(d));
  at::Tensor values = in.values().contiguous();
  at::Tensor allValues = at::empty(valueShape, values.options());
  at::Tensor out = t;
  return launch(
      OpType::ALLREDUCE, {t}, {reads(values), writes(allValues)},
      [out, allIndices, allValues]() mutable {
        // Indices from peers are checked against the sizes before use: an
        // index out of range would otherwise be a write out of bounds.
        at::_validate_sparse_coo_tensor_args(allIndices.t(), allValues, out.sizes());
        out.copy_(at::sparse_coo_tensor(allIndices.t(), allValues, out.sizes()).coalesce());
      },
      [&](auto cb) {
        return comm_->allGather(values.data_ptr(), allValues.data_ptr(), valueCounts, dt, cb);
      });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::allreduce_coalesced(
    TensorList& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "allreduce_coalesced";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, tensors);
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  at::Tensor buf = concat(tensors);
  TensorList outs = tensors;
  return launch(
      OpType::ALLREDUCE_COALESCED, outs, {updates(buf)}, [buf, outs] { splitInto(buf, outs); },
      [&](auto cb) {
        return comm_->allReduce(buf.data_ptr(), size_t(buf.numel()), dt, redop, cb);
      });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::reduce(TensorList& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, tensors);
  const at::Tensor& t = single(op, tensors);
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  const int root = rootOf(op, opts.rootRank);
  at::Tensor buf = asBuffer(t);
  return launch(OpType::REDUCE, {t}, {updates(buf)}, copyBack(buf, t), [&](auto cb) {
    return comm_->reduce(buf.data_ptr(), size_t(buf.numel()), dt, redop, root, cb);
  });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::broadcast(TensorList& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, tensors);
  const at::Tensor& t = single(op, tensors);
  const int root = rootOf(op, opts.rootRank);
  if (auto work = device_->broadcast(t, dt, root, isAsync(opts))) return track(work);
  at::Tensor buf = asBuffer(t);
  return launch(OpType::BROADCAST, {t}, {updates(buf)}, copyBack(buf, t), [&](auto cb) {
    return comm_->broadcast(buf.data_ptr(), size_t(buf.numel()), dt, root, cb);
  });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::allgather(std::vector<TensorList>& outputs,
                                                          TensorList& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const char* op = "allgather";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, inputs);
  const at::Tensor& in = single(op, inputs);
  TORCH_CHECK_VALUE(outputs.size() == 1, "clawcomm::allgather: expects one output list, got ",
                    outputs.size());
  TensorList outs = outputs[0];
  TORCH_CHECK_VALUE(int(outs.size()) == getSize(), "clawcomm::allgather: output list has ",
                    outs.size(), " tensors for a group of ", getSize(), " ranks");
  checkTensors(op, outs);
  checkSameDtype(op, in, outs[0]);
  checkNumel(op, "this rank's output slot", outs[getRank()].numel(), in.numel());
  const std::vector<size_t> counts = numels(outs);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  at::Tensor src = asBuffer(in);
  at::Tensor buf = at::empty({total}, in.options());
  return launch(
      OpType::ALLGATHER, outs, {reads(src), writes(buf)}, [buf, outs] { splitInto(buf, outs); },
      [&](auto cb) { return comm_->allGather(src.data_ptr(), buf.data_ptr(), counts, dt, cb); });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, {input, output});
  checkNumel(op, "the output", output.numel(), input.numel() * getSize());
  if (auto work = device_->allGather(output, input, dt, isAsync(opts))) return track(work);
  at::Tensor src = asBuffer(input);
  at::Tensor buf = asBuffer(output);
  std::vector<size_t> counts(static_cast<size_t>(getSize()), static_cast<size_t>(input.numel()));
  return launch(
      OpType::_ALLGATHER_BASE, {output}, {reads(src), writes(buf)}, copyBack(buf, output),
      [&](auto cb) { return comm_->allGather(src.data_ptr(), buf.data_ptr(), counts, dt, cb); });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::allgather_into_tensor_coalesced(
    TensorList& outputs, TensorList& inputs, const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_into_tensor_coalesced";
  const auto blocking = blockingIf(opts);
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "clawcomm::", op, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  TensorList all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  const DataType dt = checkTensors(op, all);
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkNumel(op, "an output", outputs[i].numel(), inputs[i].numel() * getSize());
  }
  // One all-gather of the concatenated inputs: rank-major [r0: in0 in1 ..][r1: ..].
  at::Tensor src = concat(inputs);
  at::Tensor buf = at::empty({src.numel() * getSize()}, src.options());
  std::vector<size_t> counts(static_cast<size_t>(getSize()), static_cast<size_t>(src.numel()));
  const int n = getSize();
  TensorList outs = outputs;
  auto finalize = [buf, outs, inputs, n] {
    const int64_t per = buf.numel() / n;
    for (int r = 0; r < n; ++r) {
      int64_t offset = 0;
      for (size_t i = 0; i < outs.size(); ++i) {
        const int64_t m = inputs[i].numel();
        outs[i].view({-1}).narrow(0, r * m, m).copy_(buf.narrow(0, r * per + offset, m));
        offset += m;
      }
    }
  };
  return launch(OpType::COALESCED, outs, {reads(src), writes(buf)}, finalize, [&](auto cb) {
    return comm_->allGather(src.data_ptr(), buf.data_ptr(), counts, dt, cb);
  });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::allgather_coalesced(
    std::vector<TensorList>& outputLists, TensorList& inputs, const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_coalesced";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, inputs);
  // outputLists[r][i] receives rank r's inputs[i].
  TORCH_CHECK_VALUE(int(outputLists.size()) == getSize(), "clawcomm::", op, ": ",
                    outputLists.size(), " output lists for a group of ", getSize(), " ranks");
  for (int r = 0; r < getSize(); ++r) {
    TORCH_CHECK_VALUE(outputLists[r].size() == inputs.size(), "clawcomm::", op, ": output list ", r,
                      " has ", outputLists[r].size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkNumel(op, "an output", outputLists[r][i].numel(), inputs[i].numel());
    }
  }
  at::Tensor src = concat(inputs);
  at::Tensor buf = at::empty({src.numel() * getSize()}, src.options());
  std::vector<size_t> counts(static_cast<size_t>(getSize()), static_cast<size_t>(src.numel()));
  TensorList flatOuts;  // rank-major, matching the gathered layout
  for (auto& list : outputLists) flatOuts.insert(flatOuts.end(), list.begin(), list.end());
  return launch(
      OpType::ALLGATHER_COALESCED, flatOuts, {reads(src), writes(buf)},
      [buf, flatOuts] { splitInto(buf, flatOuts); },
      [&](auto cb) { return comm_->allGather(src.data_ptr(), buf.data_ptr(), counts, dt, cb); });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<TensorList>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, outputs);
  const at::Tensor& out = single(op, outputs);
  TORCH_CHECK_VALUE(inputs.size() == 1, "clawcomm::", op, ": expects one input list, got ",
                    inputs.size());
  TORCH_CHECK_VALUE(int(inputs[0].size()) == getSize(), "clawcomm::", op, ": input list has ",
                    inputs[0].size(), " tensors for a group of ", getSize(), " ranks");
  checkTensors(op, inputs[0]);
  checkSameDtype(op, inputs[0][0], out);
  checkNumel(op, "the output", out.numel(), inputs[0][getRank()].numel());
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  at::Tensor src = concat(inputs[0]);
  at::Tensor buf = asBuffer(out);
  const std::vector<size_t> counts = numels(inputs[0]);
  return launch(
      OpType::REDUCE_SCATTER, {out}, {reads(src), writes(buf)}, copyBack(buf, out), [&](auto cb) {
        return comm_->reduceScatter(src.data_ptr(), buf.data_ptr(), counts, dt, redop, cb);
      });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, {input, output});
  checkNumel(op, "the input", input.numel(), output.numel() * getSize());
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  if (auto work = device_->reduceScatter(output, input, dt, redop, isAsync(opts)))
    return track(work);
  at::Tensor src = asBuffer(input);
  at::Tensor buf = asBuffer(output);
  std::vector<size_t> counts(static_cast<size_t>(getSize()), static_cast<size_t>(output.numel()));
  return launch(OpType::_REDUCE_SCATTER_BASE, {output}, {reads(src), writes(buf)},
                copyBack(buf, output), [&](auto cb) {
                  return comm_->reduceScatter(src.data_ptr(), buf.data_ptr(), counts, dt, redop,
                                              cb);
                });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::reduce_scatter_tensor_coalesced(
    TensorList& outputs, TensorList& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  const auto blocking = blockingIf(opts);
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "clawcomm::", op, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  TensorList all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  const DataType dt = checkTensors(op, all);
  const ReduceOp redop = toReduceOp(op, opts.reduceOp);
  const int n = getSize();
  // Rank-major input: chunk r is every input's r-th slice, back to back.
  TensorList pieces;
  int64_t perRank = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkNumel(op, "an input", inputs[i].numel(), outputs[i].numel() * n);
    perRank += outputs[i].numel();
  }
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t m = outputs[i].numel();
      pieces.push_back(inputs[i].reshape({-1}).narrow(0, r * m, m));
    }
  }
  at::Tensor src = pieces.empty() ? at::empty({0}) : at::cat(pieces);
  at::Tensor buf = at::empty({perRank}, src.options());
  std::vector<size_t> counts(static_cast<size_t>(n), static_cast<size_t>(perRank));
  TensorList outs = outputs;
  return launch(
      OpType::COALESCED, outs, {reads(src), writes(buf)}, [buf, outs] { splitInto(buf, outs); },
      [&](auto cb) {
        return comm_->reduceScatter(src.data_ptr(), buf.data_ptr(), counts, dt, redop, cb);
      });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplits,
                                                              std::vector<int64_t>& inputSplits,
                                                              const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall_base";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, {input, output});
  const int n = getSize();
  auto countsOf = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    std::vector<size_t> counts(static_cast<size_t>(n));
    if (splits.empty()) {
      TORCH_CHECK_VALUE(rows % n == 0, "clawcomm::", op, ": ", what, " has ", rows,
                        " rows, not divisible by the group size ", n,
                        "; pass split sizes for uneven splits");
      for (auto& c : counts) c = size_t(rows / n * rowElems);
    } else {
      TORCH_CHECK_VALUE(int(splits.size()) == n, "clawcomm::", op, ": ", what, " split sizes have ",
                        splits.size(), " entries for a group of ", n, " ranks");
      int64_t sum = 0;
      for (int p = 0; p < n; ++p) {
        TORCH_CHECK_VALUE(splits[p] >= 0, "clawcomm::", op, ": negative split size ", splits[p],
                          " for rank ", p);
        sum += splits[p];
        counts[p] = size_t(splits[p] * rowElems);
      }
      TORCH_CHECK_VALUE(sum == rows, "clawcomm::", op, ": ", what, " split sizes add up to ", sum,
                        " rows but the tensor has ", rows);
    }
    return counts;
  };
  const auto sendCounts = countsOf(input, inputSplits, "the input");
  const auto recvCounts = countsOf(output, outputSplits, "the output");
  // CUDA IPC takes even splits (passed as none on every rank); split
  // sizes are staged.
  if (inputSplits.empty() && outputSplits.empty()) {
    if (auto work = device_->allToAll(output, input, dt, isAsync(opts))) return track(work);
  }
  at::Tensor src = asBuffer(input);
  at::Tensor buf = asBuffer(output);
  return launch(OpType::ALLTOALL_BASE, {output}, {reads(src), writes(buf)}, copyBack(buf, output),
                [&](auto cb) {
                  return comm_->allToAll(src.data_ptr(), sendCounts, buf.data_ptr(), recvCounts, dt,
                                         cb);
                });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::alltoall(TensorList& outputs, TensorList& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall";
  const auto blocking = blockingIf(opts);
  TORCH_CHECK_VALUE(int(outputs.size()) == getSize() && int(inputs.size()) == getSize(),
                    "clawcomm::", op, ": expects ", getSize(), " inputs and outputs, got ",
                    inputs.size(), " and ", outputs.size());
  TensorList all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  const DataType dt = checkTensors(op, all);
  at::Tensor src = concat(inputs);
  const auto recvCounts = numels(outputs);
  at::Tensor buf = at::empty(
      {int64_t(std::accumulate(recvCounts.begin(), recvCounts.end(), size_t(0)))}, src.options());
  const auto sendCounts = numels(inputs);
  TensorList outs = outputs;
  return launch(
      OpType::ALLTOALL, outs, {reads(src), writes(buf)}, [buf, outs] { splitInto(buf, outs); },
      [&](auto cb) {
        return comm_->allToAll(src.data_ptr(), sendCounts, buf.data_ptr(), recvCounts, dt, cb);
      });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::gather(std::vector<TensorList>& outputs,
                                                       TensorList& inputs,
                                                       const c10d::GatherOptions& opts) {
  const char* op = "gather";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, inputs);
  const at::Tensor& in = single(op, inputs);
  const int root = rootOf(op, opts.rootRank);
  at::Tensor src = asBuffer(in);
  TensorList outs;
  at::Tensor buf;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && int(outputs[0].size()) == getSize(),
                      "clawcomm::gather: the root needs one output list of ", getSize(),
                      " tensors");
    outs = outputs[0];
    checkTensors(op, outs);
    for (const auto& o : outs) checkNumel(op, "an output", o.numel(), in.numel());
    checkSameDtype(op, in, outs[0]);
    buf = at::empty({in.numel() * getSize()}, in.options());
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                      "clawcomm::gather: only the root (rank ", root, ") takes output tensors");
    buf = at::empty({0}, in.options());
  }
  return launch(
      OpType::GATHER, outs, {reads(src), writes(buf)}, [buf, outs] { splitInto(buf, outs); },
      [&](auto cb) {
        return comm_->gather(src.data_ptr(), buf.data_ptr(), size_t(in.numel()), dt, root, cb);
      });
}

c10::intrusive_ptr<c10d::Work> ClawcommBackend::scatter(TensorList& outputs,
                                                        std::vector<TensorList>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  const auto blocking = blockingIf(opts);
  const DataType dt = checkTensors(op, outputs);
  const at::Tensor& out = single(op, outputs);
  const int root = rootOf(op, opts.rootRank);
  at::Tensor src;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && int(inputs[0].size()) == getSize(),
                      "clawcomm::scatter: the root needs one input list of ", getSize(),
                      " tensors");
    checkTensors(op, inputs[0]);
    for (const auto& i : inputs[0]) checkNumel(op, "an input", i.numel(), out.numel());
    checkSameDtype(op, inputs[0][0], out);
    src = concat(inputs[0]);
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                      "clawcomm::scatter: only the root (rank ", root, ") takes input tensors");
    src = at::empty({0}, out.options());
  }
  at::Tensor buf = asBuffer(out);
  return launch(
      OpType::SCATTER, {out}, {reads(src), writes(buf)}, copyBack(buf, out), [&](auto cb) {
        return comm_->scatter(src.data_ptr(), buf.data_ptr(), size_t(out.numel()), dt, root, cb);
      });
}

}  // namespace adapter
}  // namespace clawcomm
