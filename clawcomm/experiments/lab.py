"""What the compression experiment reports, and the runs on shaped links.

Per method (and link): bytes each rank sent per step, measured; the mean
step time, measured; the final loss and accuracy and the gap to dense;
steps and seconds to the target loss (the first evaluation at or below it;
the seconds are the measured time of the steps up to it, evaluations
excluded), and what reaching it cost: device-seconds (those seconds times
the ranks, each holding a device) and joules where the ranks have an
energy meter (``clawcomm.train.energy``; "n/a" and why where they have
none); for runs beside ``compute`` (the
same steps with the gradient exchange removed, each rank training alone:
the step time no compressor can beat), the share of the gap between dense
and compute alone that the method closes in time to target; and the
calibrated cost model's projection of the step time at 8, 64 and 512
hosts: the measured step minus the model's time for this exchange at 2
hosts plus its time at N (an all-reduce of the bytes per step; an
all-gather of N times them for the sparse methods, whose pairs every rank
gathers).

``--links 1gbit,10gbit`` runs every method on network-namespace hosts
(``clawcomm.launch.netns``; two, or dp x pp with ``--layout``) whose links
are shaped to that rate, one rank each, under torchrun: the step time is
measured on that link, not modelled. The ranks' cost model
(``CLAWCOMM_COST_MODEL``, else the defaults) gets the shaped rate as the
network's bandwidth, as a calibrated model would.
Where namespaces cannot be made (no root, no iproute2) it says why and runs
on one host.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

HOSTS = (8, 64, 512)
GATHERED = ("topk", "dgc", "threshold")  # their pairs are all-gathered


def reached(curve, target: float):
    """The first curve point (step, loss, bytes, seconds) at or below
    ``target``, or None."""
    for point in curve:
        if math.isfinite(point[1]) and point[1] <= target:
            return point
    return None


def _comm_s(spec: str, nbytes: float, hosts: int, model) -> float:
    from clawcomm.cost_model import Topology, predict

    if nbytes <= 0:
        return 0.0
    hosts_topology = Topology(hosts, 1)
    if spec.split(":")[0] in GATHERED:
        return predict("all_gather", "auto", nbytes * hosts, hosts_topology, model)
    return predict("all_reduce", "auto", nbytes, hosts_topology, model)


def analyse(results: list[dict], target: float | None, link: str | None, model=None) -> dict:
    """Adds each result's time to target, gap closed and projections;
    returns the target used. Default target: 1.05 x dense's final loss."""
    from clawcomm.cost_model import CostModel

    model = (model or CostModel()).with_link(link)
    dense = next((r for r in results if r["compressor"] == "none"), None)
    compute = next((r for r in results if r["compressor"] == "compute"), None)
    if target is None and dense is not None:
        target = round(dense["final_loss"] * 1.05, 4)
    dense_at = reached(dense["curve"], target) if dense and target is not None else None
    for r in results:
        at = reached(r["curve"], target) if target is not None else None
        r["steps_to_target"] = at[0] if at else None
        r["seconds_to_target"] = at[3] if at else None  # measured: the steps' own time
        # What reaching it cost: device-seconds (each rank holds a device),
        # and joules where the ranks had a meter (energy.py).
        r["device_s_to_target"] = at[3] * r.get("ranks", 2) if at else None
        r["joules_to_target"] = at[4] if at and len(at) > 4 else None
        # Dense closes none of the gap by definition, even when a loaded
        # machine timed its steps no slower than compute alone's (then the
        # gap has no width and the others' share is undefined: None).
        r["gap_closed"] = 0.0 if r is dense and at else None
        if compute not in (None, r) and r is not dense and dense_at and at:
            # Compute alone over dense's steps to target: the time no method can beat.
            bound = dense_at[0] * compute["step_ms"] / 1e3
            if dense_at[3] > bound:
                r["gap_closed"] = (dense_at[3] - at[3]) / (dense_at[3] - bound)
        spec = r["compressor"]
        here = _comm_s(spec, r["bytes_per_step"], 2, model)
        r["projected_step_ms"] = {
            n: r["step_ms"] + 1e3 * (_comm_s(spec, r["bytes_per_step"], n, model) - here)
            for n in HOSTS
        }
    return {"target_loss": target}


def _cost(device_s: float | None, joules: float | None) -> str:
    dev = f" {device_s:6.1f}" if device_s is not None else f" {'-':>6}"
    return dev + (f" {joules:7.1f}" if joules is not None else f" {'n/a':>7}")


def table(results: list[dict]) -> str:
    dense = next((r for r in results if r["compressor"] == "none"), results[0])
    width = max([18] + [len(r["compressor"]) for r in results])
    head = (
        f"# {'method':<{width}}  bytes/step  vs dense  step ms  final loss  test acc  loss gap"
        "  to target: steps      s  dev-s       J  gap closed  step ms at 8/64/512 hosts (model)"
    )
    lines = [head]
    for r in results:
        ratio = r["bytes_per_step"] / dense["bytes_per_step"] if dense["bytes_per_step"] else 0
        gap = (r["final_loss"] - dense["final_loss"]) / dense["final_loss"]
        finite = math.isfinite(r["final_loss"])
        loss = f"{r['final_loss']:11.4f}" if finite else "   diverged"
        steps = r.get("steps_to_target")
        secs = r.get("seconds_to_target")
        closed = r.get("gap_closed")
        proj = r.get("projected_step_ms", {})
        lines.append(
            f"  {r['compressor']:<{width}} {r['bytes_per_step']:11.0f} {ratio:8.2%} "
            f"{r['step_ms']:8.2f} {loss} {r['test_accuracy']:8.2%} "
            + (f"{gap:+9.2%}" if finite else "      n/a")
            + (f"  {steps:16d} {secs:6.1f}" if steps else f"  {'never':>16} {'-':>6}")
            + _cost(r.get("device_s_to_target"), r.get("joules_to_target"))
            + (f" {closed:11.0%}" if closed is not None else f" {'-':>11}")
            + "  " + " / ".join(f"{proj[n]:.0f}" for n in HOSTS if n in proj)
        )  # fmt: skip
    notes = {r.get("energy_note") for r in results} - {None, "RAPL", "NVML"}
    if notes:
        lines.append(f"# J: n/a, {'; '.join(sorted(notes))}")
    for r in results:
        c = r.get("coding")
        if c and c["messages"]:
            lines.append(
                f"# {r['compressor']}: {c['coded']} of {c['messages']} messages coded, "
                f"{c['bits_per_element']:.2f} bits per element sent, "
                f"{c['sent_bytes'] / max(c['raw_bytes'], 1):.1%} of the uncoded bytes, "
                f"{c['coding_s']:.2f} s coding"
            )
    return "\n".join(lines)


def plot(groups: dict[str, list[dict]], path: str, title: str, ylabel: str) -> None:
    """Loss against steps, against bytes sent and against wall time, one
    line per method, one row of panels per link."""
    from clawcomm._optional import require

    require("matplotlib", "clawcomm experiment compression --plot").use("Agg")
    import matplotlib.pyplot as plt

    rows = len(groups)
    names = list(dict.fromkeys(r["compressor"] for rs in groups.values() for r in rs))
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.6 * rows), squeeze=False)
    for row, (link, results) in zip(axes, groups.items(), strict=True):
        for r in results:
            if r["compressor"] == "compute":
                continue
            pts = [c for c in r["curve"] if math.isfinite(c[1])]
            style = {"color": colors[names.index(r["compressor"]) % len(colors)],
                     "linestyle": "--" if ":" in r["compressor"] and
                     r["compressor"].startswith(("diloco", "local-sgd")) else "-"}  # fmt: skip
            row[0].plot([c[0] for c in pts], [c[1] for c in pts], label=r["compressor"], **style)
            sent = [c for c in pts if c[2] > 0]  # (log scale: from the first byte)
            row[1].plot([c[2] / 1e6 for c in sent], [c[1] for c in sent], **style)
            row[2].plot([c[3] for c in pts], [c[1] for c in pts], **style)
        labels = ("step", "MB sent per rank (measured)", "seconds of steps (measured)")
        for ax, xlabel in zip(row, labels, strict=True):
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
        row[1].set_xscale("log")
        row[0].set_ylabel(ylabel)
        row[0].set_title(f"{title}, {link}", loc="left", fontsize=10)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_on_link(specs: list[str], cfg: dict, link: str, timeout: float, progress,
                results: list | None = None) -> list[dict]:  # fmt: skip
    """Every method on namespace hosts (dp x pp of them, 2 by default; one
    rank each) whose links run at ``link``; raises RuntimeError with the
    hosts' output if a run fails."""

    from clawcomm.cost_model import CostModel
    from clawcomm.launch.netns import Cluster

    results = [] if results is None else results  # (the caller's, to count what finished)
    hosts = cfg.get("dp", 2) * cfg.get("pp", 1)
    with Cluster(hosts, rate=link) as cluster, tempfile.TemporaryDirectory() as tmp:
        # The ranks' cost model knows the link they run on, as a calibrated
        # one would: the engine's choices and what +ec weighs its coding
        # against see the shaped rate.
        path = os.environ.get("CLAWCOMM_COST_MODEL")
        model = CostModel.load(path) if path else CostModel()
        link_model = os.path.join(tmp, "model.json")
        model.with_link(link).save(link_model)
        env = {"OMP_NUM_THREADS": "1", "CLAWCOMM_COST_MODEL": link_model}
        for spec in specs:
            if progress is not None:
                progress.set_description(f"{spec} @ {link}")
            out = os.path.join(tmp, f"{len(results)}.json")
            argv = ["-m", "clawcomm.experiments.worker", spec, json.dumps(cfg), out]
            # Two hosts share this machine's cores: one thread per rank, as
            # torchrun itself sets when it starts several ranks on a host.
            runs = cluster.torchrun(argv, 1, env=env, timeout=timeout)
            bad = [r for r in runs if r.returncode != 0]
            if bad:
                raise RuntimeError(
                    f"{spec} on {link}: host {bad[0].host} exited with {bad[0].returncode}:\n"
                    f"{bad[0].output[-3000:]}"
                )
            with open(out) as f:
                results.append(json.load(f))
            if progress is not None:
                progress.update(1)
    return results


def links_unavailable() -> str | None:
    from clawcomm.launch.netns import unavailable

    why = unavailable()
    if why:
        print(
            f"clawcomm experiment compression: --links: {why}; running on one host", file=sys.stderr
        )
    return why
