"""``clawcomm bench --calibrate FILE``: measures the cost model's building
blocks and writes a model file (clawcomm.cost_model.CostModel) for
``CLAWCOMM_COST_MODEL`` and ``clawcomm simulate``.

    clawcomm bench --calibrate model.json     # one host: the "network" is TCP on loopback
    torchrun --nnodes 2 --nproc-per-node 2 ... -m clawcomm.cli bench --calibrate model.json

* shm_alpha, shm_beta: ping-pong between two ranks of one host (shared
  memory), 8 B .. 4 MiB: alpha is the one-way time of 8 bytes, beta the
  slope of the one-way time between 1 and 4 MiB.
* net_alpha, net_beta: the same between ranks on two hosts (TCP).
* gamma: the float32 sum kernel over 64 MiB, per byte.

Building blocks, not whole collectives, as ASTRA-sim and SimAI calibrate:
the collectives are then predicted from these, and bench/model_validation.py
compares the predictions with measured times.

Each figure is measured ROUNDS times (the ping-pongs in rounds that
alternate shared memory and TCP, so that a slow stretch of the machine hits
both alike); the model takes the median, the file records every round's
value and the spread (the largest over the smallest), and a spread over
SPREAD_WARN, or shared memory slower than TCP, is printed as a warning.
"""

from __future__ import annotations

import os
import time

import numpy as np

SIZES = [8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20]
ROUNDS = 5
SPREAD_WARN = 1.25  # the largest round over the smallest


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """alpha: the one-way time of the smallest message; beta: the slope
    between the two largest. (A least-squares fit over all sizes would let
    the small ones, which a shaped link's token bucket lets through at
    full speed, pull beta far below the link's rate.)"""
    (s0, t0), (s1, t1), (s2, t2) = points[0], points[-2], points[-1]
    beta = max((t2 - t1) / (s2 - s1), 1e-13)
    return max(t0 - s0 * beta, 1e-7), beta


def _ping_pong(engine, me: int, peer: int, first: bool, budget_s: float = 0.1):
    """One-way seconds per size between `me` and `peer` (best of repeats)."""
    out = []
    for size in SIZES:
        buf = np.zeros(size, dtype=np.uint8)
        # Both sides agree on the repeat count: from the size alone.
        reps = max(3, min(200, int(budget_s / max(1e-5, size * 1e-9 * 4))))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            if first:
                engine.send(buf, peer)
                engine.recv(buf, peer)
            else:
                engine.recv(buf, peer)
                engine.send(buf, peer)
            best = min(best, (time.perf_counter() - t0) / 2)
        out.append((size, best))
    return out


def _gamma() -> float:
    from clawcomm import _C

    n = 16 << 20  # float32: 64 MiB
    dst, src = np.ones(n, dtype=np.float32), np.ones(n, dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _C.kernels.reduce(dst, src, "sum")
        best = min(best, time.perf_counter() - t0)
    return best / (4 * n)


def summarise(rounds: list[dict]) -> tuple[dict, dict]:
    """(median of each figure over the rounds, {figure: {"rounds": [...],
    "spread": largest / smallest}})."""
    out, spread = {}, {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        out[key] = float(np.median(values))
        spread[key] = {"rounds": values, "spread": max(values) / max(min(values), 1e-30)}
    return out, spread


def warnings_of(model, spread: dict) -> list[str]:
    """What a user should not trust in a calibration: a spread over
    SPREAD_WARN, shared memory slower than TCP."""
    out = []
    for key, s in spread.items():
        if s["spread"] > SPREAD_WARN:
            out.append(
                f"{key} varied {s['spread']:.2f}x over {len(s['rounds'])} rounds: the machine was "
                "busy or its speed changed; calibrate again on a quiet machine"
            )
    if "shm_alpha" in spread and "net_alpha" in spread and model.shm_alpha > model.net_alpha:
        out.append(
            f"shared memory came out slower than TCP (alpha {model.shm_alpha * 1e6:.1f} us "
            f"against {model.net_alpha * 1e6:.1f} us): not what the machine does at rest"
        )
    return out


def calibrate_rank(rank: int, world: int, transports: list[str]) -> dict | None:
    """Runs on every rank of a group; returns the model's numbers on rank 0.
    Rank 0 ping-pongs with its first shared-memory peer, then with its first
    TCP peer; the others wait at barriers."""
    import torch.distributed as dist

    import clawcomm

    engine = clawcomm.engine_of()
    peers = {kind: next((p for p, t in enumerate(transports) if t == kind), None)
             for kind in ("shm", "tcp")}  # fmt: skip
    # Every rank learns rank 0's peers (the others' transports differ).
    plan = [peers["shm"] if peers["shm"] is not None else -1,
            peers["tcp"] if peers["tcp"] is not None else -1]  # fmt: skip
    dist.broadcast_object_list(plan, src=0)
    rounds: list[dict] = []
    points: dict[str, list] = {}
    for _ in range(ROUNDS):
        figures: dict = {}
        for kind, prefix, peer in zip(("shm", "tcp"), ("shm", "net"), plan, strict=True):
            dist.barrier()
            if peer < 0:
                continue
            if rank == 0:
                points[kind] = _ping_pong(engine, 0, peer, first=True)
                figures[f"{prefix}_alpha"], figures[f"{prefix}_beta"] = _fit(points[kind])
            elif rank == peer:
                _ping_pong(engine, peer, 0, first=False)
        if rank == 0:
            figures["gamma"] = _gamma()
            rounds.append(figures)
    dist.barrier()
    if rank != 0:
        return None
    out, spread = summarise(rounds)
    return {**out, "points": points, "spread": spread}


def _local_rank(rank: int, world: int) -> dict | None:
    from clawcomm import backend_of

    transports = [backend_of().transport_of(p) for p in range(world)]
    return calibrate_rank(rank, world, transports)


def run(path: str, torchrun: bool) -> int:
    """`clawcomm bench --calibrate`: on local ranks (two on one host, one
    on a pretend second host over TCP), or on torchrun's ranks."""
    from clawcomm.cost_model import CostModel

    if torchrun:
        import torch.distributed as dist

        import clawcomm  # noqa: F401

        dist.init_process_group("clawcomm")
        try:
            numbers = _local_rank(dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
        if numbers is None:
            return 0
        where = f"{os.environ.get('WORLD_SIZE')} ranks under torchrun"
    else:
        from clawcomm.launch import run_ranks

        hosts = [{"CLAWCOMM_HOST_ID": h} for h in ("calibrate-a", "calibrate-a", "calibrate-b")]
        numbers = run_ranks(_local_rank, 3, rank_env=hosts, timeout=300)[0]
        where = "one host (network: TCP on loopback)"
    defaults = CostModel()
    keys = ("shm_alpha", "shm_beta", "net_alpha", "net_beta", "gamma")
    model = CostModel(**{k: numbers.get(k, getattr(defaults, k)) for k in keys})
    missing = [k for k in ("shm", "tcp") if k not in numbers["points"]]
    model.save(path, measured_on=where, not_measured=missing, points=numbers["points"],
               rounds=ROUNDS, spread=numbers["spread"])  # fmt: skip
    print(f"clawcomm bench --calibrate: wrote {path} ({where}; the median of {ROUNDS} rounds)")
    for what, alpha, beta in (
        ("shared memory:", model.shm_alpha, model.shm_beta),
        ("network:", model.net_alpha, model.net_beta),
    ):
        print(f"  {what:<15}alpha {alpha * 1e6:.1f} us, {1 / beta / 1e9:.3f} GB/s")
    print(f"  reduction:     {1 / model.gamma / 1e9:.2f} GB/s")
    spreads = ", ".join(f"{k} {v['spread']:.2f}x" for k, v in numbers["spread"].items())
    print(f"  spread (largest round / smallest): {spreads}")
    for w in warnings_of(model, numbers["spread"]):
        print(f"  warning: {w}")
    if missing:
        print(f"  not measured (no such peer), defaults kept: {', '.join(missing)}")
    return 0
