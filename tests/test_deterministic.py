"""CLAWCOMM_DETERMINISTIC=1 (docs/deterministic.md): every reduction adds its
inputs in one canonical tree over the ranks, whatever the algorithm named,
the transport (shared memory, TCP between fake hosts, both), the segment size
and the timing.

Each rank rebuilds every rank's input, computes the canonical tree locally
with torch (one element-wise a op b per node, 16-bit floats widened to
float32 and rounded once per node, as the engine's kernels do) and compares
what came over the wire with it bit for bit, through torch.distributed and
through the raw engine, for the all-reduce, reduce-scatter and reduce.
test_order_shows_without_the_mode checks that the data would catch another
order: without the mode, the ring and the one-shot all-reduce differ on it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import clawcomm
from clawcomm.launch import run_ranks

# CLAWCOMM_ALGO for each group, every reduction algorithm named somewhere;
# the mode overrides them all. "tiny" cuts every chunk into many segments
# and wraps every frame around a small shared-memory ring.
CONFIGS = {
    "auto": {},
    "ring": {"CLAWCOMM_ALGO": "all_reduce:ring,reduce_scatter:ring,reduce:tree"},
    "tree": {"CLAWCOMM_ALGO": "all_reduce:tree,reduce_scatter:direct,reduce:reducescatter_gather"},
    "oneshot": {"CLAWCOMM_ALGO": "all_reduce:oneshot,reduce_scatter:hierarchical,reduce:tree"},
    "twoshot": {"CLAWCOMM_ALGO": "all_reduce:twoshot,reduce:reducescatter_gather"},
    "hierarchical": {"CLAWCOMM_ALGO": "hierarchical"},
    "tiny": {"CLAWCOMM_SEGMENT_BYTES": "4096", "CLAWCOMM_SHM_RING_BYTES": "8192"},
    # Every frame of 4 KiB or more by single copy (reductions too), and
    # every collective on the progress thread.
    "copy": {
        "CLAWCOMM_SINGLE_COPY": "all",
        "CLAWCOMM_SINGLE_COPY_BYTES": "4096",
        "CLAWCOMM_INLINE_BYTES": "0",
    },
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SIZES = [1, 7, 1000, 65537]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


def make_input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal draws scaled by powers of two from 2^-8 to 2^8: sums of such
    values round differently in different orders."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank * 7919 + n)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-8, 9, (n,), generator=g).double())
    return x.to(dtype)


def _node(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    wide = a.float() if a.element_size() == 2 else a
    other = b.float() if b.element_size() == 2 else b
    out = wide * other if op == "product" else wide + other
    return out.to(a.dtype)


def canonical(inputs: list[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """The canonical tree: for s = 1, 2, 4, ...: v[i] = v[i] op v[i+s] for
    every multiple i of 2s with i + s < n; AVG is the SUM divided once."""
    v = [t.clone() for t in inputs]
    n, s = len(v), 1
    while s < n:
        for i in range(0, n - s, 2 * s):
            v[i] = _node(v[i], v[i + s], "product" if op == "product" else "sum")
        s *= 2
    out = v[0]
    if op == "avg":
        if out.element_size() == 2:
            q = out.float().numpy() / np.float32(n)
            out = torch.from_numpy(q).to(out.dtype)
        else:
            out = torch.from_numpy(out.numpy() / out.numpy().dtype.type(n))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _compare(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or not torch.equal(bits(got), bits(want)):
        wrong = (bits(got) != bits(want)).sum().item() if got.shape == want.shape else "shape"
        failures.append(f"{what}: {wrong} of {want.numel()} elements differ from the tree")


def _sweep(rank: int, ws: int, configs: list[str], sizes: list[int], big: int) -> list[str]:
    """Every config's group in turn: all-reduce and reduce of `total`
    elements, reduce-scatter of max(1, total // ws) per rank; the `big` size
    (float32 sums) in the first config only."""
    failures: list[str] = []
    saved = dict(os.environ)
    for name in configs:
        os.environ.update({"CLAWCOMM_DETERMINISTIC": "1", **CONFIGS[name]})
        group = dist.new_group(list(range(ws)))
        os.environ.clear()
        os.environ.update(saved)
        algo = clawcomm.backend_of(group).all_reduce_algorithm(4096)
        if algo != "deterministic":
            failures.append(f"{name}: all_reduce_algorithm says {algo}")
        eng = clawcomm.engine_of(group)
        for dtype in DTYPES:
            more = [big] if dtype == torch.float32 and name == configs[0] else []
            for total in sizes + more:
                for op, redop in OPS.items():
                    if op != "sum" and (dtype != torch.float32 or total == big):
                        continue
                    case = f"{name}/{dtype}/{op}/{total}"
                    inputs = [make_input(1, r, total, dtype) for r in range(ws)]
                    want = canonical(inputs, op)
                    t = inputs[rank].clone()
                    dist.all_reduce(t, redop, group=group)
                    _compare(failures, f"all_reduce/{case}", t, want)
                    root = total % ws
                    t = inputs[rank].clone()
                    dist.reduce(t, root, redop, group=group)
                    _compare(failures, f"reduce/{case}", t, want if rank == root else inputs[rank])
                    n = max(1, total // ws)
                    rs_in = [make_input(2, r, n * ws, dtype) for r in range(ws)]
                    chunk = canonical(rs_in, op)[rank * n : (rank + 1) * n]
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(out, rs_in[rank].clone(), redop, group=group)
                    _compare(failures, f"reduce_scatter/{case}", out, chunk)
                    if op == "sum":
                        # Uneven splits: rank q gets (total + 5 q) % 11 elements.
                        counts = [(total + 5 * q) % 11 for q in range(ws)]
                        parts = [make_input(3, r, sum(counts), dtype) for r in range(ws)]
                        at = sum(counts[:rank])
                        mine = canonical(parts)[at : at + counts[rank]]
                        out = torch.empty(counts[rank], dtype=dtype)
                        dist.reduce_scatter(out, list(parts[rank].split(counts)), group=group)
                        _compare(failures, f"uneven reduce_scatter/{case}", out, mine)
                    if dtype in (torch.float32, torch.float64) and op == "sum":
                        a = inputs[rank].numpy().copy()
                        eng.all_reduce(a)
                        _compare(failures, f"engine all_reduce/{case}", torch.from_numpy(a), want)
                        a = inputs[rank].numpy().copy()
                        eng.reduce(a, root=root)
                        mine = want if rank == root else inputs[rank]
                        _compare(failures, f"engine reduce/{case}", torch.from_numpy(a), mine)
                        o = np.empty(n, dtype=a.dtype)
                        eng.reduce_scatter(rs_in[rank].numpy().copy(), o)
                        got = torch.from_numpy(o)
                        _compare(failures, f"engine reduce_scatter/{case}", got, chunk)
        if '"deterministic"' not in eng.flight_record():
            failures.append(f"{name}: the flight record does not name the deterministic algorithm")
        dist.destroy_process_group(group)
    return failures


def _layout(ws: int, layout: str) -> list[dict[str, str]] | None:
    if layout == "shm":
        return None
    if layout == "hosts":  # every rank its own host: TCP between every pair
        return [{"CLAWCOMM_HOST_ID": f"host-{r}"} for r in range(ws)]
    # Two hosts (shared memory inside, TCP across): the hierarchical layout
    # where they hold as many ranks each.
    return [{"CLAWCOMM_HOST_ID": f"host-{2 * r // ws}"} for r in range(ws)]


CASES = [(ws, lay) for ws in (2, 3, 4, 5) for lay in ("shm", "hosts", "mixed")]
CASES = [c for c in CASES if c != (2, "mixed")] + [(8, "shm"), (8, "mixed")]


@pytest.mark.parametrize("ws,layout", CASES)
def test_every_algorithm_gives_the_tree(ws, layout):
    """Every config on shared memory up to 4 ranks; beyond, and across
    hosts (where the direct algorithms fall back to the ring anyway), the
    ring, one-shot, hierarchical and tiny-segment ones."""
    few = ["ring", "oneshot", "hierarchical", "tiny", "copy"]
    configs = list(CONFIGS) if layout == "shm" and ws <= 4 else few
    sizes = SIZES if ws <= 5 else [1, 7, 1000]
    big = 1000003 if ws <= 5 else 100003
    results = run_ranks(_sweep, ws, configs, sizes, big, rank_env=_layout(ws, layout), timeout=600)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


def _without_mode(rank: int, ws: int, n: int) -> list[torch.Tensor]:
    out = []
    saved = dict(os.environ)
    for algo in ("ring", "oneshot"):
        os.environ["CLAWCOMM_ALGO"] = algo
        group = dist.new_group(list(range(ws)))
        os.environ.clear()
        os.environ.update(saved)
        t = make_input(1, rank, n, torch.float32)
        dist.all_reduce(t, group=group)
        out.append(t)
        dist.destroy_process_group(group)
    return out


def test_order_shows_without_the_mode():
    """Without CLAWCOMM_DETERMINISTIC the algorithms add in their own orders,
    and the data above shows it: the ring's and the one-shot's sums differ
    from each other and from the tree's."""
    ws, n = 4, 65537 * 4
    ring, oneshot = run_ranks(_without_mode, ws, n)[0]
    want = canonical([make_input(1, r, n, torch.float32) for r in range(ws)])
    assert not torch.equal(bits(ring), bits(oneshot))
    assert not torch.equal(bits(ring), bits(want))
    assert not torch.equal(bits(oneshot), bits(want))


def _refusals(rank: int, ws: int) -> list[str]:
    eng = clawcomm.engine_of()
    errors = []
    for call in (
        lambda: eng.all_reduce_16bit_wire(np.ones(8, np.float32)),
        lambda: eng.reduce_scatter_16bit_wire(np.ones(8, np.float32), np.ones(4, np.float32)),
    ):
        try:
            call()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            errors.append(str(e))
    return errors


def test_16bit_wire_is_refused():
    errors = run_ranks(_refusals, 2, env={"CLAWCOMM_DETERMINISTIC": "1"})[0]
    assert errors[0].startswith("clawcomm::all_reduce: a float16 wire"), errors[0]
    assert errors[1].startswith("clawcomm::reduce_scatter: a float16 wire"), errors[1]
    assert all("CLAWCOMM_DETERMINISTIC=1" in e for e in errors), errors


def _nothing(rank: int, ws: int) -> None:
    return None


def test_bad_value_is_refused():
    got = run_ranks(_nothing, 1, env={"CLAWCOMM_DETERMINISTIC": "yes"}, allow_failures=True)[0]
    assert "CLAWCOMM_DETERMINISTIC=yes is not one of 0, 1" in str(got), got
