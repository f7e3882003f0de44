"""How ``clawcomm train`` ends a failed run: one summary, in global ranks.

Which rank failed first and why (a signal, its own exception, a hang),
what each of the others saw (the engine's errors name global ranks, then
the rank inside the group: Communicator::setGlobalRanks), where the flight
records and the last checkpoint are, and whether the same command with
``--resume`` can go on: not where no checkpoint there is intact, nor where
the checkpoint does not fit the command (a retry fails the same way).
Survivors' tracebacks only with ``CLAWCOMM_DEBUG=1``; the traceback of a
rank whose own code raised stays, unless its error is a checkpoint that
does not fit, which its one line says in full.
"""

from __future__ import annotations

import os
import re
import signal

# What a rank's error says when a peer, not its own code, ended it.
_PEER = re.compile(r"pid \d+\) died|died or aborted|the rank died|aborted|PeerError")
_EXIT = re.compile(r"rank died with exit code (-?\d+)")
_FLIGHT = re.compile(r"flight record: (\S+?)(?:/group-[0-9a-f]+)?/rank\d+\.json")
_STEP = re.compile(r"^clawcomm train: rank \d+ failed in step (\d+)$", re.M)
# A checkpoint that does not fit this command: a retry fails the same way.
_UNFIT = re.compile(r"^(CheckpointError|BatchChangeError): ")
# The module path before an exception's name ("clawcomm.train.checkpoint_files.")
_MODULE = re.compile(r"^(?:[a-z_][a-z0-9_]*\.)+(?=[A-Z]\w*: )")


def _last_line(text: str) -> str:
    """The exception's own line of a traceback (the last line that is not
    a frame, a caret or a note of ours)."""
    lines = [ln for ln in text.strip().splitlines() if ln and not ln.startswith(" ")]
    lines = [ln for ln in lines if not _STEP.match(ln) and not ln.startswith("Traceback")]
    return _MODULE.sub("", lines[-1]) if lines else text.strip()[:200]


def _kind(text: str) -> tuple[int, str]:
    """(order, what): 0 killed by a signal, 1 its own exception, 2 hung,
    3 ended by a peer's failure."""
    m = _EXIT.search(text)
    if m:
        code = int(m.group(1))
        if code < 0:
            return 0, f"was killed by {signal.Signals(-code).name}"
        return 0, f"exited with status {code}"
    if text.startswith("rank hung"):
        return 2, "hung: " + text.splitlines()[0]
    last = _last_line(text)
    return (3, f"stopped: {last}") if _PEER.search(last) else (1, f"raised {last}")


def summary(
    errors: dict[int, str], pids: list[int], checkpoint_dir: str = "", resume: bool = False
) -> str:
    """The lines a failed run ends with (``errors``: rank -> its error
    text, as run_ranks reports it; ``pids``: each rank's pid; ``resume``:
    whether the command has --resume already)."""
    kinds = {r: _kind(text) for r, text in errors.items()}
    first = min(errors, key=lambda r: (kinds[r][0], r))
    steps = sorted({int(s) for t in errors.values() for s in _STEP.findall(t)})
    at = f" in step {steps[0]}" if steps else ""
    pid = f" (pid {pids[first]})" if first < len(pids) else ""
    lines = [f"clawcomm train: the run failed{at}: rank {first}{pid} {kinds[first][1]}"]
    debug = os.environ.get("CLAWCOMM_DEBUG", "") not in ("", "0")
    unfit = bool(_UNFIT.match(_last_line(errors[first])))
    if (kinds[first][0] == 1 and not unfit) or debug:  # its own code raised: the user's
        lines.append(errors[first].rstrip())
    for r in sorted(errors):
        if r != first:
            lines.append(f"  rank {r} {kinds[r][1]}")
            if debug:
                lines.append(errors[r].rstrip())
    folders = sorted({m for t in errors.values() for m in _FLIGHT.findall(t)})
    for folder in folders:
        lines.append(f"  flight record: {folder} (clawcomm flight {folder})")
    if checkpoint_dir:
        lines.append(_checkpoint_line(checkpoint_dir, unfit, resume))
    if not debug:
        lines.append("  (CLAWCOMM_DEBUG=1 prints every rank's traceback)")
    return "\n".join(lines)


def _checkpoint_line(root: str, unfit: bool, resume: bool) -> str:
    """Where the run can go on from, said only where a retry can work."""
    from clawcomm.train import checkpoint_files

    try:
        found = checkpoint_files.choose(root) if os.path.isdir(root) else None
    except checkpoint_files.CheckpointError as e:
        return f"  {e}: --resume cannot go on; without it the run starts from step 0"
    if found is None:
        return f"  no checkpoint in {root} yet"
    if unfit:
        return f"  last checkpoint: {found.path}; it does not fit this command (above)"
    again = "the same command goes on" if resume else "the same command with --resume goes on"
    if not found.passed_over:
        return f"  last checkpoint: {found.path}; {again}"
    return (
        f"  {'; '.join(found.passed_over)}; last intact checkpoint: {found.path}; {again} "
        "from it"
    )


def note_step(error: BaseException, rank: int, step: int) -> None:
    """Marks ``error`` with the rank and step it ended (a line the summary reads)."""
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"clawcomm train: rank {rank} failed in step {step}")
