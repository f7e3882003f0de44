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
Around a computation every rank repeats on the whole sequence (a
mixture-of-experts layer under sequence parallelism: the same routing on
every TP rank), the gradients are whole on every rank, so the pair is

    gather_whole       forward all-gather over tokens,  backward own block
    own_tokens         forward own block,               backward all-gather

Overlapped ("async TP", as torch's micro-pipelined TP over symmetric
memory and the collective matmul of Wang et al., ASPLOS 2023, decompose
them): an all-gather followed by a per-token computation, and a per-token
computation followed by a reduce-scatter, are cut into one block of tokens
per rank, exchanged by point-to-point sends with every peer while the layer
computes on the blocks it already has:

    gather_apply    computes on its own block while every peer's arrives,
                    then on each peer's block as it lands
    apply_scatter   computes each peer's part and sends it at once, its own
                    part last, then adds what the peers sent it

(A ring, each block passed on by its neighbour, would chain every step to
the one before; the direct exchange posts every transfer at once.)

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
    # (dim 0 is rank-major, n x batch: what every backend's all-gather takes)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _timed(all_gather_single, out, x.contiguous(), group=group)
    out = out.view(n, *x.shape)
    return out.movedim(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])


def start_all_gather_tokens(x: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """``all_gather_tokens`` started now; the returned call waits for it."""
    n = _size(group)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_single(out, x.contiguous(), group=group, async_op=True)

    def finish() -> torch.Tensor:
        _timed(work.wait)
        whole = out.view(n, *x.shape).movedim(0, 1)
        return whole.reshape(x.shape[0], n * x.shape[1], *x.shape[2:])

    return finish


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[b, t, ...] partial sums on each rank -> rank r's block of the sum."""
    n = _size(group)
    b, t = x.shape[0], x.shape[1]
    if t % n:
        raise ValueError(f"tensor parallel: {t} tokens do not split over tp {n}")
    parts = x.reshape(b, n, t // n, *x.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    _timed(reduce_scatter_single, out, parts.view(n * b, *parts.shape[2:]), group=group)
    return out


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    _timed(dist.all_reduce, x, group=group)
    return x


def _own_block(x: torch.Tensor, group) -> torch.Tensor:
    n, r = _size(group), dist.get_rank(group)
    t = x.shape[1] // n
    return x[:, r * t : (r + 1) * t].contiguous()


def _collective(forward: Callable, backward: Callable) -> Callable:
    """``fn(x, group)``: ``forward(x, group)``, whose gradient is
    ``backward(g, group)`` (the pairs in the module docstring)."""

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, g):
            return backward(g, ctx.group), None

    return _Function.apply


gather_tokens = _collective(all_gather_tokens, reduce_scatter_tokens)
scatter_tokens = _collective(reduce_scatter_tokens, all_gather_tokens)
copy_to_tp = _collective(lambda x, group: x, lambda g, group: all_reduce(g.clone(), group))
sum_over_tp = _collective(lambda x, group: all_reduce(x.clone(), group), lambda g, group: g)
gather_whole = _collective(all_gather_tokens, _own_block)
own_tokens = _collective(_own_block, all_gather_tokens)


# ---- overlapped: blocks of tokens in flight while others are computed ---------------


def _wait(requests) -> None:
    t0 = time.perf_counter()
    for q in requests:
        q.wait()
    EXPOSED.seconds += time.perf_counter() - t0


def _peers(group) -> tuple[int, int, list[tuple[int, int]]]:
    """(this rank in the group, its size, [(k, global rank of r + k, global
    rank of r - k) for k = 1 .. n-1]): whom a rank sends to and hears from,
    nearest first."""
    n, r = _size(group), dist.get_rank(group)
    glob = lambda i: dist.get_global_rank(group, i % n)  # noqa: E731
    return r, n, [(k, glob(r + k), glob(r - k)) for k in range(1, n)]


def gather_apply(
    x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], group, keep: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the gathered input, or None unless ``keep``; ``fn`` of it) for a
    per-token ``fn``:
    ``fn(all_gather_tokens(x))`` with the gather
    hidden behind ``fn``: this rank's block goes to every peer and theirs
    come in at once (n - 1 sends and receives, all posted first), while
    ``fn`` runs on the block it holds; then on each peer's block, nearest
    first, as it lands."""
    r, n, peers = _peers(group)
    blocks: dict[int, torch.Tensor] = {}
    sends, recvs = [], {}
    x = x.contiguous()
    for k, to, frm in peers:  # 1. post every transfer
        blocks[(r - k) % n] = torch.empty_like(x)
        recvs[(r - k) % n] = dist.irecv(blocks[(r - k) % n], frm, group=group)
        sends.append(dist.isend(x, to, group=group))
    outs = {r: fn(x)}  # 2. compute on the block held, meanwhile
    for k, _, _ in peers:  # 3. each peer's block as it lands
        src = (r - k) % n
        _wait([recvs[src]])
        outs[src] = fn(blocks[src])
    _wait(sends)
    blocks[r] = x
    gathered = torch.cat([blocks[i] for i in range(n)], dim=1) if keep else None
    return gathered, torch.cat([outs[i] for i in range(n)], dim=1)


def apply_scatter(fn: Callable[[int], torch.Tensor], group) -> torch.Tensor:
    """Rank r's block of ``sum over ranks of fn(block)`` where ``fn(d)`` is
    this rank's part for the tokens of rank d: ``reduce_scatter_tokens`` of
    the whole, with each part sent to its rank as soon as it is computed
    (the farthest first) and this rank's own part computed last, behind
    them. The parts are summed in one order on every run."""
    r, n, peers = _peers(group)
    incoming, recvs, sends = {}, [], []
    for k, to, frm in reversed(peers):  # 1. computed and sent, one part after another
        part = fn((r + k) % n)
        incoming[k] = torch.empty_like(part)
        recvs.append(dist.irecv(incoming[k], frm, group=group))
        sends.append(dist.isend(part, to, group=group))
    acc = fn(r)  # 2. this rank's own part, behind the transfers
    _wait(recvs)
    for k, _, _ in peers:  # 3. summed in the order of k
        acc = acc + incoming[k]
    _wait(sends)
    return acc
