"""A checkpoint's folders on disk: how a save becomes a checkpoint
atomically, and which checkpoints are kept.
What goes into a checkpoint and comes out of it is ``checkpoint.py``'s.

    <root>/step-<N>.tmp-<token>/   DCP writes here (files fsynced)
    <root>/step-<N>/               rank 0 renames it, then fsyncs <root>
    <root>/latest                  "step-<N>": written to latest.tmp, fsynced, renamed

A process killed at any moment leaves ``latest`` naming a complete
checkpoint (or no ``latest`` at all before the first one); leftover
``*.tmp-*`` folders are removed by the next save, and all but the newest
``keep`` checkpoints with them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist

LATEST = "latest"
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run: it says why."""


def folder_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


@contextlib.contextmanager
def single_process():
    """DCP without a process group: torch warns that it assumes one process (ours to keep)."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def size_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (a checkpoint's folder)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def check_room(need: int, root: str, name: str) -> None:
    """Refuses a save of ``need`` bytes on this rank that cannot fit, on
    every rank alike (before DCP's collectives, which would otherwise be
    left half-entered)."""
    if dist.is_initialized():
        total = torch.tensor([need], dtype=torch.int64)
        dist.all_reduce(total)  # every rank writes into the same folder
        need = int(total.item())
    free = broadcast_object(free_bytes(root) if rank() == 0 else None)
    want = int(need * 1.05) + (1 << 20)  # DCP's metadata and file headers
    if free < want:
        raise OSError(
            f"clawcomm.train: checkpoint {name} needs about {mb(want)} in {root}, which has "
            f"{mb(free)} free; free some space, or save elsewhere (--checkpoint-dir)"
        )


def new_folder(root: str, name: str) -> str:
    """The temporary folder a save of ``name`` writes into, made by rank 0
    and named alike on every rank."""
    token = broadcast_object(
        f"{os.getpid():x}{time.time_ns() & 0xFFFFFF:x}" if rank() == 0 else None
    )
    tmp = os.path.join(root, f"{name}.tmp-{token}")
    if rank() == 0:
        os.makedirs(tmp, exist_ok=True)
    barrier()
    return tmp


class PendingSave:
    """An asynchronous save in flight: the state was copied when it began;
    ``wait()`` waits for the files and commits the checkpoint (the renames),
    as a synchronous save does at its end."""

    def __init__(self, future, commit, path: str):
        self._future = future
        self._commit = commit
        self.path = path  # the checkpoint's folder once committed
        self.started = time.perf_counter()

    def wait(self) -> None:
        if self._future is None:
            return
        future, self._future = self._future, None
        future.result()  # the files are written (an error surfaces here)
        self._commit()


def commit(root: str, tmp: str, name: str, keep: int) -> str:
    """Rank 0: the written folder ``tmp`` becomes checkpoint ``name``, then
    `latest` names it; all but the newest ``keep`` are dropped. Returns
    its path."""
    final = os.path.join(root, name)
    _fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))
    _fsync_dir(root)
    _prune(root, keep, name)
    return final


def _prune(root: str, keep: int, newest: str) -> None:
    """Drops leftover temporaries and all but the newest ``keep`` checkpoints."""
    entries = sorted(os.listdir(root))
    for e in entries:
        if ".tmp-" in e and not e.startswith(newest + ".tmp-"):
            shutil.rmtree(os.path.join(root, e), ignore_errors=True)
    done = [e for e in entries if e.startswith(PREFIX) and ".tmp-" not in e]
    for e in done[: max(0, len(done) - keep)]:
        if e != newest:
            shutil.rmtree(os.path.join(root, e), ignore_errors=True)


def latest(root: str) -> str | None:
    """The checkpoint ``<root>/latest`` names, or None when there is none yet."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{root}/latest names {name!r}, which is not a complete checkpoint")
    return path
