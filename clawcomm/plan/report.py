"""The plan's report (``clawcomm plan``, step 4): the best few predictions
side by side with the terms of each, why the first beats the second (and
the best layout of another shape), and the command that runs the first."""

from __future__ import annotations

from clawcomm.plan.pass_order import summary
from clawcomm.plan.profile import Profile


def why(first, second) -> str:
    """(Two ``plan.Prediction``s.) One sentence: the terms in which the first beats the second."""
    terms = ("compute", "bubble", "comm", "opt")
    diff = {t: getattr(second, f"{t}_ms") - getattr(first, f"{t}_ms") for t in terms}
    words = {"compute": "compute", "bubble": "bubble", "comm": "exposed communication",
             "opt": "optimizer"}  # fmt: skip
    gains = [f"{diff[t]:.1f} ms less {words[t]}" for t in terms if diff[t] > 0.05]
    costs = [f"{-diff[t]:.1f} ms more {words[t]}" for t in terms if diff[t] < -0.05]
    gap = second.step_ms - first.step_ms
    text = f"#1 is {gap:.1f} ms ({100 * gap / max(second.step_ms, 1e-9):.0f}%) faster than #2"
    if gap < 0.05:
        text = "#1 and #2 are predicted equal; #1 holds less memory" if (
            first.memory_mb < second.memory_mb) else "#1 and #2 are predicted equal"  # fmt: skip
        return text
    if gains:
        text += ": " + ", ".join(gains)
    if costs:
        text += "; it pays " + ", ".join(costs)
    if abs(gap) < 0.05 * second.step_ms:
        text += " (within 5%: this machine's noise can swap them)"
    return text


def report(preds: list, over: list, prof: Profile, base: list[str],
           top: int = 5) -> str:  # fmt: skip
    w = max([44] + [len(p.cand.name()) for p in preds[:top]])
    lines = [
        f"# profiled {len(prof.params)} layers in {prof.seconds:.1f} s "
        f"({prof.threads} thread{'s' if prof.threads != 1 else ''} a rank); "
        f"{len(preds) + len(over)} layouts, {len(over)} over the memory limit",
        f"# {'':>2} {'layout':<{w}} {'step ms':>8} {'compute':>8} {'bubble':>7} {'comm':>6} "
        f"{'optim':>6} {'MB/rank':>8}",
    ]
    order = summary(prof.order)
    if order:
        lines.insert(1, "# " + order)
    for k, p in enumerate(preds[:top], 1):
        lines.append(
            f"  {k:>2} {p.cand.name():<{w}} {p.step_ms:8.1f} {p.compute_ms:8.1f} "
            f"{p.bubble_ms:7.1f} {p.comm_ms:6.1f} {p.opt_ms:6.1f} {p.memory_mb:8.1f}"
        )
    if len(preds) > 1:
        lines.append("# " + why(preds[0], preds[1]))
        shape = lambda c: c.shape()  # noqa: E731
        other = next((p for p in preds if shape(p.cand) != shape(preds[0].cand)), None)
        if other is not None and other is not preds[1]:
            k = preds.index(other) + 1
            text = why(preds[0], other).replace("than #2", f"than #{k}, {other.cand.name()}")
            lines.append("# " + text)
    if preds:
        lines.append("# run it: clawcomm train " + " ".join(base + preds[0].cand.flags()))
    return "\n".join(lines)
