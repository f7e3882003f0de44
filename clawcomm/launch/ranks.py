"""Run a function on N local ranks: the launcher of ``clawcomm train``, ``bench``
and ``experiment`` outside torchrun, and the one helper every clawcomm test uses.

    from clawcomm.launch import run_ranks

    def body(rank, world_size):
        t = torch.full((4,), float(rank))
        dist.all_reduce(t)
        return t

    results = run_ranks(body, world_size=3)   # one result per rank

Each rank is a forked process that joins a fresh process group (FileStore
rendezvous in a temporary directory, so tests never fight over ports), runs
``fn(rank, world_size, *args)``, and sends back its return value. A rank that
raises makes ``run_ranks`` raise ``RankFailure`` carrying every rank's
traceback; a rank that outlives ``timeout`` is reported as hung, with the
Python stacks of its threads at that moment (faulthandler), then killed.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailure", "check_settings", "run_ranks", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (the CLIs then
    use its ranks instead of spawning their own with ``run_ranks``)."""
    return all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")
    )


def check_settings() -> None:
    """Every ``CLAWCOMM_*`` setting read as the engine will read it:
    ValueError naming the first bad one and what it must be. Every command
    that starts ranks (``clawcomm train``, ``bench``, ``experiment``) calls
    it before the first one starts, so a bad value is one line, not a
    traceback from each rank."""
    from clawcomm import _C

    try:
        _C._check_settings()
    except ValueError as e:
        raise ValueError(str(e).removeprefix("clawcomm: ")) from None


class RankFailure(AssertionError):
    """One or more ranks raised or hung. ``errors`` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str], pids: list[int] | None = None):
        self.errors = errors
        self.pids = pids or []  # each rank's pid, where known
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


def _child(fn, rank, world_size, args, backend, env, store_path, pg_timeout, init, conn):
    # SIGUSR1 writes every thread's stack into a file the parent reads when
    # this rank hangs.
    dump = open(f"{store_path}.stacks.{rank}", "w")  # noqa: SIM115  (lives as long as the rank)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        os.environ.update(env)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        import torch
        import torch.distributed as dist

        import clawcomm  # noqa: F401  (registers the backend in this process)

        torch.set_num_threads(1)
        if init:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        try:
            result = fn(rank, world_size, *args)
        finally:
            if init and dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle, so tensors travel by value rather than as shared-memory
        # handles that die with this process.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001  (report everything to the parent)
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()


def _start_method() -> str:
    """fork (fast, and ``fn`` may be any function), unless this process has
    initialised CUDA, which a forked child cannot use: then spawn, where
    ``fn`` must be importable (a module-level function)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "clawcomm",
    env: dict[str, str] | None = None,
    rank_env: list[dict[str, str]] | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    init: bool = True,
    allow_failures: bool = False,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks.

    Returns the ranks' return values in rank order. With
    ``env`` is set on every rank, ``rank_env[r]`` on rank r only. With
    ``allow_failures=True`` a failed rank's entry is a ``RankFailure`` holding
    its traceback (or the exit code if it died) instead of raising.
    """
    ctx = mp.get_context(_start_method())
    env = {k: str(v) for k, v in (env or {}).items()}
    with tempfile.TemporaryDirectory(prefix="clawcomm-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    backend,
                    {**env, **{k: str(v) for k, v in (rank_env[rank] if rank_env else {}).items()}},
                    store_path,
                    pg_timeout,
                    init,
                    child,
                ),
                daemon=True,
            )
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        results: list[Any] = [None] * world_size
        errors: dict[int, str] = {}
        deadline = _now() + timeout
        for rank, (p, c) in enumerate(zip(procs, conns, strict=False)):
            remaining = max(0.0, deadline - _now())
            if c.poll(remaining):
                try:
                    status, value = pickle.loads(c.recv_bytes())
                except EOFError:  # it died (a signal, os._exit) before it could report
                    p.join(timeout=5)  # (its exit code, said below)
                    status, value = "error", None
            else:
                status, value = "error", None
            if status == "ok":
                results[rank] = value
            else:
                p.join(timeout=1)
                if value is None:
                    value = (
                        f"rank hung for more than {timeout} s{_stacks(p, store_path, rank)}"
                        if p.is_alive()
                        else f"rank died with exit code {p.exitcode}"
                    )
                errors[rank] = value
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if errors and not allow_failures:
            raise RankFailure(errors, [p.pid for p in procs])
        for rank, text in errors.items():
            results[rank] = RankFailure({rank: text})
        return results


def _stacks(p, store_path: str, rank: int) -> str:
    """The Python stacks of a hung rank's threads, as faulthandler wrote them."""
    path = f"{store_path}.stacks.{rank}"
    try:
        os.kill(p.pid, signal.SIGUSR1)
    except OSError:
        return ""
    for _ in range(20):  # faulthandler writes from the signal handler, at once
        p.join(timeout=0.1)
        if os.path.exists(path) and os.path.getsize(path) > 0:
            break
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    native = _native_stacks(p.pid)
    out = f"; its threads then:\n{text}" if text else ""
    return out + (f"\nand in native code (gdb):\n{native}" if native else "")


def _native_stacks(pid: int) -> str:
    """Each thread's native frames inside clawcomm or c10d, when gdb is on
    PATH (a hang inside the engine shows there, not in the Python stack)."""
    import shutil
    import subprocess

    if shutil.which("gdb") is None:
        return ""
    try:
        out = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 40"],
            capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    keep = [
        ln.strip()
        for ln in out.splitlines()
        if ln.startswith("Thread ") or ("clawcomm" in ln or "c10d" in ln)
    ]
    # A thread with no frame of ours is noise (torch's pools, Python's own).
    lines = [ln for i, ln in enumerate(keep) if not ln.startswith("Thread ")
             or (i + 1 < len(keep) and not keep[i + 1].startswith("Thread "))]  # fmt: skip
    return "\n".join(lines)


def _now() -> float:
    import time

    return time.monotonic()
