"""What a stage's data-parallel reduction costs, dense or with a
compression on the wire: the plan's model of ``--compression`` when
``clawcomm plan --search-compression`` makes it a dimension of the search.

Costed are the methods whose bytes on the wire follow from the gradient's
size and shapes, not from its values:

* fp16 and bf16 (``HalfPrecision``): the engine's 16-bit ring with float32
  accumulation, half the bytes of a float32 all-reduce;
* the block quantisers int8 and int4: a reduce-scatter of codes, each
  rank's part re-quantised and all-gathered as codes, ``bits / 32`` of the
  float32 bytes plus one float32 scale per 256 values, each stage (under
  ZeRO only the reduce-scatter);
* ``topk:R`` (with error feedback): each rank's k pairs (a uint16 or int32
  index and a float32, fp16 or bf16 value) all-gathered, up to 4 ranks
  (``sparse_all_reduce``'s gather form); beyond, an all-to-all of the pairs
  and an all-gather of the summed parts' non-zeros, costed at their bound
  (every rank's pairs distinct); under ZeRO the all-to-all only;
* ``randomk:R``: the k values every rank draws alike, all-reduced (under
  ZeRO, an all-to-all), no indices;
* ``powersgd:R`` (with error feedback): per bucket, the values of what is
  not a matrix all-reduced densely, then the P factors and the Q factors
  of the matrices the compressor picks (``PowerSGD.plan`` on the bucket's
  parameter shapes), each in one all-reduce, in float32 or 16-bit; the
  same under ZeRO (the compressor all-reduces the factors and keeps its
  part).

An all-to-all is costed as the cost model's direct reduce-scatter of the
same bytes (each rank sends (n-1)/n of them, one message a peer). The
codecs' passes (quantise and dequantise; top-k's selection with its
residual; random-k's draw, gather and scatter; PowerSGD's products,
orthogonalisations and residual) are timed here, on this machine, on the
rank's gradient. Threshold and DGC send as many pairs as the values pass,
and a coded (``+ec``) wire's bytes depend on the values: the plan leaves
those to the compression lab (``clawcomm experiment compression``). What
any of them costs in loss is the lab's to measure too: the plan weighs
time alone.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

from clawcomm.compression.powersgd import PowerSGD

# spec -> (bits per value on the wire, reduced as 16-bit floats by the engine)
WIRES = {"": (32, False), "fp16": (16, True), "bf16": (16, True), "int8": (8, False),
         "int4": (4, False)}  # fmt: skip
BLOCK = 256  # values per float32 scale (the quantisers' default)


SEARCHED = ("topk", "randomk", "powersgd")  # their bytes follow from the size and shapes


@functools.lru_cache(maxsize=64)
def compressor(spec: str):
    """The TopK, RandomK or PowerSGD compressor of ``spec``, None for a
    dense wire (ValueError for a spec the registry or the plan refuses).
    Cached: the plan asks for every bucket of every candidate; the result
    is only read."""
    if spec.split("+")[0].split(":")[0] not in SEARCHED:
        return None
    from clawcomm.compression.registry import get_compressor

    try:
        comp = get_compressor(spec)
    except ValueError as e:
        raise ValueError(f"--search-compression: {e}") from None
    if comp.coded:
        raise ValueError(f"--search-compression {spec!r}: a coded wire sends what the values "
                         "decide; the plan costs it uncoded (drop +ec)")  # fmt: skip
    return comp


def check_specs(specs: list[str]) -> list[str]:
    """The searched compressions ('' for none), or ValueError naming the
    one the plan cannot cost."""
    out = []
    for s in specs:
        s = "" if s in ("none", "") else s
        if s not in WIRES and compressor(s) is None:
            raise ValueError(
                f"--search-compression {s!r}: the plan costs the wires whose bytes follow from "
                f"the gradient's size (none, {', '.join(k for k in WIRES if k)}, topk:R, "
                "randomk:R, powersgd:R); compare others with clawcomm experiment compression"
            )
        if s not in out:
            out.append(s)
    return out


def codec_seconds(spec: str, elems: int, repeats: int = 5, shapes=None) -> float:
    """One encode and one decode-and-add of ``elems`` float32 values with
    ``spec``'s codec on this machine (the median of ``repeats``; PowerSGD's
    on parameters of ``shapes``); 0 for a 16-bit wire, whose conversion the
    engine does inside its ring."""
    comp = compressor(spec)
    if comp is not None and elems <= 0:
        return 0.0
    if isinstance(comp, PowerSGD):
        return _low_rank_seconds(comp, shapes or [(elems,)], repeats)
    if comp is not None:
        return _sparse_seconds(comp, elems, repeats)
    bits, sixteen = WIRES[spec]
    if bits == 32 or sixteen or elems <= 0:
        return 0.0
    import numpy as np

    from clawcomm import _C

    elems = -(-elems // BLOCK) * BLOCK
    x = np.random.default_rng(0).standard_normal(elems).astype(np.float32)
    codes = np.empty(elems * bits // 8, np.uint8)
    scales = np.empty(elems // BLOCK, np.float32)
    out = np.zeros(elems, np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _C.compress.quantize(x, codes, scales, bits, BLOCK)
        _C.compress.dequantize(codes, scales, out, bits, BLOCK, "max", 0.5, True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reduction_seconds(spec: str, zero: int, nbytes: float, layout, cost, codec_s: float,
                      stretch: float = 1.0, shapes=None) -> float:  # fmt: skip
    """A reduction of ``nbytes`` of float32 gradients (parameters of
    ``shapes``, laid out back to back) over ``layout`` with ``spec`` on the
    wire: an all-reduce (ZeRO: a reduce-scatter), in the cost model, times
    ``stretch`` (ranks that share cores), plus the codec's passes
    (``codec_s`` per encode and decode of the whole gradient: the quantisers
    encode and decode once a stage)."""
    from clawcomm.cost_model import predict as comm_time

    comp = compressor(spec)
    if isinstance(comp, PowerSGD):
        return stretch * _low_rank_reduction(comp, nbytes, shapes, layout, cost) + codec_s
    if comp is not None:
        return stretch * _sparse_reduction(comp, zero, nbytes, layout, cost) + codec_s
    bits, sixteen = WIRES[spec]
    if bits == 32 or sixteen:
        wire = nbytes * bits / 32
        op = "all_reduce" if zero == 0 else "reduce_scatter"
        return stretch * comm_time(op, "auto", wire, layout, cost)
    wire = nbytes * (bits / 32 + 1 / BLOCK)
    stages = 1 if zero else 2
    scatter = comm_time("reduce_scatter", "auto", wire, layout, cost)
    gather = comm_time("all_gather", "auto", wire, layout, cost) if stages == 2 else 0.0
    return stretch * (scatter + gather) + stages * codec_s


def _sparse_seconds(comp, elems: int, repeats: int) -> float:
    """Top-k's selection with its residual and the scatter-add of 4 ranks'
    pairs, or random-k's draw, gather and scatter, over ``elems`` values."""
    import torch

    from clawcomm.compression.compressors import TopK, _draw, _k_of

    k = _k_of(comp.k, elems)
    grad = torch.randn(elems, generator=torch.Generator().manual_seed(0))
    residual, out = torch.zeros(elems), torch.zeros(elems)
    times = []
    for step in range(repeats):
        g = grad.clone()
        t0 = time.perf_counter()
        if isinstance(comp, TopK):
            idx, val = comp._select(g, residual, k, step)
            for _ in range(4):
                out.index_add_(0, idx.long(), val)
        else:
            idx = _draw(None, step, elems, k)
            vals = g[idx] * (elems / k)
            g.zero_()
            g.index_add_(0, idx, vals)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sparse_reduction(comp, zero: int, nbytes: float, layout, cost) -> float:
    """The wire of a top-k or random-k reduction of ``nbytes`` of float32
    gradients (module docstring)."""
    from clawcomm.compression.compressors import TopK, _k_of
    from clawcomm.compression.sparse import VALUE_DTYPES, _index_dtype
    from clawcomm.cost_model import predict as comm_time

    elems = max(1, int(nbytes // 4))
    k, n = _k_of(comp.k, elems), layout.size
    value = VALUE_DTYPES[comp.values].itemsize  # as the pairs travel (sparse.py)

    def all_to_all(b: float) -> float:
        return comm_time("reduce_scatter", "direct", b, layout, cost)

    if not isinstance(comp, TopK):  # random-k: values only
        return all_to_all(k * value) if zero else comm_time("all_reduce", "auto", k * value,
                                                            layout, cost)  # fmt: skip
    pairs = k * (_index_dtype(elems).itemsize + value)
    counts = comm_time("all_gather", "auto", 8 * n, layout, cost)
    if zero:
        return all_to_all(pairs)
    if n <= 4:
        return counts + comm_time("all_gather", "auto", n * pairs, layout, cost)
    union = min(n * pairs, elems * (4 + value))  # the bound: no two ranks pick alike
    return 2 * counts + all_to_all(pairs) + comm_time("all_gather", "auto", union, layout, cost)


def _low_rank_reduction(comp, nbytes: float, shapes, layout, cost) -> float:
    """PowerSGD's wire for a bucket of ``nbytes`` laid out as ``shapes``:
    the dense values' all-reduce, then the P's and the Q's."""
    from clawcomm.cost_model import predict as comm_time

    elems = max(1, int(nbytes // 4))
    matrices, dense = comp.plan(elems, shapes or [(elems,)])
    value = 4 if comp.values == "fp32" else 2  # the 16-bit ring for +fp16, +bf16
    out = 0.0
    for values, size in ((sum(n for _, n in dense), 4),
                         (sum(rows * r for _, rows, _, r in matrices), value),
                         (sum(cols * r for _, _, cols, r in matrices), value)):  # fmt: skip
        if values:
            out += comm_time("all_reduce", "auto", values * size, layout, cost)
    return out


def _low_rank_seconds(comp, shapes, repeats: int) -> float:
    """PowerSGD's passes over a gradient of ``shapes`` (the compressor's
    own ``mean`` with its all-reduces left out): the residual added and
    kept, the dense values packed and unpacked, the factors' products and
    orthogonalisations."""
    import torch

    from clawcomm.compression.base import CompressorState

    elems = sum(math.prod(s) for s in shapes)
    grad, state = torch.randn(elems), CompressorState()
    state.shapes[0] = list(shapes)
    local = PowerSGD(comp.rank, comp.values, comp.min_compression_rate)
    local._sum = local._sum_dense = lambda t, group: None  # the wire is costed apart
    times = []
    for _ in range(repeats):
        flat = grad.clone()
        t0 = time.perf_counter()
        local.mean(flat, state, 0, None, 4)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
