"""Tensor parallelism's communication: the collectives a split layer makes
over its TP group, as autograd functions, and their overlapped forms.

Activations are ``[batch, tokens, width]``; with sequence parallelism a rank
holds ``tokens / tp`` of them (rank r the r-th contiguous block), and the
layers move between that slice and the whole sequence:

    gather_tokens      forward all-gather over tokens,  backward reduce-scatter
    scatter_tokens     forward reduce-scatter (a sum),  backward all-gather
    copy_to_tp         forward identity,                backward all-reduce
    sum_over_tp        forward all-reduce,              backward identity

(the four ``f``/``g`` pairs of Megatron-LM's sequence-parallel paper).

Overlapped ("async TP", as torch's micro-pipelined TP and the collective
matmul of Wang et al., ASPLOS 2023, decompose them): an all-gather followed
by a per-token computation, and a per-token computation followed by a
reduce-scatter, become ``tp`` steps around the ring of the TP group, each
step computing on one block of tokens while the next block travels:

    ring_gather_apply   step s computes on the block of rank r - s while
                        the block of rank r - s - 1 arrives (``tp - 1``
                        sends of one block each, all but the first hidden)
    ring_apply_scatter  step s computes this rank's part for rank r - 1 - s,
                        adds the sum that arrived for it and passes it on;
                        the last step's sum is this rank's own block

Every blocking call and wait here is timed into ``EXPOSED`` (the TP time the
step saw: the trainer reports it as ``tp_ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single, reduce_scatter_single


class Exposed:
    """Seconds this process spent blocked on TP communication."""

    def __init__(self):
        self.seconds = 0.0

    def lap(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


EXPOSED = Exposed()


def _timed(fn: Callable, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    EXPOSED.seconds += time.perf_counter() - t0
    return out


def _size(group) -> int:
    return dist.get_world_size(group)


def all_gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[b, t/n, ...] on each rank -> [b, t, ...] (rank r's block r-th)."""
    n = _size(group)
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    _timed(all_gather_single, out, x.contiguous(), group=group)
    return out.movedim(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])


def start_all_gather_tokens(x: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """``all_gather_tokens`` started now; the returned call waits for it."""
    n = _size(group)
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    work = all_gather_single(out, x.contiguous(), group=group, async_op=True)

    def finish() -> torch.Tensor:
        _timed(work.wait)
        return out.movedim(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])

    return finish


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[b, t, ...] partial sums on each rank -> rank r's block of the sum."""
    n = _size(group)
    b, t = x.shape[0], x.shape[1]
    if t % n:
        raise ValueError(f"tensor parallel: {t} tokens do not split over tp {n}")
    parts = x.reshape(b, n, t // n, *x.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    _timed(reduce_scatter_single, out, parts, group=group)
    return out


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    _timed(dist.all_reduce, x, group=group)
    return x


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_tokens(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_tokens(g, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_tokens(g, ctx.group), None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.group), None


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def gather_tokens(x, group):
    return _GatherTokens.apply(x, group)


def scatter_tokens(x, group):
    return _ScatterTokens.apply(x, group)


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def sum_over_tp(x, group):
    return _SumOverTP.apply(x, group)


# ---- overlapped: one block of tokens in flight while another is computed ------------


def _neighbours(group) -> tuple[int, int, int, int]:
    """(this rank in the group, its size, the next rank's global rank, the
    previous rank's global rank)."""
    n, r = _size(group), dist.get_rank(group)
    return r, n, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group):
    """Posts send -> ``to`` and recv <- ``frm``; returns the two requests."""
    return [
        dist.isend(send, to, group=group),
        dist.irecv(recv, frm, group=group),
    ]


def _wait(requests) -> None:
    t0 = time.perf_counter()
    for q in requests:
        q.wait()
    EXPOSED.seconds += time.perf_counter() - t0


def ring_gather_apply(
    x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gathered input, ``fn`` of it) for a per-token ``fn``, gathered
    around the ring while ``fn`` runs on the blocks already here:
    ``fn(all_gather_tokens(x))`` with the all-gather hidden behind ``fn``."""
    r, n, nxt, prv = _neighbours(group)
    blocks: list = [None] * n
    outs: list = [None] * n
    cur = x.contiguous()
    for s in range(n):
        src = (r - s) % n
        blocks[src] = cur
        pending = []
        if s < n - 1:  # 1. pass the block on and take the previous rank's
            incoming = torch.empty_like(cur)
            pending = _exchange(cur, incoming, nxt, prv, group)
        outs[src] = fn(cur)  # 2. compute on the block held, meanwhile
        if pending:
            _wait(pending)
            cur = incoming
    return torch.cat(blocks, dim=1), torch.cat(outs, dim=1)


def ring_apply_scatter(fn: Callable[[int], torch.Tensor], group) -> torch.Tensor:
    """Rank r's block of ``sum over ranks of fn(block)`` where ``fn(d)`` is
    this rank's part for the tokens of rank d: ``reduce_scatter_tokens``
    of the whole, with each part's transfer hidden behind the next part's
    computation. Each sum starts at rank d + 1 and travels to d."""
    r, n, nxt, prv = _neighbours(group)
    acc = fn((r - 1) % n)  # 1. start the sum owed to the previous rank
    for s in range(1, n):
        incoming = torch.empty_like(acc)
        pending = _exchange(acc, incoming, nxt, prv, group)  # 2. pass it on
        part = fn((r - 1 - s) % n)  # 3. compute the next part meanwhile
        _wait(pending)
        acc = incoming + part  # 4. add it to the sum that arrived for it
    return acc
