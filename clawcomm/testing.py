"""Run a function on N local ranks: the one helper every clawcomm test uses.

    from clawcomm.testing import run_ranks

    def body(rank, world_size):
        t = torch.full((4,), float(rank))
        dist.all_reduce(t)
        return t

    results = run_ranks(body, world_size=3)   # one result per rank

Each rank is a forked process that joins a fresh process group (FileStore
rendezvous in a temporary directory, so tests never fight over ports), runs
``fn(rank, world_size, *args)``, and sends back its return value. A rank that
raises makes ``run_ranks`` raise ``RankFailure`` carrying every rank's
traceback; a rank that outlives ``timeout`` is killed and reported as hung.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailure", "run_ranks", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (the CLIs then
    use its ranks instead of spawning their own with ``run_ranks``)."""
    return all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")
    )


class RankFailure(AssertionError):
    """One or more ranks raised or hung. ``errors`` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


def _child(fn, rank, world_size, args, backend, env, store_path, pg_timeout, init, conn):
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
                except EOFError:
                    status, value = "error", "rank exited without reporting"
            else:
                status, value = "error", None
            if status == "ok":
                results[rank] = value
            else:
                p.join(timeout=1)
                if value is None:
                    value = (
                        f"rank hung for more than {timeout} s"
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
            raise RankFailure(errors)
        for rank, text in errors.items():
            results[rank] = RankFailure({rank: text})
        return results


def _now() -> float:
    import time

    return time.monotonic()


_SAVER = """
import sys
from clawcomm.train.config import TrainConfig
from clawcomm.train.cli import build
from clawcomm.train.trainer import Trainer
cfg = TrainConfig(model="gpt", dim=64, layers=2, steps=10**6, quiet=True)
model, loss, opt, _, _, _ = build(cfg)
tr = Trainer(model, loss, opt, cfg)
for step in range(1, 10**6):
    tr.step_index = step
    tr.save_checkpoint(sys.argv[1], keep=2)
    print(step, flush=True)
"""


def kill_mid_save_trial(root: str, delay_s: float) -> tuple[int, int]:
    """One kill-mid-save trial: a process saves trainer checkpoints under
    ``root`` in a loop; ``delay_s`` after its first save it is SIGKILLed
    (landing inside a save most of the time), and what ``latest`` names is
    loaded here. Returns (the last step it reported saved, the step
    loaded); the load raising is the failure this guards against."""
    import signal
    import subprocess
    import sys
    import time

    from clawcomm.train.cli import build
    from clawcomm.train.config import TrainConfig
    from clawcomm.train.trainer import Trainer

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=here)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, root], stdout=subprocess.PIPE, text=True, env=env
    )
    first = proc.stdout.readline()
    if first.strip() != "1":
        proc.kill()
        raise RuntimeError(f"kill_mid_save_trial: the saver did not start ({first!r})")
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait()
    last = int(rest[-1]) if rest else 1
    model, loss, opt, _, _, _ = build(TrainConfig(model="gpt", dim=64, layers=2, quiet=True))
    tr = Trainer(model, loss, opt, TrainConfig(model="gpt", dim=64, layers=2, quiet=True))
    try:
        return last, tr.load_checkpoint(root)
    finally:
        tr.close()


# --- the wire format, for tests/test_wire.py and bench/fuzz_frames.py --------

FRAME_MAGIC = 0x434C4D46  # "CLMF" (csrc/messenger/messenger.cc)


def make_frame(
    kind: int,
    payload: bytes,
    tag: int = 0,
    magic: int = FRAME_MAGIC,
    claimed: int | None = None,
    fields: tuple[int, int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0, 0),
    epoch: int = 0,
) -> bytes:
    """One frame as a clawcomm peer puts it on the wire: the 64-byte header
    (csrc/messenger/messenger.h, FrameHeader) and the payload padded to 8
    bytes. ``claimed`` overrides the payload length the header states;
    ``fields`` are (opType, dtype, redop, count, root, step, algo); ``epoch``
    is the group's (0 in the ``_feed_frames`` hook)."""
    import struct

    op, dtype, redop, count, root, step, algo = fields
    length = len(payload) if claimed is None else claimed
    header = struct.pack(
        "<IBBBBQQQiIB3xI16x",
        magic, kind, op, dtype, redop, tag, count, length, root, step, algo, epoch,
    )  # fmt: skip
    return header + payload + b"\0" * (-len(payload) % 8)


def fuzz_frames(seed: int = 0, cases: int = 1000, seconds: float | None = None) -> str:
    """Feeds ``cases`` random streams (or as many as fit in ``seconds``) to
    the frame parser: well-formed frames of every kind, then mutated (bytes
    flipped, cut short, spliced, absurd lengths, unknown kinds). Returns a
    one-line summary; a crash ends the process, which is the finding."""
    import random
    import time

    from clawcomm import _C

    rng = random.Random(seed)
    huge = [1 << 30, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    done = 0
    while done < cases and (seconds is None or time.monotonic() - start < seconds):
        frames = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice([1, 2, 2, 3, 4])
            payload = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 8, 13, 64, 256])))
            if kind == 4:
                payload = b"why".ljust(448, b"\0")
            fields = tuple(rng.randint(0, 12) for _ in range(7))
            claimed = rng.choice(huge) if rng.random() < 0.15 else None
            frames.append(
                make_frame(kind, payload, rng.randint(0, 2), claimed=claimed, fields=fields)
            )
        data = bytearray(b"".join(frames))
        for _ in range(rng.randint(0, 4)):
            what = rng.random()
            if what < 0.4 and data:
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            elif what < 0.6 and data:
                del data[rng.randrange(len(data)) :]
            elif what < 0.8 and data:
                i = rng.randrange(len(data))
                data[i:i] = data[i : i + rng.randint(1, 80)]
            else:
                data[rng.randrange(len(data) + 1) : 0] = bytes(rng.getrandbits(8) for _ in range(8))
        error = _C._feed_frames(bytes(data), rng.choice([-1, 0, 8, 64]))
        key = "clean" if not error else " ".join(error.split()[:3])
        outcomes[key] = outcomes.get(key, 0) + 1
        done += 1
    top = sorted(outcomes.items(), key=lambda kv: -kv[1])[:6]
    return f"{done} cases in {time.monotonic() - start:.1f} s: " + ", ".join(
        f"{k!r} x{v}" for k, v in top
    )
