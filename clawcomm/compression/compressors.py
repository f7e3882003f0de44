"""The built-in compressors: none, fp16/bf16, top-k with error feedback, and
random-k. Each sums a float32 tensor over a group in place."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from clawcomm._torch_names import reduce_scatter_single
from clawcomm.compression import powersgd, quantized, sparse, sparsified
from clawcomm.compression.base import (
    Compressor,
    CompressorState,
    Wire,
    flat_f32,
    median_seconds,
    shared_seed,
)
from clawcomm.compression.registry import parse_k, register_compressor
from clawcomm.compression.sparse import VALUE_DTYPES, sparse_all_reduce, sparse_reduce_scatter


def _engine(group):
    """The clawcomm engine behind `group`, or None for another backend."""
    import clawcomm

    try:
        return clawcomm.engine_of(group)
    except (ValueError, RuntimeError, AttributeError):
        return None


def _k_of(k: float | int, numel: int) -> int:
    if isinstance(k, float):
        return max(1, min(numel, round(k * numel))) if numel else 0
    return min(k, numel)


class NoCompression(Compressor):
    """A plain float32 all-reduce: the baseline every experiment compares to."""

    spec = "none"

    def all_reduce(self, tensor, state, key, group):
        dist.all_reduce(tensor, group=group)

    reduces_scatter = True

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        reduce_scatter_single(out, tensor, group=group)
        out.div_(dist.get_world_size(group))

    def wire(self, elems, world, sharded=False, shapes=None):
        return Wire((("reduce_scatter" if sharded else "all_reduce", 4.0 * elems),))


class HalfPrecision(Compressor):
    """16 bits on the wire, float32 accumulation at every step.

    On a clawcomm group this is the engine's ring with a 16-bit wire
    (ring_all_reduce_16bit.cc): each rank's input and partial sums stay in
    float32, only what crosses the wire is rounded, once per hop. With
    ``prescale`` every value is first multiplied by 1/world_size, which keeps
    a float16 sum of large gradients from overflowing (the result is then the
    mean, and ``all_reduce`` multiplies back). On another backend it falls back
    to casting, summing in 16 bits and casting back (what torch's
    fp16_compress_hook does).
    """

    reduces_scatter = True

    def __init__(self, wire: str, prescale: bool = True):
        self.dtype = wire
        self.prescale = prescale
        self.spec = {"float16": "fp16", "bfloat16": "bf16"}[wire]

    def all_reduce(self, tensor, state, key, group):
        self._reduce(tensor, group, mean=False)

    def all_reduce_mean(self, tensor, state, key, group):
        # The 1/n pre-scale already is the division: one pass, not three.
        self._reduce(tensor, group, mean=True)

    def wire(self, elems, world, sharded=False, shapes=None):
        """Half the bytes of float32; the conversion is the engine's, inside its ring."""
        return Wire((("reduce_scatter" if sharded else "all_reduce", 2.0 * elems),))

    def _reduce(self, tensor, group, mean: bool):
        n = dist.get_world_size(group)
        if tensor.is_cuda:
            from clawcomm.compression import gpu

            pre = 1.0 / n if self.prescale or mean else 1.0
            gpu.half_all_reduce(tensor, self.dtype, pre, 1.0 if mean else 1.0 / pre, group)
            return
        engine = _engine(group)
        if engine is None:
            half = tensor.to(getattr(torch, self.dtype))
            dist.all_reduce(half, group=group)
            tensor.copy_(half)
            if mean:
                tensor.div_(n)
            return
        pre = 1.0 / n if self.prescale or mean else 1.0
        post = n if pre != 1.0 and not mean else 1.0  # back to the sum, in the engine
        engine.all_reduce_16bit_wire(tensor.numpy(), self.dtype, pre, post)

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        """The mean's part of this rank, with the same wire and float32
        accumulation (the engine's ring, its first phase alone; ``tensor``
        holds the partial sums after). Off the engine (CUDA tensors, other
        backends): the 16-bit tensor reduce-scattered, the sum then summed
        in float32 by the backend where it can (clawcomm's CUDA kernels)."""
        n = dist.get_world_size(group)
        engine = None if tensor.is_cuda else _engine(group)
        if engine is not None:
            engine.reduce_scatter_16bit_wire(tensor.numpy(), out.numpy(), self.dtype, 1.0 / n, 1.0)
            return
        half = tensor.mul(1.0 / n).to(getattr(torch, self.dtype))
        part = half.new_empty(out.numel())
        reduce_scatter_single(part, half, group=group)
        out.copy_(part)


class TopK(Compressor):
    """The k entries of largest magnitude, with error feedback.

    Each step adds the residual kept for ``key`` to the gradient, sends the k
    largest entries of the sum, and keeps the rest as the next residual (in
    ``state``; without a state nothing is kept). Selection is ``sampled``
    (Deep Gradient Compression's threshold from a 1% sample, one pass over
    the tensor) or ``exact``. The pairs travel as int32 (or uint16) indices and
    ``values`` (fp32, fp16 or bf16) through ``sparse_all_reduce``.
    """

    uses_error_feedback = True
    codable = True

    def __init__(self, k, selection="sampled", values="fp32", form="auto"):
        self.k = k
        self.selection = selection
        self.values = values
        self.form = form
        sel = "" if selection == "sampled" else f":{selection}"
        val = "" if values == "fp32" else f"+{values}"
        self.spec = f"topk:{k}{sel}{val}"

    def with_values(self, values, spec):
        return TopK(self.k, self.selection, values, self.form)

    def all_reduce(self, tensor, state, key, group):
        self._reduce(tensor, state, key, group, scale=1.0)

    def all_reduce_mean(self, tensor, state, key, group):
        # The division is folded into the scatter of the (few) received values.
        self._reduce(tensor, state, key, group, scale=1.0 / dist.get_world_size(group))

    reduces_scatter = True

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        """ZeRO's sharded reduction: the k pairs selected (with error
        feedback on the whole tensor: the residual is the size of the
        bucket) go each to the rank whose part holds them, summed there."""
        flat_f32(tensor, "topk")
        self.check_coded_device(tensor)
        k = _k_of(self.k, tensor.numel())
        seed = shared_seed(state, key)
        residual = state.residual(key, tensor) if state is not None else None
        if tensor.is_cuda:  # exact selection, in torch
            acc = tensor + residual if residual is not None else tensor.clone()
            idx = torch.topk(acc.abs(), k, sorted=False).indices
            val = acc[idx]
            if residual is not None:
                acc[idx] = 0
                residual.copy_(acc)
        else:
            idx, val = self._select(tensor, residual, k, seed)
        out.zero_()
        n = dist.get_world_size(group)
        sparse_reduce_scatter(
            idx, val, out, tensor.numel(), group, self.values, scale=1.0 / n, coded=self.coded
        )

    def wire(self, elems, world, sharded=False, shapes=None):
        """The pairs of ``sparse_all_reduce`` (or ``sparse_reduce_scatter``)."""
        if self.coded:
            return None
        k = _k_of(self.k, elems)
        return Wire(sparse.wire(k, elems, world, self.values, self.form, sharded), codec_passes=1)

    def codec_seconds(self, elems, world, shapes=None, repeats=5):
        """The selection with its residual, and the scatter-add of
        ``world`` ranks' pairs."""
        if elems <= 0:
            return 0.0
        k = _k_of(self.k, elems)
        grad = torch.randn(elems, generator=torch.Generator().manual_seed(0))
        residual, out = torch.zeros(elems), torch.zeros(elems)

        def run(step: int) -> float:
            g = grad.clone()
            t0 = time.perf_counter()
            idx, val = self._select(g, residual, k, step)
            for _ in range(world):
                out.index_add_(0, idx.long(), val)
            return t0

        return median_seconds(run, repeats)

    def _reduce(self, tensor, state, key, group, scale):
        flat_f32(tensor, "topk")
        self.check_coded_device(tensor)
        k = _k_of(self.k, tensor.numel())
        seed = shared_seed(state, key)
        if tensor.is_cuda:
            from clawcomm.compression import gpu

            residual = state.residual(key, tensor) if state is not None else None
            gpu.topk_all_reduce(
                tensor, residual, k, self.selection, seed, self.values, scale, group
            )
            return
        residual = state.residual(key, tensor) if state is not None else None
        idx, val = self._select(tensor, residual, k, seed)
        sparse_all_reduce(
            idx,
            val,
            tensor,
            group,
            self.values,
            self.form,
            scale=scale,
            out_zeroed=True,
            coded=self.coded,
        )

    def _select(self, tensor, residual, k, seed):
        """The k pairs (indices, values) of ``tensor`` (plus ``residual``,
        which keeps the rest: one pass, compress/topk.h) on the CPU;
        ``tensor`` is left zeroed, ready for the sum."""
        from clawcomm import _C

        if residual is not None:
            idx, val = _C.compress.topk_feedback(
                tensor.numpy(), residual.numpy(), k, self.selection, seed
            )
        else:
            idx, val = _C.compress.topk(tensor.clone().numpy(), k, self.selection, seed)
            tensor.zero_()
        return torch.from_numpy(idx), torch.from_numpy(val)


class RandomK(Compressor):
    """k entries chosen uniformly at random, scaled by numel/k: an unbiased
    estimate of the sum, and the usual baseline for top-k. Every rank draws
    the same indices (the seed is the state's step and the key), so the k
    values are all-reduced densely, with no indices on the wire."""

    def __init__(self, k, values="fp32"):
        self.k = k
        self.values = values
        self.spec = f"randomk:{k}" + ("" if values == "fp32" else f"+{values}")

    def with_values(self, values, spec):
        return RandomK(self.k, values)

    def all_reduce(self, tensor, state, key, group):
        flat_f32(tensor, "randomk")
        numel = tensor.numel()
        k = _k_of(self.k, numel)
        if k == 0:
            return
        idx = _draw(state, key, numel, k).to(tensor.device)
        vals = tensor[idx] * (numel / k)
        if self.values == "fp32":
            dist.all_reduce(vals, group=group)
        else:
            HalfPrecision({"fp16": "float16", "bf16": "bfloat16"}[self.values]).all_reduce(
                vals, None, key, group
            )
        tensor.zero_()
        tensor.index_add_(0, idx, vals)

    def wire(self, elems, world, sharded=False, shapes=None):
        """The k values alone (every rank draws the same indices): all-reduced,
        or, sharded, sent each to the rank whose part holds it."""
        value = VALUE_DTYPES[self.values].itemsize * _k_of(self.k, elems)
        return Wire((("all_to_all" if sharded else "all_reduce", float(value)),), codec_passes=1)

    def codec_seconds(self, elems, world, shapes=None, repeats=5):
        """The draw, the gather of the k values and their scatter back."""
        if elems <= 0:
            return 0.0
        k = _k_of(self.k, elems)
        grad = torch.randn(elems, generator=torch.Generator().manual_seed(0))

        def run(step: int) -> float:
            g = grad.clone()
            t0 = time.perf_counter()
            idx = _draw(None, step, elems, k)
            vals = g[idx] * (elems / k)
            g.zero_()
            g.index_add_(0, idx, vals)
            return t0

        return median_seconds(run, repeats)

    reduces_scatter = True

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        """The k sampled values go each to the rank whose part holds them,
        summed there: every rank draws the same indices, so only values
        travel (one all-to-all)."""
        flat_f32(tensor, "randomk")
        numel = tensor.numel()
        k = _k_of(self.k, numel)
        out.zero_()
        if k == 0:
            return
        idx = _draw(state, key, numel, k).sort().values.to(tensor.device)
        n, me = dist.get_world_size(group), dist.get_rank(group)
        shard = numel // n
        cuts = torch.searchsorted(idx, torch.arange(n + 1, device=idx.device) * shard).tolist()
        counts = [cuts[q + 1] - cuts[q] for q in range(n)]
        vals = (tensor[idx] * (numel / k)).to(VALUE_DTYPES[self.values])
        got = vals.new_empty(n * counts[me])
        dist.all_to_all_single(got, vals, [counts[me]] * n, counts, group=group)
        mine = idx[cuts[me] : cuts[me + 1]] - me * shard
        out.index_add_(0, mine, got.view(n, -1).float().sum(0), alpha=1.0 / n)


def _draw(state, key, numel: int, k: int) -> torch.Tensor:
    """Random-k's k indices: the same on every rank (seeded from the state's
    calls for ``key``)."""
    gen = torch.Generator().manual_seed(shared_seed(state, key))
    return torch.randint(0, numel, (k,), generator=gen)


def _no_args(name, cls):
    def factory(*args, spec):
        if args:
            raise ValueError(f"compressor spec {spec!r}: {name} takes no arguments")
        return cls()

    return factory


def _topk(*args, spec):
    if not args or len(args) > 2:
        raise ValueError(f"compressor spec {spec!r}: write topk:K or topk:K:exact|sampled")
    selection = args[1] if len(args) == 2 else "sampled"
    if selection not in ("exact", "sampled"):
        raise ValueError(
            f"compressor spec {spec!r}: selection {selection!r} is not exact or sampled"
        )
    return TopK(parse_k(args[0], spec), selection)


def _randomk(*args, spec):
    if len(args) != 1:
        raise ValueError(f"compressor spec {spec!r}: write randomk:K")
    return RandomK(parse_k(args[0], spec))


register_compressor("none", _no_args("none", NoCompression))
register_compressor("fp16", _no_args("fp16", lambda: HalfPrecision("float16")))
register_compressor("bf16", _no_args("bf16", lambda: HalfPrecision("bfloat16")))
register_compressor("topk", _topk)
register_compressor("randomk", _randomk)
for _name, _factory in quantized.FACTORIES.items():
    register_compressor(_name, _factory)
register_compressor("powersgd", powersgd.factory)
register_compressor("threshold", sparsified.threshold_factory)
register_compressor("dgc", sparsified.dgc_factory)

__all__ = ["CompressorState", "HalfPrecision", "NoCompression", "RandomK", "TopK"]
