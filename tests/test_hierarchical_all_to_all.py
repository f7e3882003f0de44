"""The two-stage (hierarchical) all-to-all over fake hosts: shared memory
inside each host, TCP across (CLAWCOMM_HOST_ID per rank).

Uneven random splits (zero-sized blocks, a rank that sends nothing, odd
sizes) in several dtypes, through the raw engine on numpy and through
torch's ``all_to_all_single`` and ``all_to_all``, forced and under auto,
each against values every rank computes locally; hosts of different sizes
fall back to the pairwise all-to-all.
"""

from __future__ import annotations

import json
import os
import signal
import time
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _cases import check

import clawcomm
from clawcomm.launch import RankFailure, run_ranks


def _hosts(*layout, interleaved=False):
    """rank_env for ranks on fake hosts: _hosts(2, 2) is two hosts of two,
    ranks numbered host by host (or dealt round-robin when interleaved)."""
    if interleaved:
        hosts = [h for j in range(max(layout)) for h, k in enumerate(layout) if j < k]
    else:
        hosts = [h for h, k in enumerate(layout) for _ in range(k)]
    return [{"CLAWCOMM_HOST_ID": f"host-{h}"} for h in hosts]


def _splits(case: str, n: int) -> np.ndarray:
    """splits[i][j]: elements rank i sends rank j. Random, many zero, some
    large (from 1 MiB, by single copy over shared memory) and odd; one rank
    (chosen by the case) sends nothing at all."""
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    sizes = rng.choice([0, 0, 1, 3, 7, 13, 1000, 4099, 70_001, 300_001], size=(n, n))
    sizes[rng.integers(n)] = 0
    return sizes


def _block(case: str, src: int, dst: int, count: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{src}/{dst}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 101)
    return torch.randint(lo, hi, (count,), generator=g).to(dtype)


def _case_inputs(case, rank, n, dtype):
    """This rank's input, the output it should receive, and the splits."""
    sizes = _splits(case, n)
    send = torch.cat([_block(case, rank, j, int(sizes[rank][j]), dtype) for j in range(n)])
    want = torch.cat([_block(case, i, rank, int(sizes[i][rank]), dtype) for i in range(n)])
    return send, want, sizes


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
NUMPY = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "uint8": np.uint8}


def _through_torch(rank, n, cases):
    failures = []
    for case in cases:
        for dtype in DTYPES:
            name = f"{case}/{dtype}"
            send, want, sizes = _case_inputs(name, rank, n, dtype)
            out = torch.empty(want.numel(), dtype=dtype)
            dist.all_to_all_single(
                out, send, [int(sizes[i][rank]) for i in range(n)], sizes[rank].tolist()
            )
            check(failures, f"all_to_all_single/{name}", out, want)
            # The list form, in 2-D rows: counts in elements of every row.
            rows = [t.reshape(-1, 1).repeat(1, 3) for t in send.split(sizes[rank].tolist())]
            outs = [torch.empty(int(sizes[i][rank]), 3, dtype=dtype) for i in range(n)]
            dist.all_to_all(outs, rows)
            check(failures, f"all_to_all/{name}", torch.cat(outs)[:, 1], want)
        # An even split, as torch's all_to_all_single without sizes sends it.
        blocks = torch.arange(n * 5, dtype=torch.int32) + 100 * rank
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out, blocks)
        want = torch.cat([torch.arange(rank * 5, rank * 5 + 5, dtype=torch.int32) + 100 * i
                          for i in range(n)])  # fmt: skip
        check(failures, f"all_to_all_single/even/{case}", out, want)
    record = json.loads(clawcomm.engine_of().flight_record())
    algos = sorted({o["algo"] for o in record["ops"] if o["op"] == "all_to_all"})
    return failures, algos


def _through_the_engine(rank, n, cases):
    eng = clawcomm.engine_of()
    failures = []
    for case in cases:
        for dtype in NUMPY:
            name = f"{case}/{dtype}"
            sizes = _splits(name, n)
            send, want, _ = _case_inputs(name, rank, n, torch.int64)
            send, want = send.numpy().astype(NUMPY[dtype]), want.numpy().astype(NUMPY[dtype])
            out = np.full(want.size, 77, NUMPY[dtype])
            eng.all_to_all(
                send, out, send_counts=sizes[rank].tolist(), recv_counts=sizes[:, rank].tolist()
            )
            if not np.array_equal(out, want):
                bad = np.flatnonzero(out != want)
                failures.append(f"engine {name}: {bad.size} wrong from element {bad[0]}")
    record = json.loads(eng.flight_record())
    algos = sorted({o["algo"] for o in record["ops"] if o["op"] == "all_to_all"})
    return failures, algos


LAYOUTS = {
    "2x2": _hosts(2, 2),
    "2x3": _hosts(3, 3),
    "3x2": _hosts(2, 2, 2),
    "2x2-interleaved": _hosts(2, 2, interleaved=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forced_hierarchical_matches_local_values(layout):
    ranks = LAYOUTS[layout]
    env = {"CLAWCOMM_ALGO": "all_to_all:hierarchical"}
    cases = [f"{layout}/{c}" for c in range(3)]
    for body in (_through_torch, _through_the_engine):
        results = run_ranks(body, len(ranks), cases, rank_env=ranks, env=env, timeout=300)
        failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
        assert not failures, "\n".join(failures[:40])
        assert {tuple(a) for _, a in results} == {("hierarchical",)}, results


@pytest.mark.parametrize("layout", ["2x2", "3x2"])
def test_auto_matches_local_values(layout):
    """Whatever auto picks, every rank picks the same and gets it right."""
    ranks = LAYOUTS[layout]
    results = run_ranks(_through_torch, len(ranks), [f"auto/{layout}"], rank_env=ranks)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])
    assert len({tuple(a) for _, a in results}) == 1, results


def test_uneven_hosts_fall_back_to_pairwise():
    ranks = _hosts(2, 1)
    env = {"CLAWCOMM_ALGO": "all_to_all:hierarchical"}
    results = run_ranks(_through_torch, 3, ["uneven-hosts"], rank_env=ranks, env=env)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])
    assert {tuple(a) for _, a in results} == {("pairwise",)}, results


def _wrong_split(rank, n):
    """Rank 0 says it sends rank 3 one element more than rank 3 expects,
    and rank 1 one fewer: every message's total still matches."""
    counts = [[4] * n for _ in range(n)]
    counts[0][3], counts[1][3] = 5, 3
    send = torch.zeros(sum(counts[rank]))
    out = torch.zeros(4 * n)
    dist.all_to_all_single(out, send, [4] * n, counts[rank])


def test_split_sizes_that_disagree_are_an_error():
    env = {"CLAWCOMM_ALGO": "all_to_all:hierarchical"}
    with pytest.raises(RankFailure, match="rank 0 sent 20 bytes to rank 3, which expected 16"):
        run_ranks(_wrong_split, 4, rank_env=_hosts(2, 2), env=env, timeout=60)


def _bad_then_good(rank, n):
    """Arguments that cannot work raise on the caller's thread before any
    byte moves: the group is still in step for the next all-to-all."""
    eng = clawcomm.engine_of()
    errors = []
    for call in (
        lambda: eng.all_to_all(np.zeros(4, np.float32), np.zeros(4, np.float32),
                               send_counts=[2] + [1] * (n - 2), recv_counts=[1] * n),
        lambda: eng.all_to_all(np.zeros(4, np.float32), np.zeros(4, np.float32),
                               send_counts=[1] * n, recv_counts=[2] * n),
        lambda: eng.all_to_all(np.zeros(4, np.float32), np.zeros(4, np.float32),
                               send_counts=[1] * n),
    ):  # fmt: skip
        try:
            call()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    out = torch.empty(n, dtype=torch.int32)
    dist.all_to_all_single(out, torch.full((n,), rank, dtype=torch.int32))
    return errors, out.tolist()


def test_bad_arguments_raise_before_anything_is_sent():
    env = {"CLAWCOMM_ALGO": "all_to_all:hierarchical"}
    results = run_ranks(_bad_then_good, 4, rank_env=_hosts(2, 2), env=env)
    for errors, out in results:
        assert "send counts has 3 entries for a group of 4 ranks" in errors[0], errors
        assert "recv_counts add up to 8 elements, the output has 4" in errors[1], errors
        assert "give both send_counts and recv_counts" in errors[2], errors
        assert out == [0, 1, 2, 3]


def _killed_mid_all_to_all(rank, n):
    send = torch.ones(n * (1 << 18))
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send)  # everybody is connected and working
    if rank == n - 1:
        dist.all_to_all_single(out, send, async_op=True)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_to_all_single(out, send)
        error = "no error"
    except Exception as e:  # noqa: BLE001
        error = str(e)
    return error, time.monotonic() - start


def test_a_killed_rank_fails_the_others_instead_of_hanging():
    env = {"CLAWCOMM_ALGO": "all_to_all:hierarchical"}
    results = run_ranks(_killed_mid_all_to_all, 4, rank_env=_hosts(2, 2), env=env,
                        pg_timeout=20, timeout=90, allow_failures=True)  # fmt: skip
    assert isinstance(results[3], RankFailure)
    for error, elapsed in results[:3]:
        assert "rank 3" in error or "aborted by an earlier error" in error, error
        assert elapsed < 20, f"took {elapsed:.1f} s to notice"


def _one_all_to_all(rank, n):
    out = torch.empty(n * 3)
    dist.all_to_all_single(out, torch.ones(n * 3))
    return "no error"


def test_ranks_that_choose_differently_fail_instead_of_hanging():
    """Rank 0 forced hierarchical, the others pairwise: each frame carries
    its algorithm, so the first that meets a rank of the other kind fails
    it, and the failure reaches every rank."""
    ranks = _hosts(2, 2)
    ranks[0] = {**ranks[0], "CLAWCOMM_ALGO": "all_to_all:hierarchical"}
    results = run_ranks(_one_all_to_all, 4, rank_env=ranks, pg_timeout=5, timeout=60,
                        allow_failures=True)  # fmt: skip
    texts = [next(iter(r.errors.values())) for r in results if isinstance(r, RankFailure)]
    assert any("hierarchical algorithm" in t and "pairwise algorithm" in t for t in texts), texts
    assert len(texts) >= 2, results
