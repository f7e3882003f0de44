"""How far to trust a plan: its layouts trained for a few steps and their
measured step times set beside the predictions (``clawcomm plan --check``,
``bench/plan_sweep.py``).

A layout is measured by ``clawcomm train`` itself, on this host (or by a
``launch`` the caller gives, such as torchrun on namespace hosts), as the
median step of the second half of its steps.
"""

from __future__ import annotations

import dataclasses
import math
import os

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


def measure(cfg, cand, steps: int, world: int, launch=None) -> float:
    """The candidate's measured step (ms). ``launch(train_args)`` runs
    ``clawcomm train``'s arguments somewhere else; by default ``clawcomm
    train --nproc world`` runs here."""
    import json
    import statistics
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        args = ["--steps", str(steps), "--quiet", "--metrics", metrics, *model_flags(cfg),
                *cand.flags()]  # fmt: skip
        if launch is None:
            cmd = [sys.executable, "-c", "import sys; from clawcomm.cli import main; "
                   "sys.exit(main())", "train", "--nproc", str(world), *args]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        else:
            launch(args)
        with open(metrics) as f:
            steps_ms = [m["step_ms"] for m in map(json.loads, f) if "step_ms" in m]
    return statistics.median(steps_ms[len(steps_ms) // 2 :])


def shapes(preds: list, k: int) -> list:
    """The first prediction, then the best of each other shape (dp, pp,
    schedule, virtual stages, and the wire where it was searched) in the
    plan's order, up to ``k``: layouts that differ, where the top ``k`` are
    often one shape's ZeRO stages."""
    seen, out = set(), []
    for p in preds:
        shape = (p.cand.dp, p.cand.pp, p.cand.schedule, p.cand.v, p.cand.compression)
        if shape not in seen:
            seen.add(shape)
            out.append(p)
        if len(out) == k:
            break
    return out


def table(rows: list[tuple]) -> str:
    """(prediction, measured ms) rows, in the plan's order, as the check's table."""
    lines = [f"# {'':>2} {'layout':<44} {'predicted ms':>12} {'measured ms':>11} {'error':>7}"]
    for k, (p, measured) in enumerate(rows, 1):
        err = (p.step_ms - measured) / measured
        lines.append(f"  {k:>2} {p.cand.name():<44} {p.step_ms:12.1f} {measured:11.1f} {err:+7.0%}")
    fastest = min(range(len(rows)), key=lambda i: rows[i][1])
    text = (f"# measured fastest: #{fastest + 1}; the plan's first measured "
            f"{rows[0][1] / rows[fastest][1]:.2f}x its time")  # fmt: skip
    if len(rows) > 2:
        text += f"; Spearman {spearman([p.step_ms for p, _ in rows], [m for _, m in rows]):.2f}"
    return "\n".join([*lines, text])


def check(cfg, preds: list, k: int, steps: int, world: int) -> str:
    """Trains the first ``k`` for ``steps`` steps each (``clawcomm train``,
    one after another) and prints predicted against measured step times
    (the median of the second half) and their rank correlation."""
    from tqdm import tqdm

    todo = tqdm(preds[:k], desc="clawcomm plan --check", unit="layout", leave=False)
    rows = [(p, measure(cfg, p.cand, steps, world)) for p in todo]
    return table(rows)


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
