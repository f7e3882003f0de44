"""A checkpoint's folders on disk: how a save becomes a checkpoint
atomically, which checkpoints are kept, and which one a load can trust.
What goes into a checkpoint and comes out of it is ``checkpoint.py``'s.

    <root>/step-<N>.tmp-<token>/   DCP writes here (files fsynced)
    <root>/step-<N>/               rank 0 renames it, then fsyncs <root>
    <root>/latest                  "step-<N>": written to latest.tmp, fsynced, renamed

A process killed at any moment leaves ``latest`` naming a complete
checkpoint (or no ``latest`` at all before the first one); leftover
``*.tmp-*`` folders are removed by the next save, and all but the newest
``keep`` checkpoints with them.

A committed checkpoint's files can still be damaged afterwards (a copy cut
short, a disk that lost blocks). DCP's index (``.metadata``) records where
every item lies: a file and a byte range in it. ``damage`` checks each file
against it (reading the index and the sizes, no data), and ``choose`` takes the
checkpoint ``latest`` names when its files hold what the index says, else
the newest intact one before it, saying what was wrong with those it
passed over: a resume names the bad file and goes on from the step before,
instead of failing inside DCP's reader with an EOFError that names no file.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    """Drops leftover temporaries and all but the newest ``keep`` checkpoints.
    Checkpoints after ``newest`` (left behind where a resume went on from an
    older, intact one) are neither counted nor removed: the run replaces
    each when it saves that step again."""
    entries = sorted(os.listdir(root))
    for e in entries:
        if ".tmp-" in e and not e.startswith(newest + ".tmp-"):
            shutil.rmtree(os.path.join(root, e), ignore_errors=True)
    done = [e for e in entries if e.startswith(PREFIX) and ".tmp-" not in e and e <= newest]
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


def damage(path: str) -> str:
    """What is wrong with the files of checkpoint ``path``, in one line
    naming the file ('' when nothing is): no index, an index that cannot
    be read, or a file it names that is missing or shorter than the items
    it places there. Sizes only: no data is read."""
    import torch.distributed.checkpoint as dcp

    index = os.path.join(path, ".metadata")
    if not os.path.isfile(index):
        return f"{path}: no .metadata (not a checkpoint, or a save that never finished)"
    try:
        with single_process():
            storage = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # a cut or garbled pickle: EOFError, UnpicklingError, ...
        return f"{index}: DCP's index cannot be read ({type(e).__name__}: {str(e)[:80]})"
    need: dict[str, int] = {}
    for item in storage.values():
        end = item.offset + item.length
        need[item.relative_path] = max(need.get(item.relative_path, 0), end)
    for name, end in sorted(need.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file}: missing (DCP's index places items in it)"
        size = os.path.getsize(file)
        if size < end:
            return f"{file}: cut short, {size} bytes where DCP's index places items up to {end}"
    return ""


@dataclasses.dataclass
class Choice:
    """The checkpoint a resume loads, and what was wrong with each newer
    one passed over (newest first; empty when it is the one ``latest``
    names)."""

    path: str
    passed_over: list[str]


def choose(root: str) -> Choice | None:
    """The checkpoint a resume from ``root`` loads: the one ``latest`` names
    when its files are intact, else the newest intact one before it. None
    when ``root`` has no checkpoint yet (no ``latest``). Raises
    CheckpointError saying what is wrong with each when none is intact."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):  # (a root that is a file: not ours to say)
        return None
    bad = []
    older = sorted(
        (e for e in os.listdir(root) if e.startswith(PREFIX) and ".tmp-" not in e and e < name),
        reverse=True,
    )
    for candidate in [name, *older]:
        path = os.path.join(root, candidate)
        wrong = damage(path)
        if not wrong:
            return Choice(path, bad)
        bad.append(wrong)
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(bad))
