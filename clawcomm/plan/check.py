"""How far to trust a plan: its layouts trained for a few steps and their
measured step times set beside the predictions (``clawcomm plan --check``,
``bench/plan_sweep.py``).

A layout is measured by ``clawcomm train`` itself, on this host or on
namespace hosts with shaped links (``on_hosts``), as the median step of the
second half of its steps. With ``rounds`` > 1 the layouts are measured in
turn, round after round, so that a machine that slows for a minute slows
every layout alike; each layout's figure is its median over the rounds,
and the table gives its spread. Rounds also measure the measurement: the
rank correlation of two rounds with each other is as much agreement as any
prediction can show on this machine (layouts a few percent apart swap
places from one round to the next).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics

LAYOUT_FIELDS = ("dp", "pp", "schedule", "virtual_stages", "microbatches", "micro_batch_size",
                 "accumulation", "global_batch", "zero", "layout")  # fmt: skip


def model_flags(cfg) -> list[str]:
    """The command's settings other than the layout, as flags."""
    from clawcomm.train.config import TrainConfig

    default, out = TrainConfig(), []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in LAYOUT_FIELDS or value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


# what a measuring run must not do with the command's settings: write its
# outputs, resume from its checkpoints, or kill a rank
_NOT_MEASURED = {"checkpoint_dir": "", "resume": False, "kill_rank": -1, "kill_at_step": 0,
                 "metrics": "", "trace": "", "tensorboard": "", "timeline": "",
                 "chakra": ""}  # fmt: skip


def measure(cfg, cand, steps: int, world: int, launch=None, key: str = "step_ms") -> float:
    """The candidate's measured step (ms; or the median of another metric,
    ``key``). ``launch(train_args)`` runs ``clawcomm train``'s arguments
    somewhere else; by default ``clawcomm train --nproc world`` runs here.
    The command's outputs, checkpoints and failure injection stay out."""
    import json
    import statistics
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        quiet = dataclasses.replace(cfg, **_NOT_MEASURED)
        args = ["--steps", str(steps), "--quiet", "--metrics", metrics, *model_flags(quiet),
                *cand.flags()]  # fmt: skip
        if launch is None:
            cmd = [sys.executable, "-c", "import sys; from clawcomm.cli import main; "
                   "sys.exit(main())", "train", "--nproc", str(world), *args]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        else:
            launch(args)
        with open(metrics) as f:
            figures = [m[key] for m in map(json.loads, f) if key in m]
    return statistics.median(figures[len(figures) // 2 :])


def shapes(preds: list, k: int) -> list:
    """The first prediction, then the best of each other shape (dp, pp,
    schedule, virtual stages, and the wire and sync method where searched) in the
    plan's order, up to ``k``: layouts that differ, where the top ``k`` are
    often one shape's ZeRO stages."""
    seen, out = set(), []
    for p in preds:
        shape = (*p.cand.shape(), p.cand.compression, p.cand.sync)
        if shape not in seen:
            seen.add(shape)
            out.append(p)
        if len(out) == k:
            break
    return out


def grid(preds: list, microbatches: int = 4) -> list:
    """The plan's first, then the trainer's layout sweep as the plan predicts
    it, in the plan's order: every dp x pp and schedule (interleaved at 2
    virtual stages) the plan considers, at ``microbatches`` micro-batches,
    no ZeRO and the command's wire and sync (``bench/train_bench.py``'s
    layouts at any world). Not the plan's picks but a fixed set, some far
    from the best: how well it ranks layouts it would not choose."""
    out, seen = [preds[0]], {preds[0].cand}
    for p in preds:
        c = p.cand
        fixed = c.microbatches == microbatches and c.zero == 0 and c.virtual_stages in (1, 2)
        plain = c.compression in (None, "") and c.sync in (None, "every-step")
        if fixed and plain and c not in seen:
            seen.add(c)
            out.append(p)
    return out


def table(rows: list[tuple]) -> str:
    """(prediction, measured ms, or a list of them, one a round) rows, in
    the plan's order, as the check's table."""
    runs = [m if isinstance(m, list | tuple) else [m] for _, m in rows]
    rounds = min(len(r) for r in runs)
    med = [statistics.median(r) for r in runs]
    spread = f" {'spread':>7}" if rounds > 1 else ""
    w = max([44] + [len(p.cand.name()) for p, _ in rows])
    lines = [f"# {'':>2} {'layout':<{w}} {'predicted ms':>12} {'measured ms':>11}{spread} "
             f"{'error':>7}"]  # fmt: skip
    for k, ((p, _), m, r) in enumerate(zip(rows, med, runs, strict=True), 1):
        err = (p.step_ms - m) / m
        sp = f" {'±' + format((max(r) - min(r)) / 2 / m, '.0%'):>7}" if rounds > 1 else ""
        lines.append(f"  {k:>2} {p.cand.name():<{w}} {p.step_ms:12.1f} {m:11.1f}{sp} {err:+7.0%}")
    fastest = min(range(len(rows)), key=med.__getitem__)
    text = (f"# measured fastest: #{fastest + 1}; the plan's first measured "
            f"{med[0] / med[fastest]:.2f}x its time")  # fmt: skip
    if len(rows) > 2:
        text += f"; Spearman {spearman([p.step_ms for p, _ in rows], med):.2f}"
    lines.append(text)
    if rounds > 1 and len(rows) > 2:
        lines.append(
            f"# the measurement against itself: Spearman {retest(runs):.2f} between rounds "
            f"(median of the pairs of {rounds} rounds), as far as any prediction can agree here"
        )
        right, told = pairs_right([p.step_ms for p, _ in rows], runs)
        lines.append(
            f"# the pairs the rounds tell apart (one's range below the other's): {told} of "
            f"{len(rows) * (len(rows) - 1) // 2}; the plan orders {right} of them the same way"
        )
    return "\n".join(lines)


def separated(runs: list[list[float]]) -> list[tuple[int, int]]:
    """The pairs of layouts (faster, slower) that this machine tells apart:
    every round of the one measured below every round of the other (their
    ranges do not overlap). For two layouts of the same speed measured in 3
    rounds that happens by chance 1 time in 10, where the rounds merely
    coming out in the same order would happen 1 time in 4. One round tells
    nothing apart."""
    if min((len(r) for r in runs), default=0) < 2:
        return []
    out = []
    for i, a in enumerate(runs):
        for j, b in enumerate(runs):
            if i != j and max(a) < min(b):
                out.append((i, j))
    return out


def pairs_right(predicted: list[float], runs: list[list[float]]) -> tuple[int, int]:
    """(how many of the pairs the rounds tell apart, ``separated``, the
    prediction orders the same way; how many there are)."""
    told = separated(runs)
    return sum(predicted[i] < predicted[j] for i, j in told), len(told)


def retest(runs: list[list[float]]) -> float:
    """The median rank correlation of every two rounds of ``runs`` (per
    layout, its measurement in each round)."""
    rounds = min(len(r) for r in runs)
    pairs = [
        spearman([r[a] for r in runs], [r[b] for r in runs])
        for a in range(rounds)
        for b in range(a + 1, rounds)
    ]
    return statistics.median(pairs) if pairs else float("nan")


def measure_rounds(cfg, preds: list, steps: int, world: int, rounds: int = 1, launch=None,
                   progress=None) -> list[list[float]]:  # fmt: skip
    """Each prediction's layout measured ``rounds`` times, in turn: per
    layout, its step (ms) in each round."""
    out = [[] for _ in preds]
    for _ in range(rounds):
        for i, p in enumerate(preds):
            out[i].append(measure(cfg, p.cand, steps, world, launch))
            if progress is not None:
                progress.update()
    return out


def namespace_cores(hosts: int) -> int:
    """The cores each of ``hosts`` namespace hosts has: they share this
    machine's."""
    return max(1, (os.cpu_count() or 1) // hosts)


@contextlib.contextmanager
def on_hosts(hosts: int, rate: str | None, world: int, timeout: float = 600):
    """A ``launch`` for ``measure`` that trains on ``hosts`` namespace hosts
    of this machine, each link shaped to ``rate`` (root and iproute2; the
    error says why not)."""
    from clawcomm.launch.netns import Cluster, failed, unavailable

    why = unavailable()
    if why:
        raise ValueError(f"checking on {hosts} hosts needs namespace hosts here: {why}")
    with Cluster(hosts, rate=rate) as cluster:

        def launch(train_args):
            runs = cluster.torchrun(["-m", "clawcomm.train", *train_args], world // hosts,
                                    timeout=timeout, fork=True)  # fmt: skip
            if failed(runs):  # (it printed the end of the host's output)
                raise RuntimeError(f"a namespace host failed training {' '.join(train_args)}")

        yield launch


def check(cfg, preds: list, k: int, steps: int, world: int, rounds: int = 1,
          hosts: int = 1, rate: str | None = None) -> str:  # fmt: skip
    """Trains the first ``k`` for ``steps`` steps each (``clawcomm train``,
    one after another, ``rounds`` times; on ``hosts`` namespace hosts with
    links at ``rate`` when hosts > 1) and prints predicted against measured
    step times (the median of the second half) and their rank correlation."""
    from tqdm import tqdm

    chosen = preds[:k]
    where = on_hosts(hosts, rate, world) if hosts > 1 else contextlib.nullcontext(None)
    with tqdm(total=len(chosen) * rounds, desc="clawcomm plan --check", unit="layout",
              leave=False) as bar, where as launch:  # fmt: skip
        runs = measure_rounds(cfg, chosen, steps, world, rounds, launch, bar)
    return table(list(zip(chosen, runs, strict=True)))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties share their mean rank)."""

    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else 0.0
