"""What each benchmarked collective moves, and how its result is checked.

Pure numpy, shared by every runner (clawcomm and gloo through
torch.distributed, clawcomm's raw engine, MPI through mpi4py), so all of them
fill the same inputs and count wrong elements the same way.

Sizes follow nccl-tests: ``size`` is the larger of the input and output
buffers in bytes, ``count`` its elements. Bus bandwidth uses nccl-tests'
factors, so figures compare with what people quote for NCCL:

    all_reduce                         2 (n-1)/n
    reduce_scatter, all_gather,
    all_to_all, all_to_allv            (n-1)/n
    broadcast, reduce, sendrecv        1

``all_to_allv`` is the uneven all-to-all a mixture-of-experts layer makes:
every rank sends ``count`` elements, split over the receivers as a router
splits tokens over experts whose popularity falls off as a power law
(``uneven_splits``; ``--skew`` is its exponent, 0 near even). Every sender
favours the same receivers (a popular expert is popular everywhere), so
rank 0 receives the most: the size is what each rank sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REDOPS = ("sum", "prod", "min", "max", "avg")
# The --algo variant that is a group with CLAWCOMM_DETERMINISTIC=1 (its
# reductions: docs/deterministic.md) rather than a CLAWCOMM_ALGO value.
DETERMINISTIC = "deterministic"

# nccl-tests' type names, plus torch's, mapped to one canonical name each.
DTYPE_ALIASES = {
    "float": "float32",
    "float32": "float32",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "double": "float64",
    "float64": "float64",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
}
# nccl-tests prints these in its "type" column.
DTYPE_SHORT = {
    "float32": "float",
    "float16": "half",
    "bfloat16": "bfloat16",
    "float64": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}
# Guard elements past every output: a collective that writes past its
# buffer shows up as "out of bounds".
GUARD = 16


@dataclass(frozen=True)
class Collective:
    name: str
    has_redop: bool
    has_root: bool
    # Elements of (input, output) per rank for a `count`-element size.
    # None for the output means "in place".
    shape: str  # "inplace", "scatter" (in=count, out=count/n), "gather", "same", "uneven"
    skew: float = 0.0  # uneven: the popularity exponent (uneven_splits)

    def busbw_factor(self, n: int) -> float:
        if self.name == "all_reduce":
            return 2.0 * (n - 1) / n if n > 1 else 1.0
        if self.name in ("reduce_scatter", "all_gather", "all_to_all", "all_to_allv"):
            return (n - 1) / n if n > 1 else 1.0
        return 1.0

    def counts(self, count: int, n: int, rank: int = 0) -> tuple[int, int]:
        """(input elements, output elements) on ``rank`` (every rank alike
        but for an uneven all-to-all)."""
        if self.shape == "uneven":
            return count, int(uneven_splits(count, n, self.skew)[:, rank].sum())
        if self.shape == "scatter":
            return count, count // n
        if self.shape == "gather":
            return count // n, count
        return count, count

    def divisor(self, n: int) -> int:
        """`count` must be a multiple of this."""
        return n if self.shape in ("scatter", "gather") or self.name == "all_to_all" else 1


COLLECTIVES = {
    c.name: c
    for c in (
        Collective("all_reduce", True, False, "inplace"),
        Collective("reduce_scatter", True, False, "scatter"),
        Collective("all_gather", False, False, "gather"),
        Collective("broadcast", False, True, "inplace"),
        Collective("reduce", True, True, "inplace"),
        Collective("all_to_all", False, False, "same"),
        Collective("all_to_allv", False, False, "uneven", skew=1.0),
        Collective("sendrecv", False, False, "same"),
    )
}


def uneven_splits(count: int, n: int, skew: float) -> np.ndarray:
    """[sender, receiver] elements of an uneven all-to-all: each sender's
    ``count`` split in proportion to (receiver + 1) ** -skew (the rest of
    the rounding to receiver 0)."""
    weight = (np.arange(n) + 1.0) ** -skew
    row = np.floor(count * weight / weight.sum()).astype(np.int64)
    row[0] += count - row.sum()
    return np.tile(row, (n, 1))


def offsets(counts) -> list[int]:
    """Where each of ``counts``' blocks starts, laid end to end."""
    return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def element_count(coll: Collective, size: int, dtype: str, n: int) -> int:
    """The element count for a `size`-byte point: rounded down to what the
    collective can split evenly."""
    count = size // DTYPE_BYTES[dtype]
    d = coll.divisor(n)
    return count - count % d


def pattern(rank: int, count: int, redop: str, n: int) -> np.ndarray:
    """Rank `rank`'s input as float64 holding small integers, exact in every
    dtype and chosen so that no reduction over n ranks overflows int8."""
    i = np.arange(count, dtype=np.int64)
    if redop == "prod":
        # At most one rank holds a 2 at each element: products are 1 or 2.
        x = np.where((i + rank) % (n + 1) == 0, 2, 1)
    elif redop in ("min", "max"):
        x = (i * 7 + rank * 3) % 11
    else:
        x = (i + rank) % 3
    return x.astype(np.float64)


def _reduce(arrays: list[np.ndarray], redop: str) -> np.ndarray:
    stack = np.stack(arrays)
    if redop == "sum":
        return stack.sum(axis=0)
    if redop == "avg":
        return stack.mean(axis=0)
    if redop == "prod":
        return stack.prod(axis=0)
    if redop == "min":
        return stack.min(axis=0)
    return stack.max(axis=0)


def inputs(coll: Collective, rank: int, count: int, redop: str, n: int) -> np.ndarray:
    """This rank's input (float64; each runner casts it to the dtype)."""
    in_count, _ = coll.counts(count, n, rank)
    return pattern(rank, in_count, redop, n)


def expected(coll: Collective, rank: int, count: int, redop: str, root: int, n: int):
    """What this rank's output must hold, as float64, or None if unchecked
    (reduce on non-roots)."""
    ins = [inputs(coll, r, count, redop, n) for r in range(n)]
    if coll.name == "all_reduce":
        return _reduce(ins, redop)
    if coll.name == "reduce":
        return _reduce(ins, redop) if rank == root else None
    if coll.name == "reduce_scatter":
        chunk = count // n
        return _reduce(ins, redop)[rank * chunk : (rank + 1) * chunk]
    if coll.name == "all_gather":
        return np.concatenate(ins)
    if coll.name == "broadcast":
        return ins[root]
    if coll.name == "all_to_all":
        chunk = count // n
        return np.concatenate([ins[p][rank * chunk : (rank + 1) * chunk] for p in range(n)])
    if coll.name == "all_to_allv":
        splits = uneven_splits(count, n, coll.skew)
        return np.concatenate(
            [ins[p][offsets(splits[p])[rank] :][: splits[p][rank]] for p in range(n)]
        )
    if coll.name == "sendrecv":
        return ins[(rank - 1) % n]
    raise ValueError(f"unknown collective {coll.name}")


def count_wrong(got: np.ndarray, want: np.ndarray | None, dtype: str) -> int:
    """Elements of `got` (any numeric array) that differ from `want`."""
    if want is None:
        return 0
    got = np.asarray(got, dtype=np.float64)
    if dtype in ("float16", "bfloat16"):
        tol = 1e-2 * np.abs(want) + 1e-3
    elif dtype == "float32":
        tol = 1e-6 * np.abs(want) + 1e-7
    elif dtype == "float64":
        tol = 1e-12 * np.abs(want)
    else:
        tol = 0.0
    return int(np.count_nonzero(~(np.abs(got - want) <= tol)))
