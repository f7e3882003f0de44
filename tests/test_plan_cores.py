"""The plan where a host's CPU ranks outnumber its cores
(clawcomm/plan/shared_cores.py): each layout's step is at least the host's
CPU-seconds over its cores, a compute action costing what a short trial
measured beyond its profile; the trial runs only there, trains the layout
it says, and measures without the command's outputs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.plan import check as plan_check
from clawcomm.plan import search as plan
from clawcomm.plan import shared_cores as plan_cores
from clawcomm.plan.profile import Profile
from clawcomm.train.config import TrainConfig


def _profile(action_s: float = 0.0) -> Profile:
    """4 layers computing on the CPU: F 1 ms, B 2 ms (I and W 1 ms each)."""
    one, two = [1e-3] * 4, [2e-3] * 4
    return Profile([1e6] * 4, {4: one}, {4: two}, {4: [0.0] * 4}, {4: [4e3] * 4}, 0.0,
                   cpu_share={4: [1.0] * 4}, input_grad={4: one}, weight_grad={4: one},
                   action_s=action_s)  # fmt: skip


ONE_F = plan.Candidate(1, 4, "1f1b", 1, 8, 4, 0)
ZERO_BUBBLE = plan.Candidate(1, 4, "zb1", 1, 8, 4, 0)


def test_the_step_is_at_least_the_hosts_cpu_over_its_cores():
    # 4 ranks on 2 cores, each rank 8 micro-batches of 3 ms: 24 ms of CPU,
    # plus 1 ms for each compute action (16 for 1F1B, 24 for zero-bubble).
    # Both are bound by the host's CPU: (24 + 16) x 4 / 2 = 80 ms and
    # (24 + 24) x 4 / 2 = 96 ms, so zero-bubble, ahead while actions cost
    # nothing, falls behind. Taking turns, the ranks leave a core idle only
    # while fewer than 2 can run (the pipeline filling and draining).
    free = {c: plan.predict(c, _profile(), cores=2) for c in (ONE_F, ZERO_BUBBLE)}
    assert free[ZERO_BUBBLE].step_ms < free[ONE_F].step_ms
    costly = {c: plan.predict(c, _profile(1e-3), cores=2) for c in (ONE_F, ZERO_BUBBLE)}
    assert 80.0 - 1e-6 <= costly[ONE_F].step_ms < 80.0 * 1.1
    assert 96.0 - 1e-6 <= costly[ZERO_BUBBLE].step_ms < 96.0 * 1.1
    assert costly[ZERO_BUBBLE].step_ms > costly[ONE_F].step_ms
    # the time beyond the busiest rank's compute shows as a bubble does
    p = costly[ZERO_BUBBLE]
    assert p.compute_ms + p.bubble_ms == pytest.approx(p.step_ms)


def test_ranks_with_cores_of_their_own_or_gpus_pay_no_floor():
    for kw in ({"cores": 4}, {"cores": 2, "gpu": True}):
        for c in (ONE_F, ZERO_BUBBLE):
            free, costly = (plan.predict(c, _profile(a), **kw) for a in (0.0, 1e-3))
            assert costly.step_ms == free.step_ms


def test_the_floor_counts_each_host_by_its_own_ranks():
    # dp 2 x pp 2 on 2 hosts of 1 core: a host holds one pipeline rank's two
    # replicas, so the floor is the busier pipeline rank's CPU twice over
    c = plan.Candidate(2, 2, "1f1b", 1, 4, 4, 0)
    span, share = plan_cores.stages(c, _profile())
    schedule = build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)
    per_rank = plan_cores.rank_seconds(c, _profile(), span, share, 1e-3, schedule)
    assert per_rank == {0: pytest.approx(4 * 6e-3 + 8e-3), 1: pytest.approx(4 * 6e-3 + 8e-3)}
    assert plan_cores.floor(c, per_rank, hosts=2, cores=1) == pytest.approx(2 * 32e-3)
    assert plan_cores.floor(c, per_rank, hosts=1, cores=2) == pytest.approx(4 * 32e-3 / 2)


def _shared(c: plan.Candidate, hosts: int, cores: int, on_core: float = 1.0) -> float:
    from clawcomm.pipeline.clock import ScheduleClock

    pipeline = ScheduleClock(build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages))
    cost = lambda a: {"F": 1.0, "B": 2.0}.get(str(a.kind), 0.0)  # noqa: E731
    return plan_cores.shared_makespan(pipeline, c, cost, lambda a: on_core, lambda p, q: 0.0,
                                      hosts, cores)  # fmt: skip


def _alone(c: plan.Candidate, slow: float = 1.0) -> float:
    from clawcomm.pipeline.clock import ScheduleClock

    pipeline = ScheduleClock(build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages))
    return pipeline.run({"F": slow, "B": 2.0 * slow}).makespan


def test_ranks_taking_turns_fill_each_others_bubbles():
    gpipe = plan.Candidate(1, 2, "gpipe", 1, 4, 4, 0)
    # a core each: the schedule's own makespan, bubble and all
    assert _shared(gpipe, hosts=1, cores=2) == pytest.approx(_alone(gpipe))
    # 2 ranks on 1 core: some rank is always ready, so the core never idles:
    # 4 micro-batches x 3 s x 2 ranks; every action slowed alike says 2 x 15
    assert _shared(gpipe, hosts=1, cores=1) == pytest.approx(24.0)
    assert _alone(gpipe, slow=2.0) == pytest.approx(30.0)
    # layers that wait hold no core: nothing slows
    assert _shared(gpipe, hosts=1, cores=1, on_core=0.0) == pytest.approx(_alone(gpipe))


def test_replicas_on_one_host_share_it_all_the_time():
    # dp 2 x pp 2 on 2 hosts of 1 core: a host holds one pipeline rank's two
    # replicas, busy and idle together: every action at half speed, bubble kept
    c = plan.Candidate(2, 2, "1f1b", 1, 4, 4, 0)
    assert _shared(c, hosts=2, cores=1) == pytest.approx(_alone(c, slow=2.0))
    # on one host of 2 cores the two pipeline ranks fill each other's bubbles
    assert _shared(c, hosts=1, cores=2) < _alone(c, slow=2.0)
    assert _shared(c, hosts=1, cores=2) >= 4 * 4 * 3.0 / 2  # the host's CPU over its cores


def test_the_trial_trains_the_deepest_pipeline_at_its_middle_grain(monkeypatch):
    cands = list(plan.candidates(4, 4, 32))
    # pp 4's layouts: 1F1B and GPipe 8, 16, 32 actions a rank; zero-bubble 12, 24, 48
    assert plan_cores.trial_candidate(cands) == ZERO_BUBBLE
    asked = []

    def fake(cfg, c, steps, world, launch=None, key="step_ms"):
        asked.append((c, steps, world, launch, key))
        # what the profile accounts for (96 ms), and 0.5 ms for each of 96 actions
        return 96e-3 + 96 * 0.5e-3

    monkeypatch.setattr(plan_check, "measure", fake)
    cpu_s, tried = plan_cores.trial(TrainConfig(model="mlp"), cands, _profile(), 4, 6)
    assert tried == ZERO_BUBBLE and asked == [(ZERO_BUBBLE, 6, 4, None, "cpu_s")]
    assert plan_cores.measured_tau(cpu_s, tried, _profile()) == pytest.approx(0.5e-3)
    # on namespace hosts, as --check trains there
    hosts = []

    @contextlib.contextmanager
    def fake_hosts(n, link, world):
        hosts.append((n, link, world))
        yield "launch on the hosts"

    monkeypatch.setattr(plan_check, "on_hosts", fake_hosts)
    plan_cores.trial(TrainConfig(model="mlp"), cands, _profile(), 4, 6, 2, "1gbit")
    assert hosts == [(2, "1gbit", 4)] and asked[-1][3] == "launch on the hosts"
    assert plan_cores.measured_tau(50e-3, ZERO_BUBBLE, _profile()) == 0.0  # never below 0


def test_the_trial_runs_only_where_ranks_outnumber_cores_and_can_run_here(monkeypatch):
    tried = []

    def fake(cfg, cands, prof, world, steps, hosts=1, link=None):
        tried.append((steps, hosts, link))
        return 2e-3, plan_cores.trial_candidate(cands)

    monkeypatch.setattr(plan_cores, "trial", fake)
    # the fake trial's CPU-seconds stand for tau (measured_tau has its own test)
    monkeypatch.setattr(plan_cores, "measured_tau", lambda cpu_s, c, prof: cpu_s)
    cfg = TrainConfig(model="mlp", hidden=32, quiet=True, global_batch=16)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    _, _, prof = plan.plan(cfg, 4, cores=4)
    assert prof.trial == "" and not tried
    _, _, prof = plan.plan(cfg, 4, cores=2)
    assert tried == [(plan_cores.TRIAL_STEPS, 1, None)] and prof.action_s == 2e-3
    assert prof.trial.startswith("a trial: 6 steps of dp 1 x pp 4")
    assert "2.00 ms a compute action beyond its profile (a trial: 6" in plan_cores.caveat(
        prof, 4, 2
    )
    _, _, prof = plan.plan(cfg, 4, cores=2, trial_steps=0)
    assert prof.trial == "no trial: --trial-steps 0" and prof.action_s == 0.0
    assert "the profiled compute alone (no trial: --trial-steps 0)" in plan_cores.caveat(prof, 4, 2)
    _, _, prof = plan.plan(cfg, 16, cores=2)
    assert prof.trial == ("no trial: 16 ranks on this machine's 2 core(s) would take too "
                          "long (at most 4 a core)")  # fmt: skip
    # 2 hosts of 1 core: on namespace hosts where they can be made, else here
    _, _, prof = plan.plan(cfg, 4, cores=1, hosts=2, trial_on_hosts=True, link="1gbit")
    assert tried[-1] == (6, 2, "1gbit") and prof.trial.endswith("on 2 namespace hosts, links 1gbit")
    _, _, prof = plan.plan(cfg, 4, cores=1, hosts=2, link="1gbit")
    assert tried[-1] == (6, 1, None)
    assert prof.trial.endswith("on one host (namespace hosts need root and iproute2)")

    def hosts_fail(cfg, cands, prof, world, steps, hosts=1, link=None):
        if hosts > 1:
            raise RuntimeError("a namespace host failed training")
        return fake(cfg, cands, prof, world, steps, hosts, link)

    monkeypatch.setattr(plan_cores, "trial", hosts_fail)
    _, _, prof = plan.plan(cfg, 4, cores=1, hosts=2, trial_on_hosts=True, link="1gbit")
    assert tried[-1] == (6, 1, None) and prof.trial.endswith(
        "on one host: 2 namespace hosts failed (a namespace host failed training)"
    )
    monkeypatch.setattr(plan_cores, "trial", fake)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # planning 2-core hosts from a bigger one
    _, _, prof = plan.plan(cfg, 4, cores=2)
    assert prof.trial == "no trial: 4 ranks have this machine's 8 core(s) to themselves"
    assert len(tried) == 4


def test_no_trial_where_it_could_change_no_prediction(monkeypatch):
    # layers that wait (as on an accelerator) hold no core: even at
    # TAU_BOUND a compute action no step reaches the host's CPU bound
    monkeypatch.setattr(plan_cores, "trial", lambda *a: pytest.fail("no trial was needed"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = TrainConfig(model="wait", global_batch=16, quiet=True)
    _, _, prof = plan.plan(cfg, 4, cores=2)
    assert prof.trial.startswith("no trial: at 2 ms a compute action no layout's step would")
    assert prof.action_s == 0.0


def test_a_measuring_run_leaves_the_commands_outputs_alone(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        path = cmd[cmd.index("--metrics") + 1]
        with open(path, "w") as f:
            for k in range(6):
                f.write(json.dumps({"step": k, "step_ms": 10.0 + k, "cpu_s": 0.1 * k}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    cfg = TrainConfig(model="mlp", metrics=str(tmp_path / "mine.jsonl"),
                      checkpoint_dir=str(tmp_path / "ckpt"), resume=True, kill_rank=1,
                      kill_at_step=3, trace=str(tmp_path / "t.json"))  # fmt: skip
    c = plan.Candidate(2, 1, "1f1b", 1, 1, 4, 0)
    assert plan_check.measure(cfg, c, 6, 2) == 14.0  # the median of the second half
    assert plan_check.measure(cfg, c, 6, 2, key="cpu_s") == pytest.approx(0.4)
    cmd = " ".join(seen[0])
    for flag in ("--checkpoint-dir", "--resume", "--kill-rank", "--kill-at-step", "--trace",
                 "mine.jsonl"):  # fmt: skip
        assert flag not in cmd, cmd
    assert "--model mlp" in cmd


def test_the_command_refuses_a_trial_too_short_to_measure(capsys):
    from clawcomm.cli import main

    assert main(["plan", "--nproc", "4", "--model", "mlp", "--trial-steps", "1"]) == 2
    assert "--trial-steps 1: must be 0 (none) or >= 2" in capsys.readouterr().err
