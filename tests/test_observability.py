"""What users see of clawcomm's operations: torch.profiler spans."""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm.testing import run_ranks


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
        assert {e["cat"] for e in mine} == {"compute", "communication", "steps"}, rank
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
