"""Layers split over a tensor-parallel group (Megatron-LM's, with sequence
parallelism and overlap). How each parameter is split is recorded as
``clawcomm.parallel.split.Split``.

- ``ColumnParallelLinear``: this rank holds some output rows of the weight
  (``Split``); its input is whole (replicated, or gathered from the
  sequence-parallel slices), its output is this rank's columns.
- ``RowParallelLinear``: this rank holds the matching input columns; its
  output is a partial sum, summed over the group (all-reduce, or
  reduce-scatter into sequence slices); the bias is whole and added after.
- ``VocabParallelEmbedding``: this rank holds a block of the vocabulary;
  tokens outside it look up zeros, and the sum over the group is the
  lookup.
- ``vocab_parallel_cross_entropy``: the loss over logits split by
  vocabulary, without gathering them: the max, the target's logit and the
  sum of exponentials are each reduced over the group (one all-reduce for
  the max, one for the other two).

Each linear layer's backward defers its weight gradient inside
``clawcomm.pipeline.weight_grad.deferring`` (the zero-bubble schedules' W
pass), as the trainer's split ``nn.Linear`` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clawcomm.parallel.split import Split, block_of, split_parameter
from clawcomm.parallel.tensor import comm
from clawcomm.pipeline.weight_grad import current_store, defer_weight_grad, notify_grad


def _weight_grad(weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor):
    """``g^T x`` over all tokens: returned now, or (inside ``deferring``)
    added to weight.grad in the W pass, and None returned."""
    g2 = g.reshape(-1, g.shape[-1])
    x2 = x.detach().reshape(-1, x.shape[-1])
    if current_store() is None:
        return g2.t().mm(x2)

    def weight_pass():
        if weight.grad is None:
            weight.grad = g2.t().mm(x2)
        else:
            weight.grad.addmm_(g2.t(), x2)
        notify_grad(weight)

    defer_weight_grad(weight_pass)
    return None


def _block(t: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """Rank d's block of the tokens (dim 1) of ``t``, split n ways."""
    per = t.shape[1] // n
    return t[:, d * per : (d + 1) * per]


class _ColumnLinear(torch.autograd.Function):
    """y = x W^T: x whole (SP: gathered first), y this rank's columns. With
    sequence parallelism only this rank's slice of x is kept for backward,
    which gathers it again (as Megatron-LM does): activations stay at 1/tp,
    for one more all-gather, issued before the input gradient's product and
    reduce-scatter so that it runs behind them."""

    @staticmethod
    def forward(ctx, x, weight, tp):
        ctx.tp, ctx.weight = tp, weight
        if not tp.sequence_parallel:
            y = x.matmul(weight.t())
        elif tp.overlap:
            _, y = comm.gather_apply(x, lambda blk: blk.matmul(weight.t()), tp.group, keep=False)
        else:
            y = comm.all_gather_tokens(x, tp.group).matmul(weight.t())
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        tp, w = ctx.tp, ctx.weight
        need_w = ctx.needs_input_grad[1]
        if not ctx.needs_input_grad[0]:  # the model's input (every TP rank alike): no exchange
            x_all = comm.all_gather_tokens(x, tp.group) if tp.sequence_parallel and need_w else x
            gx = None
        elif not tp.sequence_parallel:
            x_all, gx = x, comm.all_reduce(g.matmul(w), tp.group)
        else:
            gathering = comm.start_all_gather_tokens(x, tp.group) if need_w else None
            if tp.overlap:
                n = tp.size
                gx = comm.apply_scatter(lambda d: _block(g, d, n).matmul(w), tp.group)
            else:
                gx = comm.reduce_scatter_tokens(g.matmul(w), tp.group)
            x_all = gathering() if need_w else None
        gw = _weight_grad(w, g, x_all) if need_w else None
        return gx, gw, None


class _RowLinear(torch.autograd.Function):
    """y = sum over ranks of x W^T: x this rank's columns, y whole (SP: this
    rank's slice of the tokens)."""

    @staticmethod
    def forward(ctx, x, weight, tp):
        ctx.tp, ctx.weight = tp, weight
        ctx.save_for_backward(x)
        if not tp.sequence_parallel:
            return comm.all_reduce(x.matmul(weight.t()), tp.group)
        if tp.overlap:
            n = tp.size
            return comm.apply_scatter(lambda d: _block(x, d, n).matmul(weight.t()), tp.group)
        return comm.reduce_scatter_tokens(x.matmul(weight.t()), tp.group)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        tp, w = ctx.tp, ctx.weight
        if not tp.sequence_parallel:
            g_all, gx = g, g.matmul(w)
        elif tp.overlap:
            g_all, gx = comm.gather_apply(g, lambda blk: blk.matmul(w), tp.group)
        else:
            g_all = comm.all_gather_tokens(g, tp.group)
            gx = g_all.matmul(w)
        gw = _weight_grad(w, g_all, x) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class ColumnParallelLinear(nn.Module):
    """``linear``'s output rows ``pieces`` (default: this rank's even block)."""

    def __init__(self, linear: nn.Linear, tp, pieces=None):
        super().__init__()
        out = linear.out_features
        pieces = tuple(pieces or (block_of(out, tp.size, tp.rank),))
        self.tp = tp
        self.weight = split_parameter(linear.weight, Split(tuple(linear.weight.shape), 0, pieces))
        self.bias = (
            split_parameter(linear.bias, Split((out,), 0, pieces))
            if linear.bias is not None
            else None
        )
        self.in_features, self.out_features = linear.in_features, sum(n for _, n in pieces)

    def forward(self, x):
        y = _ColumnLinear.apply(x, self.weight, self.tp)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    """``linear``'s input columns, this rank's block; bias whole."""

    def __init__(self, linear: nn.Linear, tp):
        super().__init__()
        pieces = (block_of(linear.in_features, tp.size, tp.rank),)
        self.tp = tp
        self.weight = split_parameter(linear.weight, Split(tuple(linear.weight.shape), 1, pieces))
        self.bias = linear.bias
        self.in_features, self.out_features = pieces[0][1], linear.out_features

    def forward(self, x):
        y = _RowLinear.apply(x, self.weight, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """``embedding``'s rows for this rank's block of the vocabulary; the
    output is summed over the group (SP: reduce-scattered into this rank's
    tokens)."""

    def __init__(self, embedding: nn.Embedding, tp):
        super().__init__()
        self.tp = tp
        self.start, n = block_of(embedding.num_embeddings, tp.size, tp.rank)
        self.weight = split_parameter(
            embedding.weight, Split(tuple(embedding.weight.shape), 0, ((self.start, n),))
        )

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        e = F.embedding(local.masked_fill(outside, 0), self.weight)
        e = e.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return comm.scatter_tokens(e, self.tp.group)
        return comm.sum_over_tp(e, self.tp.group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group):
        logits = logits.float()
        m = logits.max(dim=-1).values
        comm._timed(dist.all_reduce, m, op=dist.ReduceOp.MAX, group=group)
        z = logits - m.unsqueeze(-1)
        local = targets - start
        outside = (local < 0) | (local >= z.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        e = z.exp()
        both = torch.stack([picked, e.sum(-1)])  # one all-reduce for the two sums
        comm._timed(dist.all_reduce, both, group=group)
        picked, total = both[0], both[1]
        ctx.save_for_backward(e.div_(total.unsqueeze(-1)), local, outside)
        return (total.log() - picked).sum()

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad * g, None, None, None


def vocab_parallel_cross_entropy(logits, targets, start: int, group) -> torch.Tensor:
    """Cross-entropy summed over every token, from this rank's vocabulary
    block of the logits (``start``: its first id)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, targets.reshape(-1), start, group)
