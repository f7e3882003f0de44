"""The hang family: one rank holds the others up, and every other rank must
end with one error that names it (rank, host and pid) within the group's
timeout + 1 s, and `clawcomm flight` must name it on its first line.

Faults (the victim is a random rank):
  stop    another rank sends the victim SIGSTOP at a random moment of a loop
          of 1 MiB all-reduces (in Python between calls or inside one), and
          SIGCONT once its own error has come;
  sleep   the victim sleeps in Python before its next collective, past the
          timeout;
  op      the victim calls a broadcast where the others call an all-reduce;
  size    the victim's all-reduce has one element more;
  dtype   the victim's all-reduce is of float64.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time

from .harness import SLACK, TIMEOUT, Score, join_group, run_trial, segments

HANGS = ["stop", "sleep", "op", "size", "dtype"]
# What the error must say of the victim, beside its rank, host and pid.
SAYS = {
    "stop": "): stopped (SIGSTOP",
    "sleep": "): has not called",
    "op": "): its call #6 (broadcast) differs",
    "size": "): its call #6 (all_reduce) differs",
    "dtype": "): its call #6 (all_reduce) differs",
}
CALLS = 6  # calls before the fault (sleep and the mismatches)


def _hang_trial(rank, ws, store_path, kind, victim, stop_after):
    import torch
    import torch.distributed as dist

    join_group(rank, ws, store_path)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    stopper = (victim + 1) % ws
    timer = None
    if kind == "stop" and rank == stopper:
        victim_pid = int(store.get(f"pid/{victim}"))
        timer = threading.Timer(stop_after, os.kill, (victim_pid, signal.SIGSTOP))
        timer.start()
    x = torch.ones(1 << 18 if kind == "stop" else 64)
    me = rank == victim
    began = time.monotonic()
    try:
        for i in range(10**6):
            if kind == "stop" and time.monotonic() - began > stop_after + 3 * TIMEOUT:
                return ("no error", 0.0, os.getpid())
            at = i == CALLS and kind != "stop"
            if at and me and kind == "sleep":
                time.sleep(TIMEOUT + 2 * SLACK)
            start = time.monotonic()
            if at and me and kind == "op":
                dist.broadcast(x, 0)
            elif at and me and kind == "size":
                dist.all_reduce(torch.ones(65))
            elif at and me and kind == "dtype":
                dist.all_reduce(x.double())
            else:
                dist.all_reduce(x)
            x.fill_(1.0)
            if at and not me:
                break
        return ("no error", 0.0, os.getpid())
    except Exception as e:  # noqa: BLE001
        if not me:
            store.add("errored", 1)
        return (str(e), time.monotonic() - start, os.getpid())
    finally:
        if timer is not None:  # a stop that has not come must not come after the SIGCONT
            timer.cancel()
            timer.join()
            # The victim stays stopped until every other rank has its error,
            # as a stopped process would (a SIGCONT sooner let a late rank
            # find it running again).
            until = time.monotonic() + TIMEOUT + 2 * SLACK
            while store.add("errored", 0) < ws - 1 and time.monotonic() < until:
                time.sleep(0.01)
            os.kill(int(store.get(f"pid/{victim}")), signal.SIGCONT)


def hang(trials: int, seed: int = 0) -> Score:
    from clawcomm.flight import report

    score = Score("hang")
    rng = random.Random(seed)
    named = flight_named = 0
    for i in range(trials):
        # Every fault on both transports in turn: 10 trials cover them all.
        kind = HANGS[i % len(HANGS)]
        transport = ["shm", "tcp"][(i // len(HANGS)) % 2]
        ws = rng.choice([2, 3, 4])
        victim = rng.randrange(ws)
        before = segments()
        with tempfile.TemporaryDirectory() as flights:
            env = {"CLAWCOMM_TRANSPORT": transport, "CLAWCOMM_FLIGHT_DIR": flights}
            results, hung = run_trial(
                _hang_trial, ws, kind, victim, rng.uniform(0.05, 0.3), env=env
            )
            jobs = [os.path.join(flights, d) for d in os.listdir(flights)]
            first = report(jobs[0])[0] if len(jobs) == 1 else f"{len(jobs)} job folders"
        others = [r for p, r in enumerate(results) if p != victim]
        pid = results[victim][2] if isinstance(results[victim], tuple) else None
        name = f"rank {victim} (host "
        says = SAYS[kind]
        on_time = all(
            isinstance(r, tuple) and r[0] != "no error" and r[1] <= TIMEOUT + SLACK for r in others
        )
        right = all(
            isinstance(r, tuple) and name in r[0] and f"pid {pid})" in r[0] and says in r[0]
            for r in others
        )
        in_flight = first.startswith("culprit: ") and name in first and f"pid {pid})" in first
        named += right
        flight_named += in_flight
        leak = bool(segments() - before)
        note = f"{kind} ws={ws} victim={victim} {transport}: {others} | flight: {first}"
        score.add(on_time and right and in_flight, hang=hung, leak=leak, note=note)
    score.extra["named in every error"] = named
    score.extra["named by clawcomm flight"] = flight_named
    return score


# --- link: a namespace host's link cut mid-run --------------------------------


def _link_trial(hosts: int, per_host: int, cut: int, flights: str, out: str):
    """Ranks all-reducing on `hosts` namespace hosts under torchrun; host
    `cut`'s link is cut once all run. Returns (when, each rank's report)."""
    import glob
    import json

    from clawcomm.launch.netns import Cluster

    ranks = hosts * per_host
    when = {}

    def count(pattern: str) -> int:
        return len(glob.glob(os.path.join(out, pattern)))

    def wait(pattern: str, n: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while count(pattern) < n and time.monotonic() < deadline:
            time.sleep(0.05)

    def during(cluster) -> bool:
        wait("ready*", ranks, 120)
        time.sleep(0.3)
        when["t"] = time.time()
        cluster.cut(cut)
        wait("rank*.json", ranks, TIMEOUT + 15)
        return True  # whatever still runs is killed

    with Cluster(hosts) as cluster:
        cluster.torchrun(
            ["-m", "clawcomm.testing.chaos.link_job", out, str(TIMEOUT)],
            per_host,
            env={"CLAWCOMM_FLIGHT_DIR": flights},
            timeout=180,
            during=during,
        )
    reports = {}
    for path in glob.glob(os.path.join(out, "rank*.json")):
        with open(path) as f:
            r = json.load(f)
        reports[r["rank"]] = r
    return when.get("t", 0.0), reports


def link(trials: int, seed: int = 0) -> Score:
    """A host's link cut (TCP across namespace hosts): every rank on the
    other hosts names a rank of the cut host within the timeout + 1 s."""
    from clawcomm.flight import report
    from clawcomm.launch.netns import unavailable

    score = Score("link")
    why = unavailable()
    if why:
        score.extra["skipped"] = why
        return score
    rng = random.Random(seed)
    flight_named = 0
    for _ in range(trials):
        hosts, per_host = rng.choice([(2, 1), (2, 2), (3, 1)])
        cut = rng.randrange(1, hosts)  # host 0 serves torchrun's store
        cut_host = f"(host netns-h{cut}"
        with tempfile.TemporaryDirectory() as flights, tempfile.TemporaryDirectory() as out:
            at, reports = _link_trial(hosts, per_host, cut, flights, out)
            jobs = [os.path.join(flights, d) for d in os.listdir(flights)]
            first = report(jobs[0])[0] if len(jobs) == 1 else f"{len(jobs)} job folders"
        others = [r for r in reports.values() if r["host"] != f"netns-h{cut}"]
        good = len(others) == (hosts - 1) * per_host and all(
            "error" in r
            and r["error_at"] - at <= TIMEOUT + SLACK
            and cut_host in r["error"].split("held up by ", 1)[-1]
            for r in others
        )
        in_flight = first.startswith("culprit: ") and cut_host in first
        flight_named += in_flight
        note = f"hosts={hosts}x{per_host} cut={cut} at={at:.2f}: {others} | flight: {first}"
        score.add(good and in_flight, note=note)
    score.extra["named by clawcomm flight"] = flight_named
    return score
