"""Deterministic inputs and locally computed expectations shared by the tests.

Every rank can rebuild every other rank's input from (case, rank), so each
rank computes the expected result of a collective on its own, with torch, and
compares it with what came over the wire.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
# Sizes that catch off-by-ones: empty, one, odd, not divisible by 2, 3 or 4.
SIZES = [0, 1, 7, 13, 1000]


def op_applies(dtype: torch.dtype, op: str) -> bool:
    if op == "avg":
        return dtype in FLOATS
    if op in ("band", "bor", "bxor"):
        return dtype not in FLOATS
    return True


def make_input(case: str, rank: int, n: int, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    """Small integer-valued data, so sums and products are exact in every dtype."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if op == "product":
        vals = torch.tensor([1, 2, 1, 1] if dtype == torch.uint8 else [-2, -1, 1, 2])
        return vals[torch.randint(0, 4, (n,), generator=g)].to(dtype)
    lo, hi = (0, 16) if dtype == torch.uint8 else (-8, 9)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def expected_reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(tensors)
        if op in ("sum", "max", "bor"):
            return stacked.any(0)
        if op in ("product", "min", "band"):
            return stacked.all(0)
        return stacked.to(torch.uint8).sum(0).remainder(2).bool()  # bxor
    wide = torch.float64 if dtype in FLOATS else torch.int64
    stacked = torch.stack([t.to(wide) for t in tensors])
    if op == "sum":
        out = stacked.sum(0)
    elif op == "avg":
        out = stacked.sum(0) / len(tensors)
    elif op == "product":
        out = stacked.prod(0)
    elif op == "min":
        out = stacked.min(0).values
    elif op == "max":
        out = stacked.max(0).values
    else:
        out = stacked[0].clone()
        for t in stacked[1:]:
            out = {"band": out & t, "bor": out | t, "bxor": out ^ t}[op]
    # Inputs are small enough that no result overflows its dtype.
    return out.to(dtype)


def check(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        if got.dtype in FLOATS:
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-2 if got.element_size() == 2 else 1e-6,
                atol=1e-2 if got.element_size() == 2 else 1e-6,
            )
        else:
            assert torch.equal(got, want), f"{got[:8]} != {want[:8]}"
    except AssertionError as e:
        failures.append(f"{what}: {str(e)[:300]}")


def normal_grad(seed: int, n: int) -> torch.Tensor:
    """n float32 draws from a standard normal, the same for the same seed."""
    import numpy as np

    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
