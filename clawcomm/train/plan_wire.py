"""What a stage's data-parallel reduction costs, dense or with a dense
compression on the wire: the plan's model of ``--compression`` when
``clawcomm plan --search-compression`` makes it a dimension of the search.

Only the codecs whose wire size follows from the gradient's size are
costed: fp16 and bf16 (``HalfPrecision``: the engine's 16-bit ring with
float32 accumulation, half the bytes of a float32 all-reduce), and the
block quantisers int8 and int4 (a reduce-scatter of codes, each rank's
part re-quantised and all-gathered as codes: ``bits / 32`` of the float32
bytes plus one float32 scale per 256 values, each stage; under ZeRO only
the reduce-scatter). Their encode and decode passes are timed here, on
this machine, on the rank's gradient size. Sparse and low-rank methods
(top-k, PowerSGD, ...) send what the data decides, and change what the
model learns more than a wire format does; the plan leaves them to the
compression lab (``clawcomm experiment compression``).
"""

from __future__ import annotations

import statistics
import time

# spec -> (bits per value on the wire, reduced as 16-bit floats by the engine)
WIRES = {"": (32, False), "fp16": (16, True), "bf16": (16, True), "int8": (8, False),
         "int4": (4, False)}  # fmt: skip
BLOCK = 256  # values per float32 scale (the quantisers' default)


def check_specs(specs: list[str]) -> list[str]:
    """The searched compressions ('' for none), or ValueError naming the
    one the plan cannot cost."""
    out = []
    for s in specs:
        s = "" if s in ("none", "") else s
        if s not in WIRES:
            raise ValueError(
                f"--search-compression {s!r}: the plan costs dense wires only "
                f"(none, {', '.join(k for k in WIRES if k)}); compare others with "
                "clawcomm experiment compression"
            )
        if s not in out:
            out.append(s)
    return out


def codec_seconds(spec: str, elems: int, repeats: int = 5) -> float:
    """One encode and one decode-and-add of ``elems`` float32 values with
    ``spec``'s codec on this machine (the median of ``repeats``); 0 for a
    16-bit wire, whose conversion the engine does inside its ring."""
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


def reduction_seconds(spec: str, zero: int, nbytes: float, layout, cost, codec_s: float) -> float:
    """A reduction of ``nbytes`` of float32 gradients over ``layout`` with
    ``spec`` on the wire: an all-reduce (ZeRO: a reduce-scatter), in the
    cost model, plus the codec's passes (``codec_s`` per encode and decode of
    the whole gradient: the quantisers encode and decode once a stage)."""
    from clawcomm.model import predict as comm_time

    bits, sixteen = WIRES[spec]
    if bits == 32 or sixteen:
        wire = nbytes * bits / 32
        return comm_time("all_reduce" if zero == 0 else "reduce_scatter", "auto", wire, layout,
                         cost)  # fmt: skip
    wire = nbytes * (bits / 32 + 1 / BLOCK)
    stages = 1 if zero else 2
    scatter = comm_time("reduce_scatter", "auto", wire, layout, cost)
    gather = comm_time("all_gather", "auto", wire, layout, cost) if stages == 2 else 0.0
    return scatter + gather + stages * codec_s
