"""Sparsifiers beyond plain top-k: ``threshold:V`` (Strom 2015) and
``dgc:RATIO`` (Deep Gradient Compression, Lin et al. 2018).

``threshold:V`` sends every entry of gradient + residual whose magnitude
reaches V and keeps the rest as the residual (error feedback): ranks send
different numbers of pairs, and how many depends on the gradients' scale.

``dgc:RATIO[:momentum=M][:warmup=W][:clip=C]`` is top-k with DGC's four
corrections, per bucket:

* momentum correction: u = M u + g, v = v + u, and the top RATIO of v are
  sent (the optimizer then steps without momentum of its own: use SGD
  with momentum 0, the momentum M lives here);
* momentum factor masking: the sent entries are zeroed in u as in v;
* local gradient clipping: with C, g is scaled to norm at most C / sqrt(n)
  before it is accumulated (n ranks: the sum then stays within C);
* sparsity warm-up: over the first W calls (100) the density falls
  exponentially, 25%, 6.25%, 1.56%, 0.39%, then RATIO.

Both select on the CPU with the engine's one-pass kernels
(compress/threshold_scan.h, compress/topk.h) and sum through
``sparse_all_reduce``; their reduce-scatter sends each pair to the rank
whose part holds it (``sparse_reduce_scatter``). On CUDA tensors DGC selects
with the CUDA top-k kernel (the CPU's sample, so the same entries),
threshold with a comparison in torch (the same entries, in index order),
and both all-gather the pairs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single
from clawcomm.compression.base import Compressor, flat_f32, shared_seed
from clawcomm.compression.registry import parse_k
from clawcomm.compression.sparse import VALUE_DTYPES, sparse_all_reduce, sparse_reduce_scatter


def device_sparse_sum(idx, val, out, group, values: str, scale: float) -> None:
    """``out`` (zeroed) += scale * every rank's pairs, on the pairs' device:
    counts, then indices and values padded to the largest count, all-gathered
    (pads are index 0, value 0, which add nothing)."""
    n = dist.get_world_size(group)
    counts = torch.zeros(n, dtype=torch.int64, device=idx.device)
    all_gather_single(counts, torch.tensor([idx.numel()], device=idx.device), group=group)
    k = int(counts.max())
    if k == 0:
        return
    pad = k - idx.numel()
    idx = torch.cat([idx.to(torch.int64), idx.new_zeros(pad, dtype=torch.int64)])
    val = torch.cat([val, val.new_zeros(pad)]).to(VALUE_DTYPES[values])
    all_idx = idx.new_empty(n * k)
    all_val = val.new_empty(n * k)
    all_gather_single(all_idx, idx, group=group)
    all_gather_single(all_val, val, group=group)
    out.index_add_(0, all_idx, all_val.float(), alpha=scale)


class _Sparsifier(Compressor):
    """Shared by both: select pairs (``_select``, which zeroes ``tensor``),
    then sum them densely or into this rank's part."""

    uses_error_feedback = True
    reduces_scatter = True
    codable = True
    values = "fp32"

    def all_reduce(self, tensor, state, key, group):
        self._reduce(tensor, state, key, group, 1.0)

    def all_reduce_mean(self, tensor, state, key, group):
        self._reduce(tensor, state, key, group, 1.0 / dist.get_world_size(group))

    def _reduce(self, tensor, state, key, group, scale):
        flat_f32(tensor, self.spec)
        self.check_coded_device(tensor)
        idx, val = self._select(tensor.view(-1), state, key, group)
        if tensor.is_cuda:
            device_sparse_sum(idx, val, tensor.view(-1), group, self.values, scale)
        else:
            sparse_all_reduce(idx, val, tensor.view(-1), group, self.values, scale=scale,
                              out_zeroed=True, coded=self.coded)  # fmt: skip

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        flat_f32(tensor, self.spec)
        self.check_coded_device(tensor)
        idx, val = self._select(tensor.view(-1), state, key, group)
        out.zero_()
        n = dist.get_world_size(group)
        sparse_reduce_scatter(
            idx, val, out, tensor.numel(), group, self.values, scale=1.0 / n, coded=self.coded
        )


class Threshold(_Sparsifier):
    """Every entry of gradient + residual at or above ``v`` in magnitude."""

    def __init__(self, v: float, values: str = "fp32"):
        self.v, self.values = v, values
        self.spec = f"threshold:{v}" + ("" if values == "fp32" else f"+{values}")

    def with_values(self, values, spec):
        return Threshold(self.v, values)

    def _select(self, flat, state, key, group):
        residual = state.residual(key, flat) if state is not None else None
        if flat.is_cuda:
            acc = flat + residual if residual is not None else flat.clone()
            idx = torch.nonzero(acc.abs() >= self.v).flatten()
            val = acc[idx]
            if residual is not None:
                acc[idx] = 0
                residual.copy_(acc)
            flat.zero_()
            return idx, val
        from clawcomm import _C

        if residual is not None:  # one pass: fold, select, keep the rest, zero the gradient
            idx, val = _C.compress.threshold_scan(residual.numpy(), self.v, grad=flat.numpy())
        else:
            idx, val = _C.compress.threshold_scan(flat.numpy(), self.v)
            flat.zero_()
        return torch.from_numpy(idx), torch.from_numpy(val)


class DGC(_Sparsifier):
    """Deep Gradient Compression (module docstring)."""

    keeps_momentum = True

    def __init__(self, ratio, momentum=0.9, warmup=100, clip=None, values="fp32"):
        self.ratio, self.momentum, self.warmup, self.clip = ratio, momentum, warmup, clip
        self.values = values
        opts = "".join(
            f":{name}={value}"
            for name, value, default in (
                ("momentum", momentum, 0.9),
                ("warmup", warmup, 100),
                ("clip", clip, None),
            )  # fmt: skip
            if value != default
        )
        self.spec = f"dgc:{ratio}{opts}" + ("" if values == "fp32" else f"+{values}")

    def with_values(self, values, spec):
        return DGC(self.ratio, self.momentum, self.warmup, self.clip, values)

    def density(self, call: int) -> float:
        """The fraction sent at a key's ``call``-th reduction (0-based)."""
        if call >= self.warmup:
            return self.ratio
        return max(self.ratio, 0.25 ** (1 + 4 * call // self.warmup))

    def _select(self, flat, state, key, group):
        numel = flat.numel()
        call = state.calls.get(key, 0) if state is not None else self.warmup
        seed = shared_seed(state, key)
        k = max(1, min(numel, round(self.density(call) * numel))) if numel else 0
        if self.clip is not None:
            bound = self.clip / dist.get_world_size(group) ** 0.5
            norm = float(torch.linalg.vector_norm(flat))
            if norm > bound:
                flat.mul_(bound / norm)
        if state is not None:
            u, v = state.momentum(key, flat), state.residual(key, flat)
        else:
            u, v = torch.zeros_like(flat), torch.zeros_like(flat)
        u.mul_(self.momentum).add_(flat)
        v.add_(u)
        flat.zero_()
        if k == 0:
            return flat.new_zeros(0, dtype=torch.int32), flat.new_zeros(0)
        if flat.is_cuda:  # the CUDA kernel takes the CPU's sample: the same entries
            from clawcomm.compression import gpu

            idx, val = gpu.topk_take(v, k, seed)
        else:
            from clawcomm import _C

            i, x = _C.compress.topk(v.numpy(), k, "sampled", seed)  # zeroes what it takes
            idx, val = torch.from_numpy(i), torch.from_numpy(x)
        u[idx.long()] = 0  # momentum factor masking
        return idx, val


def threshold_factory(*args, spec):
    if len(args) != 1:
        raise ValueError(f"compressor spec {spec!r}: write threshold:V (V > 0)")
    try:
        v = float(args[0])
    except ValueError:
        v = -1.0
    if not v > 0 or v == float("inf"):
        raise ValueError(f"compressor spec {spec!r}: threshold {args[0]!r} is not a number > 0")
    return Threshold(v)


def dgc_factory(*args, spec):
    if not args:
        raise ValueError(
            f"compressor spec {spec!r}: write dgc:RATIO[:momentum=M][:warmup=STEPS][:clip=C]"
        )
    ratio = parse_k(args[0], spec)
    if not isinstance(ratio, float):
        raise ValueError(f"compressor spec {spec!r}: dgc's RATIO is a fraction, such as 0.001")
    opts = {"momentum": 0.9, "warmup": 100, "clip": None}
    for arg in args[1:]:
        name, eq, text = arg.partition("=")
        if not eq or name not in opts:
            raise ValueError(
                f"compressor spec {spec!r}: {arg!r} is not momentum=M, warmup=STEPS or clip=C"
            )
        try:
            opts[name] = int(text) if name == "warmup" else float(text)
        except ValueError:
            raise ValueError(f"compressor spec {spec!r}: {name} {text!r} is not a number") from None
    if not 0.0 <= opts["momentum"] < 1.0 or opts["warmup"] < 0:
        raise ValueError(
            f"compressor spec {spec!r}: momentum must be in [0, 1) and warmup >= 0 steps"
        )
    if opts["clip"] is not None and not opts["clip"] > 0:
        raise ValueError(f"compressor spec {spec!r}: clip must be > 0")
    return DGC(ratio, opts["momentum"], opts["warmup"], opts["clip"])
