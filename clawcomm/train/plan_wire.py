"""What a stage's data-parallel reduction costs, dense or with a
compression on the wire: the plan's model of ``--compression`` when
``clawcomm plan --search-compression`` makes it a dimension of the search.

Costed are the methods whose bytes on the wire follow from the gradient's
size, not from its values:

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
  ZeRO, an all-to-all), no indices.

An all-to-all is costed as the cost model's direct reduce-scatter of the
same bytes (each rank sends (n-1)/n of them, one message a peer). The
codecs' passes (quantise and dequantise; top-k's selection with its
residual; random-k's draw, gather and scatter) are timed here, on this
machine, on the rank's gradient size. Threshold and DGC send as many pairs
as the values pass, PowerSGD's factors change what the model learns in a
way a time cannot weigh, and a coded (``+ec``) wire's bytes depend on the
values: the plan leaves those to the compression lab (``clawcomm
experiment compression``).
"""

from __future__ import annotations

import functools
import statistics
import time

# spec -> (bits per value on the wire, reduced as 16-bit floats by the engine)
WIRES = {"": (32, False), "fp16": (16, True), "bf16": (16, True), "int8": (8, False),
         "int4": (4, False)}  # fmt: skip
BLOCK = 256  # values per float32 scale (the quantisers' default)


SPARSE = ("topk", "randomk")  # costed when their bytes follow from the size


@functools.lru_cache(maxsize=64)
def sparse(spec: str):
    """The TopK or RandomK compressor of ``spec``, None for a dense wire
    (ValueError for a sparse spec the registry or the plan refuses). Cached:
    the plan asks for every bucket of every candidate; the result is only
    read."""
    if spec.split("+")[0].split(":")[0] not in SPARSE:
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
        if s not in WIRES and sparse(s) is None:
            raise ValueError(
                f"--search-compression {s!r}: the plan costs the wires whose bytes follow from "
                f"the gradient's size (none, {', '.join(k for k in WIRES if k)}, topk:R, "
                "randomk:R); compare others with clawcomm experiment compression"
            )
        if s not in out:
            out.append(s)
    return out


def codec_seconds(spec: str, elems: int, repeats: int = 5) -> float:
    """One encode and one decode-and-add of ``elems`` float32 values with
    ``spec``'s codec on this machine (the median of ``repeats``); 0 for a
    16-bit wire, whose conversion the engine does inside its ring."""
    comp = sparse(spec)
    if comp is not None:
        return _sparse_seconds(comp, elems, repeats) if elems > 0 else 0.0
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
                      stretch: float = 1.0) -> float:  # fmt: skip
    """A reduction of ``nbytes`` of float32 gradients over ``layout`` with
    ``spec`` on the wire: an all-reduce (ZeRO: a reduce-scatter), in the
    cost model, times ``stretch`` (ranks that share cores), plus the codec's
    passes (``codec_s`` per encode and decode of the whole gradient: the
    quantisers encode and decode once a stage)."""
    from clawcomm.model import predict as comm_time

    comp = sparse(spec)
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
    from clawcomm.model import predict as comm_time

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
