"""Every hang named (issue 63, item 3): the rank that holds a group up is
named by rank, host and pid in every other rank's error, in a sub-group by
its global rank, by torch's monitored barrier, and on the first line of
`clawcomm flight`. The fault sweep itself is the chaos suite's hang family
(tests/chaos/, bench/chaos.py)."""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest

from clawcomm.flight import report
from clawcomm.launch import run_ranks

TIMEOUT = 2.0


def _late_rank(rank, ws, victim, sub):
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=TIMEOUT)
    group = dist.new_group(list(range(1, ws)), timeout=timeout) if sub else None
    x = torch.ones(8)
    if sub and rank == 0:
        return ("not in the group", 0.0, os.getpid())
    dist.all_reduce(x, group=group)
    if rank == victim:
        time.sleep(TIMEOUT + 1.5)
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        return ("no error", 0.0, os.getpid())
    except RuntimeError as e:
        return (str(e), time.monotonic() - start, os.getpid())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_asleep_before_a_collective_is_named_by_every_other(transport):
    results = run_ranks(
        _late_rank, 3, 2, False, env={"CLAWCOMM_TRANSPORT": transport}, pg_timeout=TIMEOUT
    )
    pid = results[2][2]
    for text, waited, _ in results[:2]:
        assert waited <= TIMEOUT + 1.0, (waited, text)
        assert "held up by rank 2 (host " in text and f"pid {pid}): " in text, text
        assert "has not called collective #1: it last completed all_reduce #0" in text, text
        assert "and has run its own code since" in text, text


def test_in_a_sub_group_the_culprit_is_named_by_its_global_rank():
    results = run_ranks(_late_rank, 4, 3, True, pg_timeout=TIMEOUT)
    pid = results[3][2]
    for text, _, _ in results[1:3]:
        assert "held up by rank 3 (group rank 2, host " in text, text
        assert f"pid {pid}): has not called collective #1" in text, text


def _monitored(rank, ws, absent):
    import torch.distributed as dist

    dist.barrier()
    if rank in absent:
        time.sleep(2.5)
        return "absent"
    try:
        dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=1), True)
        return "passed"
    except RuntimeError as e:
        return str(e)


def test_the_monitored_barrier_names_every_rank_that_did_not_come():
    results = run_ranks(_monitored, 4, {1, 3})
    for text in (results[0], results[2]):
        assert "clawcomm::barrier: timeout after 1 s" in text, text
        assert "held up by rank 1 (host " in text and "; and by rank 3 (host " in text, text
        assert "has not called collective #1" in text, text


def _both_come(rank, ws):
    import torch.distributed as dist

    dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=5), False)
    dist.all_reduce(__import__("torch").ones(1))  # and the group goes on after it
    return "passed"


def test_the_monitored_barrier_passes_when_every_rank_comes():
    assert run_ranks(_both_come, 3) == ["passed"] * 3


def _record(rank, why, culprit=None, seq_state=("done", "started")):
    ops = [
        {"id": i + 1, "seq": i, "op": "all_reduce", "dtype": "float32", "count": 8, "peer": -1,
         "root": -1, "algo": "default", "bytes": 32, "state": s, "start_us": 0, "end_us": 0}
        for i, s in enumerate(seq_state)
    ]  # fmt: skip
    out = {"rank": rank, "size": 3, "why": why, "ops": ops}
    if culprit:
        out["culprit"] = culprit
    return out


def test_clawcomm_flight_names_the_culprit_on_its_first_line(tmp_path):
    verdict = "held up by rank 2 (host h, pid 7): has not called collective #1"
    (tmp_path / "rank0.json").write_text(
        json.dumps(_record(0, f"timeout ...; {verdict}", culprit=verdict))
    )
    # A rank that failed on its peer's word carries the verdict in its error.
    (tmp_path / "rank1.json").write_text(
        json.dumps(_record(1, f"rank 0 failed: timeout ...; {verdict} (flight record: /x)"))
    )
    lines = report(str(tmp_path))
    assert lines[0] == "culprit: rank 2 (host h, pid 7): has not called collective #1", lines
    assert any("ranks [2] wrote no flight record" in line for line in lines), lines


def test_clawcomm_flight_without_a_verdict_keeps_its_report(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps(_record(0, "rank 1 died")))
    assert report(str(tmp_path))[0] == "rank 0 failed: rank 1 died"
