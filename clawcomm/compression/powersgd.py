"""PowerSGD (Vogels et al. 2019): each gradient matrix M (n x m) travels as
two thin factors, P (n x r) and Q (m x r), from one step of power
iteration, with error feedback and a warm start.

Per bucket, as torch's ``powerSGD_hook`` does:

1. M += residual (error feedback); keep a copy.
2. Orthogonalise Q (last step's, or random from a seed every rank shares on
   the first step), P = M Q, all-reduce the P's (one flat buffer).
3. Orthogonalise P (Gram-Schmidt in float32, whatever the wire), Q = M^T P,
   all-reduce the Q's and divide by the world size.
4. M = P Q^T, the mean's rank-r approximation; residual = copy - M.

A tensor is compressed when it is a matrix (a parameter of two or more
dimensions, viewed as shape[0] x rest) and (n + m) r times
``min_compression_rate`` (2) is below n m; the others (biases, norms, and
what no layout describes) are averaged densely in one all-reduce.

The shapes come from the caller: ``CompressorState.shapes[key]`` lists the
parameters laid out back to back in the tensor (DataParallel, the trainer
and the DDP hook fill it in); without it a tensor of two or more dimensions
is one matrix and a flat one is sent densely (as torch and GRACE do).
``powersgd:R+bf16`` sends P and Q in bfloat16.

Bytes per step and rank: a ring all-reduce of sum((n + m) r) + dense
values, against one of every value.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from clawcomm.compression.base import Compressor, CompressorState, Wire, median_seconds, shared_seed
from clawcomm.compression.registry import get_compressor


def orthogonalize(m: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns of ``m`` (rows x r) in place, in
    float32; a zero column stays zero."""
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col /= torch.linalg.vector_norm(col) + eps
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest -= (col * rest).sum(0, keepdim=True) * col


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (module
    docstring)."""

    uses_error_feedback = True
    uses_shapes = True
    reduces_scatter = True

    def __init__(self, rank: int, values: str = "fp32", min_compression_rate: float = 2.0):
        self.rank, self.values = rank, values
        self.min_compression_rate = min_compression_rate
        self.spec = f"powersgd:{rank}" + ("" if values == "fp32" else f"+{values}")

    def with_values(self, values, spec):
        return PowerSGD(self.rank, values, self.min_compression_rate)

    def plan(self, numel: int, shapes) -> tuple[list, list]:
        """(matrices as (offset, rows, cols, r), dense spans as (offset,
        length)) for a tensor of ``numel`` laid out as ``shapes``."""
        matrices, dense, off = [], [], 0
        for shape in shapes:
            size = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 0
            cols = size // rows if rows else 0
            r = min(rows, cols, self.rank)
            if rows and (rows + cols) * r * self.min_compression_rate < rows * cols:
                matrices.append((off, rows, cols, r))
            elif size:
                dense.append((off, size))
            off += size
        if off < numel:
            dense.append((off, numel - off))
        return matrices, dense

    def wire_values(self, numel: int, shapes) -> int:
        """Values all-reduced per step: the formula the tests check bytes against."""
        matrices, dense = self.plan(numel, shapes)
        return sum((rows + cols) * r for _, rows, cols, r in matrices) + sum(n for _, n in dense)

    def wire(self, elems, world, sharded=False, shapes=None):
        """The values of what is not a matrix all-reduced densely, then the
        P factors and the Q factors, one all-reduce each (in 16 bits with
        ``+fp16``/``+bf16``); sharded the same (the part is kept)."""
        matrices, dense = self.plan(elems, shapes or [(elems,)])
        value = 4 if self.values == "fp32" else 2
        sizes = ((4, sum(n for _, n in dense)),
                 (value, sum(rows * r for _, rows, _, r in matrices)),
                 (value, sum(cols * r for _, _, cols, r in matrices)))  # fmt: skip
        return Wire(tuple(("all_reduce", float(b * n)) for b, n in sizes if n), codec_passes=1)

    def codec_seconds(self, elems, world, shapes=None, repeats=5):
        """The passes of ``mean`` over a gradient of ``shapes`` with its
        all-reduces left out: the residual added and kept, the dense values
        packed and unpacked, the factors' products and orthogonalisations."""
        shapes = list(shapes or [(elems,)])
        elems = sum(math.prod(s) for s in shapes)
        if elems <= 0:
            return 0.0
        grad, state = torch.randn(elems), CompressorState()
        state.shapes[0] = shapes
        local = PowerSGD(self.rank, self.values, self.min_compression_rate)
        local._sum = local._sum_dense = lambda t, group: None  # the wire is priced apart

        def run(step: int) -> float:
            flat = grad.clone()
            t0 = time.perf_counter()
            local.mean(flat, state, 0, None, world)
            return t0

        return median_seconds(run, repeats)

    def all_reduce(self, tensor, state, key, group):
        self.all_reduce_mean(tensor, state, key, group)
        tensor.mul_(dist.get_world_size(group))

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        """P and Q are all-reduced whatever the layout; the part is kept."""
        me = dist.get_rank(group)
        self.all_reduce_mean(tensor, state, key, group)
        out.copy_(tensor.view(-1)[me * out.numel() : (me + 1) * out.numel()])

    def all_reduce_mean(self, tensor, state, key, group):
        self.mean(tensor, state, key, group, dist.get_world_size(group))

    def mean(self, tensor, state, key, group, n: int) -> None:
        """``all_reduce_mean`` over ``n`` ranks. Every collective goes
        through ``_sum_dense`` and ``_sum``, so that the passes can be timed
        without them (``codec_seconds``)."""
        flat = tensor.view(-1)
        shapes = state.shapes.get(key) if state is not None else None
        if shapes is None:
            shapes = [tensor.shape]
        matrices, dense = self.plan(flat.numel(), shapes)
        seed = shared_seed(state, key)
        residual = state.residual(key, flat) if state is not None else None
        if residual is not None:
            flat.add_(residual)
            before = flat.clone()
        if dense:
            packed = torch.cat([flat[o : o + size] for o, size in dense])
            self._sum_dense(packed, group)
            packed.div_(n)
            at = 0
            for o, size in dense:
                flat[o : o + size].copy_(packed[at : at + size])
                at += size
        if matrices:
            self._low_rank(flat, matrices, state, key, group, seed, n)
        if residual is not None:
            torch.sub(before, flat, out=residual)

    def _low_rank(self, flat, matrices, state, key, group, seed, n):
        views = [flat[o : o + rows * cols].view(rows, cols) for o, rows, cols, _ in matrices]
        p_size = sum(rows * r for _, rows, _, r in matrices)
        q_size = sum(cols * r for _, _, cols, r in matrices)
        q_all = state.memory.get((key, "q")) if state is not None else None
        fresh = q_all is None or q_all.numel() != q_size
        if fresh:  # the same random start on every rank
            gen = torch.Generator().manual_seed(seed)
            q_all = torch.randn(q_size, generator=gen).to(flat.device)
        p_all = flat.new_empty(p_size)
        ps, qs, at_p, at_q = [], [], 0, 0
        for (_, rows, cols, r), m in zip(matrices, views, strict=True):
            p = p_all[at_p : at_p + rows * r].view(rows, r)
            q = q_all[at_q : at_q + cols * r].view(cols, r)
            at_p, at_q = at_p + rows * r, at_q + cols * r
            orthogonalize(q)
            torch.matmul(m, q, out=p)
            ps.append(p)
            qs.append(q)
        self._sum(p_all, group)
        for p in ps:
            orthogonalize(p)
        for m, p, q in zip(views, ps, qs, strict=True):
            torch.matmul(m.t(), p, out=q)
        self._sum(q_all, group)
        q_all.div_(n)
        for m, p, q in zip(views, ps, qs, strict=True):
            torch.matmul(p, q.t(), out=m)
        if state is not None:
            state.memory[(key, "q")] = q_all

    def _sum_dense(self, t: torch.Tensor, group) -> None:
        dist.all_reduce(t, group=group)

    def _sum(self, t: torch.Tensor, group) -> None:
        if self.values == "fp32":
            dist.all_reduce(t, group=group)
        else:  # the 16-bit wire, float32 accumulation (the fp16/bf16 compressors)
            get_compressor(self.values).all_reduce(t, None, None, group)


def factory(*args, spec):
    if len(args) != 1:
        raise ValueError(f"compressor spec {spec!r}: write powersgd:RANK (RANK >= 1)")
    try:
        rank = int(args[0])
    except ValueError:
        rank = 0
    if rank < 1:
        raise ValueError(f"compressor spec {spec!r}: rank {args[0]!r} is not an integer >= 1")
    return PowerSGD(rank)
