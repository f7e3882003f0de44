"""Expert parallelism: a mixture-of-experts layer's experts spread over the
ep ranks of an expert-parallel group, and the tokens sent to them and back.

As in Megatron Core and DeepSpeed, ep divides the data-parallel ranks:
``--dp 4 --ep 2`` is 4 replicas of the dense part and 2 copies of each
expert, each copy spread over 2 neighbouring data-parallel ranks (rank j of
the expert-parallel group holds experts j*E/ep .. (j+1)*E/ep - 1). A
copy's gradients are reduced over the dp/ep ranks that hold the same
experts (the expert-data-parallel group); the dense part's over every
data-parallel rank, as without experts.

``dispatch`` (one micro-batch of one layer, forward and backward):

1. sort the kept token slots by expert (the order every layout shares, so
   that the sums below add in the same order at every ep);
2. ep > 1: exchange the slot counts (one all-to-all of ep x E/ep
   integers), then the tokens themselves with uneven splits, no padding to
   the capacity on the wire (the second all-to-all);
3. each local expert computes on its slots, from every source rank;
4. the outputs go back by the reverse all-to-all and are summed into their
   tokens, weighted by their gates.

The backward of each all-to-all is the all-to-all the other way. Every
blocking exchange is timed into ``EXPOSED`` (the trainer's ``ep_ms``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from clawcomm.parallel.split import block_of, cut_parameter
from clawcomm.parallel.tensor.comm import Exposed

EXPOSED = Exposed()


def _all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    EXPOSED.seconds += time.perf_counter() - t0
    return out


class _Exchange(torch.autograd.Function):
    """An uneven all-to-all of rows; its backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows, group):
        ctx.rows, ctx.group = (out_rows, in_rows), group
        return _all_to_all(x, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx, g):
        out_rows, in_rows = ctx.rows
        return _all_to_all(g, in_rows, out_rows, ctx.group), None, None, None


def dispatch(tokens, chosen, gates, keep, experts, group) -> torch.Tensor:
    """The MoE output [N, dim] of ``tokens`` [N, dim] routed to ``chosen``
    [N, k] with ``gates`` (slots where ``keep`` is False are dropped),
    ``experts`` (``clawcomm.train.moe.Experts``) holding this rank's block
    of them, spread over ``group`` (None: all here)."""
    n, k = chosen.shape
    slot_expert = chosen.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.sort(slot_expert[kept], stable=True).indices]
    token_of = order // k
    rows = tokens[token_of]
    local = experts.count
    total = local * (1 if group is None else dist.get_world_size(group))
    counts = torch.bincount(slot_expert[order], minlength=total)
    if group is None:
        out = experts(rows, counts.tolist())
    else:
        out = _through_peers(rows, counts, experts, group)
    weighted = out * gates.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    return tokens.new_zeros(tokens.shape).index_add(0, token_of, weighted)


def _through_peers(rows, counts, experts, group) -> torch.Tensor:
    """``rows`` (sorted by expert, ``counts`` per expert of the whole
    layer) to the ranks holding their experts, through them, and back."""
    ep, local = dist.get_world_size(group), experts.count
    send = counts.view(ep, local)  # [peer, its expert]: what goes to each peer
    recv = _all_to_all(send, [1] * ep, [1] * ep, group)  # [source, my expert]: what comes
    send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
    got = _Exchange.apply(rows, recv_rows, send_rows, group)
    # They come by source, then expert; the experts take them by expert, then source.
    index = _regroup(recv)
    computed = experts(got[index], recv.sum(0).tolist())
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return _Exchange.apply(computed[inverse], send_rows, recv_rows, group)


def _regroup(counts: torch.Tensor) -> torch.Tensor:
    """For rows laid out by (source, expert) with ``counts`` [source,
    expert] of each, the indices that lay them out by (expert, source)."""
    flat = counts.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(counts).t().reshape(-1)
    sizes = counts.t().reshape(-1)
    first = torch.repeat_interleave(starts, sizes)
    within = torch.arange(first.numel(), device=counts.device) - torch.repeat_interleave(
        sizes.cumsum(0) - sizes, sizes
    )
    return first + within


# ---- spreading the experts, and their gradients -------------------------------------


def split(layers: list[nn.Module], group, ep: int, ep_rank: int) -> list[nn.Parameter]:
    """Each MoE layer of ``layers`` (``train.moe.MoE``) keeps its
    ``ep_rank``-th block of experts (parameters split along the expert
    dimension, which checkpoints reshard) and sends tokens over ``group``;
    returns the experts' parameters."""
    out = []
    for layer in layers:
        mod = layer.experts
        start, n = block_of(mod.count, ep, ep_rank)
        for name in ("w1", "b1", "w2", "b2"):  # (at tp > 1, cut along hidden already)
            out.append(cut_parameter(getattr(mod, name), 0, ((start, n),)))
        mod.first = start
        layer.ep_group = group
    return out


class SpreadExperts:
    """A rank's experts spread over its expert-parallel group (``spread``
    makes it): their parameters, the group that holds the same experts
    (``replicas``: None where dp == ep), and how their gradients are
    reduced, counted and zeroed."""

    def __init__(self, params: list[nn.Parameter], group, replicas, ep: int, dp: int):
        self.params, self.group, self.replicas, self.ep, self.dp = params, group, replicas, ep, dp
        self.ids = {id(p) for p in params}

    def dense(self, params: list) -> list:
        """``params`` less the experts' (what every data-parallel rank reduces)."""
        return [p for p in params if id(p) not in self.ids]

    def reduce_grads(self) -> None:
        """The experts' gradients summed over the ranks holding the same
        experts and divided by dp: each copy saw the tokens of its ep
        ranks, each loss scaled as one replica's (dp / items), so the sum
        over the copies, over dp, is the mean."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.replicas is not None:
            dist.all_reduce(flat, group=self.replicas)
        flat.div_(self.dp)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()

    def sumsq(self, skip: set[int] = frozenset()) -> float:
        """The experts' squared gradient norm as the trainer's global norm
        counts a rank's (it divides the sum over ranks by dp, and these are
        held by dp / ep ranks, not dp): ep times theirs; less ``skip``
        (counted on another TP rank)."""
        grads = [p.grad for p in self.params if p.grad is not None and id(p) not in skip]
        return self.ep * sum(float(g.double().square().sum()) for g in grads)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def spread(layers: list[nn.Module], grid, ep: int) -> SpreadExperts:
    """Splits the experts of the MoE ``layers`` over the expert-parallel
    groups of ``grid`` (every rank makes every group, in the same order):
    the ep neighbouring data-parallel ranks of each stage, and the dp / ep
    ranks that hold the same experts."""
    groups, replicas = _groups(grid, ep)
    params = split(layers, groups, ep, grid.dp_rank % ep)
    return SpreadExperts(params, groups, replicas, ep, grid.dp)


def _groups(grid, ep: int):
    """(this rank's expert-parallel group, its group of ranks with the same
    experts or None)."""
    mine = same = None
    copies = grid.dp // ep
    for p in range(grid.pp):
        for t in range(grid.tp):
            for c in range(copies):
                ranks = [grid.rank_of(c * ep + j, p, t) for j in range(ep)]
                g = dist.new_group(ranks)
                if grid.rank in ranks:
                    mine = g
            for j in range(ep):
                ranks = [grid.rank_of(c * ep + j, p, t) for c in range(copies)]
                g = dist.new_group(ranks) if copies > 1 else None
                if grid.rank in ranks:
                    same = g
    return mine, same


# ---- what the planner asks ------------------------------------------------------------


def traffic(
    layers: list[list[nn.Module]], micro_batch_size: int, seq_len: int
) -> list[tuple[float, float]]:
    """Per layer of the whole model (the MoE layers in each, ``layers``):
    (its experts' parameters, the bytes one of its all-to-alls carries for a
    micro-batch: every token slot's activation, float32, as the cost model
    takes an all-to-all's input). A micro-batch makes three all-to-alls a
    layer forward (the counts', a few bytes, then the tokens there and
    back) and two backward."""
    out = []
    for moes in layers:
        experts, nbytes = 0.0, 0.0
        for m in moes:
            experts += sum(p.numel() for p in m.experts.parameters())
            nbytes += 4.0 * micro_batch_size * seq_len * m.top_k * m.router.in_features
        out.append((experts, nbytes))
    return out
