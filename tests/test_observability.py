"""What users see of clawcomm's operations: torch.profiler spans."""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks


def _profiled(rank, n):
    from torch.profiler import ProfilerActivity, profile

    t = torch.ones(1000)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        out = torch.empty(1000 * n)
        dist.all_gather_into_tensor(out, t)
        dist.barrier()
    return sorted({e.name for e in prof.events() if e.name.startswith("clawcomm:")})


def test_collectives_appear_as_spans_in_torch_profiler():
    for names in run_ranks(_profiled, 2, timeout=120):
        for want in ("clawcomm:allreduce", "clawcomm:broadcast", "clawcomm:_allgather_base"):
            assert want in names, names


def _traced(rank, n, trace, timeline):
    from clawcomm.train.cli import train_rank
    from clawcomm.train.config import TrainConfig

    cfg = TrainConfig(
        model="mlp", hidden=32, dp=2, pp=2, steps=3, microbatches=4, micro_batch_size=2,
        schedule="1f1b", quiet=True, trace=trace, timeline=timeline,
    )  # fmt: skip
    return len(train_rank(cfg, announce=False))


def test_trace_has_every_rank_both_tracks_and_nested_events_on_one_clock(tmp_path):
    import json

    trace, timeline = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    assert run_ranks(_traced, 4, trace, timeline, timeout=180) == [3] * 4
    events = json.load(open(trace))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    for rank in range(4):
        mine = [e for e in spans if e["pid"] == rank]
        cats = {e["cat"] for e in mine}  # (and "data", where a step waited for its batch)
        assert cats - {"data"} == {"compute", "communication", "steps", "engine ops"}, cats
        engine = [e for e in mine if e["cat"] == "engine ops"]
        assert any(e["name"].startswith("dp all_reduce") for e in engine), engine[:5]
        assert any(e["name"].startswith("pp send") for e in engine), engine[:5]
        steps = sorted((e for e in mine if e["cat"] == "steps"), key=lambda e: e["ts"])
        assert len(steps) == 3
        # every compute event lies inside one of the rank's steps
        for e in mine:
            if e["cat"] == "compute":
                assert any(
                    s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                    for s in steps
                ), e
        kinds = {e["args"].get("kind") for e in mine if e["cat"] == "compute"}
        assert {"F", "B", "opt"} <= kinds, kinds
    # one clock: every rank's step k overlaps every other rank's step k
    by_rank = {
        r: sorted(
            (e for e in spans if e["pid"] == r and e["cat"] == "steps"), key=lambda e: e["ts"]
        )
        for r in range(4)
    }
    for k in range(3):
        starts = [by_rank[r][k]["ts"] for r in range(4)]
        ends = [by_rank[r][k]["ts"] + by_rank[r][k]["dur"] for r in range(4)]
        assert max(starts) < min(ends), (k, starts, ends)
    assert (tmp_path / "t.png").stat().st_size > 10_000


def _recorded(rank, n):
    import json

    import clawcomm

    t = torch.ones(8)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
    rec = json.loads(clawcomm.engine_of().flight_record())
    return rec


def test_the_recorder_keeps_every_operation_with_its_state():
    for rank, rec in enumerate(run_ranks(_recorded, 2, timeout=120)):
        ops = rec["ops"]
        assert rec["rank"] == rank and rec["size"] == 2
        names = [o["op"] for o in ops]
        assert "all_reduce" in names and "broadcast" in names, names
        assert ("send" if rank == 0 else "recv") in names, names
        assert all(o["state"] == "done" for o in ops), ops
        assert all(o["end_us"] >= o["start_us"] > 0 for o in ops), ops
        ar = next(o for o in ops if o["op"] == "all_reduce")
        assert (ar["count"], ar["dtype"], ar["bytes"]) == (8, "float32", 32)
        # Each collective's algorithm, as CLAWCOMM_ALGO names it.
        bc = next(o for o in ops if o["op"] == "broadcast")
        assert (ar["algo"], bc["algo"]) == ("tree", "tree"), (ar, bc)


def _mismatch(rank, n, flight_dir):
    t = torch.ones(4)
    dist.all_reduce(t)
    try:
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, 0)
    except Exception as e:  # the mismatch: every rank fails with a flight record
        return str(e)
    return "no error"


def _timeout(rank, n, flight_dir):
    import time

    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(4)  # never joins the next collective in time
        return "slept"
    try:
        dist.all_reduce(t)
    except Exception as e:
        return str(e)
    return "no error"


def _flight_dir_of(messages):
    import re

    paths = [re.search(r"flight record: (\S+?)\)", m) for m in messages]
    found = [p.group(1) for p in paths if p]
    assert found, messages
    import os

    return os.path.dirname(found[0])


def test_flight_records_name_the_mismatch(tmp_path):
    from clawcomm import flight

    env = {"CLAWCOMM_FLIGHT_DIR": str(tmp_path)}
    msgs = run_ranks(_mismatch, 2, str(tmp_path), env=env, timeout=120, pg_timeout=10)
    lines = flight.diagnose(flight.load(_flight_dir_of(msgs)))
    text = "\n".join(lines)
    assert "collective #1 differs between ranks" in text, text
    assert "rank 0: all_reduce #1" in text and "rank 1: broadcast #1" in text, text


def test_flight_records_name_the_rank_missing_after_a_timeout(tmp_path):
    from clawcomm import flight

    env = {"CLAWCOMM_FLIGHT_DIR": str(tmp_path)}
    out = run_ranks(_timeout, 2, str(tmp_path), env=env, timeout=120, pg_timeout=1)
    assert out[1] == "slept" and "timeout" in out[0], out
    lines = flight.diagnose(flight.load(_flight_dir_of([out[0]])))
    text = "\n".join(lines)
    assert "all_reduce #1" in text and "(rank 0 failed)" in text, text
    assert "ranks [1] wrote no flight record" in text, text
    assert "rank 1" in text, text  # no record, or missing from #1


def test_recording_can_be_turned_off():
    def body(rank, n):
        import json

        import clawcomm

        dist.all_reduce(torch.ones(2))
        return json.loads(clawcomm.engine_of().flight_record())["ops"]

    assert run_ranks(body, 2, env={"CLAWCOMM_RECORDER_ENTRIES": "0"}, timeout=60) == [[], []]
