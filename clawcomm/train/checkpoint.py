"""Checkpoints of a ``Trainer``: atomic, resumable bit for bit, and loadable
at another layout.

What is saved (through torch.distributed.checkpoint, DCP), keyed so that any
layout can find its part:

    model/<name>               every parameter, by its name in the whole model
    optim/<name>/<key>         its optimizer state (momentum, Adam moments, step)
    outer/...                  --sync local-sgd/diloco: the anchor and outer momentum
                               by parameter, the compressor's buffers by fragment
                               and replica, the exchanges in flight (--sync-delay)
                               by fragment; model/ and optim/ then take a dp<d>/
                               scope, each replica's weights being its own
    residual/dp<d>/<name>      error-feedback residual of data-parallel rank d
    momentum/dp<d>/<name>      its DGC momentum (the compressor's, not the optimizer's)
    rng/rank<r>                torch, Python and numpy RNG states of rank r
    trainer/rank<r>            rank r's reducer state: compression step, call
                               counts and small per-bucket tensors (PowerSGD's
                               Q), the learned bucket order and counts
    meta                       format, step, model (names and shapes),
                               compressor, optimizer, layout, and the global
                               batch a resume keeps (clawcomm.train.resume)

Parameters and optimizer state are replicated over data-parallel ranks and
split over pipeline stages; DCP writes each key once. Loading asks each rank
for the keys of the parameters it holds now, so a checkpoint taken at dp2 x
pp2 loads at dp1 x pp4 (with the same global batch: ``--resume`` derives
the accumulation from it). What only makes sense at the same layout (RNG
streams, the reducer's bucket order) is restored only there; residuals of a
different data-parallel width are averaged, which keeps the mean update
they still owe.

Atomic: DCP writes into ``<root>/step-<N>.tmp-<token>`` (files fsynced), rank
0 renames it to ``<root>/step-<N>`` and then replaces ``<root>/latest``
(a one-line file naming it) by writing ``latest.tmp``, fsyncing and renaming.
A process killed at any moment leaves ``latest`` naming a complete
checkpoint (or no ``latest`` at all before the first one); leftover
``*.tmp-*`` folders are removed by the next save.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
import warnings

import torch
import torch.distributed as dist

from clawcomm.train import rng

FORMAT = 1
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run: it says why."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def single_process():
    """DCP without a process group: torch warns that it assumes one process (ours to keep)."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_object(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _state_bytes(obj) -> int:
    """The tensor bytes in a (nested) state dict: what a save writes, give or
    take DCP's metadata."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def size_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (a checkpoint's folder)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _check_room(sd, root: str, name: str) -> None:
    """Refuses a save that cannot fit, on every rank alike (before DCP's
    collectives, which would otherwise be left half-entered)."""
    need = _state_bytes(sd)
    if dist.is_initialized():
        total = torch.tensor([need], dtype=torch.int64)
        dist.all_reduce(total)  # every rank writes into the same folder
        need = int(total.item())
    free = _broadcast_object(_free_bytes(root) if _rank() == 0 else None)
    want = int(need * 1.05) + (1 << 20)  # DCP's metadata and file headers
    if free < want:
        raise OSError(
            f"clawcomm.train: checkpoint {name} needs about {_mb(want)} in {root}, which has "
            f"{_mb(free)} free; free some space, or save elsewhere (--checkpoint-dir)"
        )


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


def _layout(trainer) -> dict:
    cfg = trainer.cfg
    return {
        "dp": cfg.dp,
        "pp": cfg.pp,
        "virtual_stages": cfg.virtual_stages,
        "cuts": list(trainer.cuts),
        "schedule": cfg.schedule,
    }


def _model_shapes(trainer) -> dict[str, list[int]]:
    """Every parameter of the whole model (not only this rank's), by name."""
    return dict(trainer.shapes)


def _optimizer_name(trainer) -> str:
    return type(trainer.optimizer).__name__


def _local(trainer):
    """(name, index, parameter) of every parameter this rank holds."""
    for i, p in enumerate(trainer.params):
        yield trainer.names[id(p)], i, p


def _scope(trainer) -> str:
    """Where replicas' parameters and optimizer states differ between
    meetings (--sync local-sgd/diloco), each replica's are kept apart."""
    return f"dp{trainer.grid.dp_rank}/" if trainer.outer is not None else ""


def _names(trainer) -> list[str]:
    return [trainer.names[id(p)] for p in trainer.params]


def _index_of(trainer, name: str) -> int:
    return next(i for n, i, _ in _local(trainer) if n == name)


def _residual_segments(trainer) -> dict[str, torch.Tensor]:
    """This rank's per-element compression buffers (error-feedback residual;
    DGC's momentum), cut by parameter: "kind/name" -> segment."""
    r = trainer.reducer
    if r is None or r.compressor is None:
        return {}
    out = {}
    for kind, buffers in r.compression_state.per_element().items():
        for name, i, _ in _local(trainer):
            bucket, slot = r.slot[i]
            res = buffers.get(bucket.index)
            if res is not None:
                out[f"{kind}/{name}"] = bucket.segment(res, slot).clone()
    return out


def state_dict(trainer) -> dict:
    """This rank's part of the checkpoint (see the module docstring)."""
    rank, d = _rank(), trainer.grid.dp_rank
    sd: dict = {}
    optim = trainer.optimizer_state()  # whole per parameter, whatever the ZeRO stage
    with trainer.whole_params() as gathered:  # ZeRO-3: copies, the gathered ones freed after
        for name, _, p in _local(trainer):
            sd[f"model/{_scope(trainer)}{name}"] = p.detach().clone() if gathered else p.detach()
    for name, _, p in _local(trainer):
        for k, v in optim.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                sd[f"optim/{_scope(trainer)}{name}/{k}"] = v
    for kind_name, seg in _residual_segments(trainer).items():
        kind, name = kind_name.split("/", 1)
        sd[f"{kind}/dp{d}/{name}"] = seg
    sd[f"rng/rank{rank}"] = rng.state()
    r, outer = trainer.reducer, trainer.outer
    if outer is not None:
        sd.update(outer.tensors(_names(trainer), d))
    # Dicts travel pickled: DCP would flatten them into one key per field.
    sd[f"trainer/rank{rank}"] = pickle.dumps(
        {
            "layout": _layout(trainer),
            "reducer": r.state_dict() if r is not None else None,
            "outer": outer.small_state() if outer is not None else None,
        }
    )
    if rank == 0:
        sd["meta"] = pickle.dumps(
            {
                "format": FORMAT,
                "step": trainer.step_index,
                "model": _model_shapes(trainer),
                "compression": trainer.cfg.compression,
                "sync": trainer.cfg.sync,
                "optimizer": _optimizer_name(trainer),
                "layout": _layout(trainer),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                # the batch a resume keeps (clawcomm.train.resume)
                "global_batch": trainer.cfg.effective_batch,
                "accumulation": trainer.cfg.accumulation,
                "micro_batch_size": trainer.cfg.micro_batch_size,
                "microbatches": trainer.cfg.microbatches,
            }
        )
    return sd


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


def save(trainer, root: str, keep: int = 2, asynchronous: bool = False, group=None):
    """Saves ``trainer`` under ``root`` (every rank calls it) and returns the
    checkpoint's path. Keeps the newest ``keep`` checkpoints.

    ``asynchronous``: returns a ``PendingSave`` as soon as the state has been
    copied; DCP writes the files from a thread, talking over ``group`` (a
    group of its own, so that its collectives never interleave with the
    training's), and ``wait()`` commits. Until then ``latest`` still names
    the previous checkpoint."""
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    name = f"step-{trainer.step_index:08d}"
    token = _broadcast_object(
        f"{os.getpid():x}{time.time_ns() & 0xFFFFFF:x}" if rank == 0 else None
    )
    tmp = os.path.join(root, f"{name}.tmp-{token}")
    final = os.path.join(root, name)
    if rank == 0:
        os.makedirs(tmp, exist_ok=True)
    _barrier()
    sd = state_dict(trainer)
    try:
        _check_room(sd, root, name)
    except OSError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    writer = dcp.FileSystemWriter(tmp, sync_files=True)

    def commit() -> None:
        if rank == 0:
            _commit(root, tmp, final, name, keep)

    if asynchronous:
        with single_process():
            future = dcp.async_save(sd, storage_writer=writer, process_group=group)
        return PendingSave(future, commit, final)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with single_process():
            dcp.save(sd, storage_writer=writer, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        # The disk filled up meanwhile (another writer), or the write failed
        # otherwise: say where and how much room is left, in place of torch's
        # zip writer's "unexpected pos" message; `latest` is untouched.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        left = _mb(_free_bytes(root))
        raise OSError(
            f"clawcomm.train: writing checkpoint {name} into {root} failed ({left} free there "
            f"now): {str(e).strip().splitlines()[-1][:200]}"
        ) from e
    commit()
    _barrier()
    return final


def _commit(root: str, tmp: str, final: str, name: str, keep: int) -> None:
    """Rank 0: the written folder becomes the checkpoint, then `latest` names it."""
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


def _prune(root: str, keep: int, newest: str) -> None:
    """Drops leftover temporaries and all but the newest ``keep`` checkpoints."""
    entries = sorted(os.listdir(root))
    for e in entries:
        if ".tmp-" in e and not e.startswith(newest + ".tmp-"):
            shutil.rmtree(os.path.join(root, e), ignore_errors=True)
    done = [e for e in entries if e.startswith("step-") and ".tmp-" not in e]
    for e in done[: max(0, len(done) - keep)]:
        if e != newest:
            shutil.rmtree(os.path.join(root, e), ignore_errors=True)


def _check(meta: dict, trainer, path: str) -> None:
    """Raises CheckpointError when the checkpoint ``meta`` (at ``path``)
    cannot be loaded into ``trainer``: another model, compressor, sync,
    optimizer, replica count for a delayed sync, or global batch."""

    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')}, this clawcomm reads {FORMAT}")
    mine = _model_shapes(trainer)
    theirs = meta["model"]
    if set(mine) != set(theirs):
        missing = sorted(set(mine) - set(theirs))[:3]
        extra = sorted(set(theirs) - set(mine))[:3]
        raise CheckpointError(
            f"{path} holds another model: it lacks {missing or 'nothing'} and has "
            f"{extra or 'nothing'} that this model lacks"
        )
    for n, shape in mine.items():
        if list(theirs[n]) != shape:
            raise CheckpointError(
                f"{path} holds another model: parameter {n!r} is {theirs[n]} there, {shape} here"
            )
    if meta["compression"] != trainer.cfg.compression:
        raise CheckpointError(
            f"{path} was made with compression {meta['compression']!r}, this run uses "
            f"{trainer.cfg.compression!r} (its residuals and counters would not fit)"
        )
    if meta.get("sync", "every-step") != trainer.cfg.sync:
        raise CheckpointError(
            f"{path} was made with sync {meta.get('sync', 'every-step')!r}, this run uses "
            f"{trainer.cfg.sync!r}"
        )
    if trainer.cfg.sync != "every-step" and meta["layout"]["dp"] != trainer.cfg.dp:
        raise CheckpointError(
            f"{path} holds {meta['layout']['dp']} replicas that meet every few steps, each with "
            f"its own weights; this run has dp {trainer.cfg.dp} (load it at dp "
            f"{meta['layout']['dp']})"
        )
    saved, now = meta.get("global_batch"), trainer.cfg.effective_batch
    if saved is not None and saved != now and not trainer.cfg.allow_batch_change:
        raise CheckpointError(
            f"{path} was trained with a global batch of {saved}, this run's is {now}: set "
            f"global_batch {saved} to keep it, or allow_batch_change"
        )
    if meta["optimizer"] != _optimizer_name(trainer):
        raise CheckpointError(
            f"{path} was made with optimizer {meta['optimizer']}, this run uses "
            f"{_optimizer_name(trainer)}"
        )


def load(trainer, path: str) -> int:
    """Loads the checkpoint at ``path`` (a checkpoint, or a root whose
    ``latest`` names one) into ``trainer`` on every rank; returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if not os.path.exists(os.path.join(path, ".metadata")):
        found = latest(path)
        if found is None:
            raise CheckpointError(f"{path}: no checkpoint there (no .metadata, no latest)")
        path = found
    reader = dcp.FileSystemReader(path)
    have = reader.read_metadata().state_dict_metadata
    rank, d = _rank(), trainer.grid.dp_rank
    if "meta" not in have:
        raise CheckpointError(f"{path} is not a clawcomm training checkpoint (no meta entry)")
    head = {"meta": None}
    own = f"trainer/rank{rank}"
    if own in have:
        head[own] = None
    with single_process():
        dcp.load(head, storage_reader=dcp.FileSystemReader(path), no_dist=not dist.is_initialized())
    meta = pickle.loads(head["meta"])
    _check(meta, trainer, path)
    same_layout = meta["layout"] == _layout(trainer)

    request: dict = {}
    if trainer.units is not None:  # ZeRO-3: the load writes whole parameters
        trainer.units.unshard()
    for name, _, p in _local(trainer):
        request[f"model/{_scope(trainer)}{name}"] = p.detach()
    optim_keys = {}
    for name, _, p in _local(trainer):
        prefix = f"optim/{_scope(trainer)}{name}/"
        for key, md in have.items():
            if key.startswith(prefix) and not isinstance(md, BytesStorageMetadata):
                # Moments live with their parameter (a GPU, maybe); torch's
                # optimizers keep the step count on the CPU.
                where = "cpu" if key.endswith("/step") else p.device
                request[key] = torch.empty(md.size, dtype=md.properties.dtype, device=where)
                optim_keys[key] = (p, key[len(prefix) :])
    residual_keys: dict[str, list[str]] = {}
    r = trainer.reducer
    if r is not None and r.compressor is not None:
        old_dp = meta["layout"]["dp"]
        ranks = [d] if old_dp == trainer.cfg.dp else list(range(old_dp))
        for kind in r.compression_state.per_element():
            for name, _, _p in _local(trainer):
                for k in (f"{kind}/dp{j}/{name}" for j in ranks):
                    if k in have:
                        request[k] = torch.empty(have[k].size, dtype=have[k].properties.dtype)
                        residual_keys.setdefault((kind, name), []).append(k)
    if trainer.outer is not None:  # loaded in place
        request.update(
            {k: t for k, t in trainer.outer.tensors(_names(trainer), d).items() if k in have}
        )
    rng_key = f"rng/rank{rank}"
    if same_layout and rng_key in have:
        request[rng_key] = None
    with single_process():
        dcp.load(request, storage_reader=reader, no_dist=not dist.is_initialized())

    optim: dict = {}
    for key, (p, k) in optim_keys.items():
        optim.setdefault(p, {})[k] = request[key]
    trainer.load_optimizer_state(optim)
    state = pickle.loads(head[own]) if head.get(own) is not None else None
    # What the reducer learned holds at this layout only. Checkpoints written
    # before the reducer had a state_dict kept the same fields at the top.
    learned = state and state.get("reducer", state if "learned" in state else None)
    if r is not None and same_layout and learned:
        r.load_state_dict(learned)
    if trainer.outer is not None and same_layout and state and state.get("outer"):
        trainer.outer.load_small_state(state["outer"])
    if r is not None and r.compressor is not None:
        for (kind, name), keys in residual_keys.items():
            (bucket, slot), cs = r.slot[_index_of(trainer, name)], r.compression_state
            res = (cs.residual if kind == "residual" else cs.momentum)(bucket.index, bucket.zeros())
            saved = torch.stack([request[k] for k in keys]).mean(0)
            bucket.segment(res, slot).copy_(saved.flatten())
    trainer.lay_out_shards()  # (ZeRO-3: sharded again before the next step, a layer at a time)
    if rng_key in request:
        rng.restore(request[rng_key])
    trainer.step_index = int(meta["step"])
    _barrier()
    return trainer.step_index
