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
    residual/dp<d>/<name>      error-feedback residual of data-parallel rank d (at tp > 1
                               a parameter left whole keeps one per TP rank t:
                               residual/dp<d>/tp<t>/<name>; see _residual_sources)
    momentum/dp<d>/<name>      its DGC momentum (the compressor's, not the optimizer's)
    rng/rank<r>                torch, Python and numpy RNG states of rank r
    trainer/rank<r>            rank r's reducer state: compression step, call
                               counts and small per-bucket tensors (PowerSGD's
                               Q), the learned bucket order and counts
    meta                       format, step, model (names and shapes),
                               compressor, optimizer, layout, and the global
                               batch a resume keeps (clawcomm.train.resume)

Parameters and optimizer state are replicated over data-parallel ranks and
split over pipeline stages, tensor-parallel ranks and (experts)
expert-parallel ranks; DCP writes each key once, whole (a tensor- or
expert-parallel rank writes its pieces of it: ``checkpoint_pieces``).
Loading asks each rank for the keys, or the pieces, of the parameters it
holds now, so a checkpoint taken at dp2 x pp2 loads at dp1 x pp4, one taken
at tp 2 at tp 1 or 4, and one at ep 2 at ep 1 or 4 (with the same global
batch: ``--resume`` derives the accumulation from it). What only makes sense at the same layout (RNG
streams, the reducer's bucket order) is restored only there; residuals of a
different data-parallel width are averaged, which keeps the mean update
they still owe.

How a save becomes a checkpoint atomically, which checkpoints are kept and
the folders' names are ``checkpoint_files.py``'s.
"""

from __future__ import annotations

import os
import pickle
import shutil

import torch
import torch.distributed as dist

from clawcomm.parallel.split import split_of, whole_shape
from clawcomm.parallel.zero import drop_masters
from clawcomm.train import checkpoint_files as files
from clawcomm.train import rng
from clawcomm.train.checkpoint_pieces import LoadPlanner, Pieces, SavePlanner, wrap

FORMAT = 1

CheckpointError = files.CheckpointError  # (what load raises, named where load is)


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


def _layout(trainer) -> dict:
    cfg = trainer.cfg
    return {
        "dp": cfg.dp,
        "pp": cfg.pp,
        "tp": cfg.tp,
        "sequence_parallel": cfg.sequence_parallel_on,
        "ep": cfg.ep,
        "cp": cfg.cp,
        "virtual_stages": cfg.virtual_stages,
        "cuts": list(trainer.cuts),
        "schedule": cfg.schedule,
        # (what the reducer learned differs: the micro-batch tree marks each gradient once)
        **({"deterministic": True} if cfg.deterministic else {}),
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


def _split(p):
    """How ``p`` is split over tensor- or expert-parallel ranks (None: whole)."""
    return split_of(p)


def _like(p, v):
    """``v`` (a tensor of ``p``'s state) as the checkpoint keys it: pieces
    of the whole where it is shaped as ``p``'s slice."""
    return wrap(v, _split(p)) if v.shape == p.shape else v


def _outer_tensors(trainer, d: int) -> dict:
    """The outer sync's tensors by key; at tp > 1 each TP rank's apart
    (they load at the same tp only: see _check)."""
    out = trainer.outer.tensors(_names(trainer), d)
    if trainer.cfg.tp == 1:
        return out
    return {f"{k}@tp{trainer.grid.tp_rank}": t for k, t in out.items()}


def _residual_key(trainer, kind: str, d: int, name: str, p) -> str:
    """Where a per-element compression buffer is kept: by data-parallel rank,
    and at tp > 1 by TP rank too for a parameter left whole, whose gradient
    each TP rank reduces (and compresses) on its own before the TP group
    makes them one; a split one's pieces are this rank's anyway."""
    t = trainer.grid.tp_rank
    if trainer.cfg.tp > 1 and _split(p) is None:
        return f"{kind}/dp{d}/tp{t}/{name}"
    return f"{kind}/dp{d}/{name}"


def _residual_sources(trainer, meta: dict, kind: str, name: str, p) -> tuple[list[str], float]:
    """(the saved keys whose mean, times the factor, is this rank's buffer
    for ``p``). The mean over the saved data-parallel ranks where dp changed
    (what the replicas still owe on average). For a parameter left whole at
    tp > 1 the TP ranks' buffers add up to what is owed with sequence
    parallelism (each reduced its own tokens' part) and are equal without;
    at the same tp each rank takes its own, at another the total is shared
    out: summed (sequence parallel then) and divided among the new TP ranks
    (sequence parallel now)."""
    old = meta["layout"]
    d, cfg = trainer.grid.dp_rank, trainer.cfg
    dps = [d] if old["dp"] == cfg.dp else list(range(old["dp"]))
    old_tp = old.get("tp", 1)
    if _split(p) is not None or old_tp == 1 and cfg.tp == 1:
        return [f"{kind}/dp{j}/{name}" for j in dps], 1.0
    if old_tp == cfg.tp:
        return [f"{kind}/dp{j}/tp{trainer.grid.tp_rank}/{name}" for j in dps], 1.0
    tps = [f"tp{t}/" for t in range(old_tp)] if old_tp > 1 else [""]
    summed = len(tps) if old.get("sequence_parallel") else 1
    shared = cfg.tp if cfg.sequence_parallel_on else 1
    return [f"{kind}/dp{j}/{t}{name}" for j in dps for t in tps], summed / shared


def _names(trainer) -> list[str]:
    return [trainer.names[id(p)] for p in trainer.params]


def _reduced(trainer):
    """(name, index in the reducer, parameter) of every parameter the
    data-parallel reducer holds (all but spread experts)."""
    index = {id(p): i for i, p in enumerate(trainer.reducer.params)}
    for name, _, p in _local(trainer):
        if id(p) in index:
            yield name, index[id(p)], p


def _residual_segments(trainer) -> dict[str, torch.Tensor]:
    """This rank's per-element compression buffers (error-feedback residual;
    DGC's momentum), cut by parameter: "kind/name" -> segment."""
    r = trainer.reducer
    if r is None or r.compressor is None:
        return {}
    out = {}
    for kind, buffers in r.compression_state.per_element().items():
        for name, i, _ in _reduced(trainer):
            bucket, slot = r.slot[i]
            res = buffers.get(bucket.index)
            if res is not None:
                out[f"{kind}/{name}"] = bucket.segment(res, slot).clone()
    return out


def _optimizer_state(trainer) -> dict:
    """{parameter: {key: tensor}}: the optimizer's state by the rank's
    parameters, whole at any ZeRO stage (under ZeRO a collective over the
    data-parallel group: every rank calls it)."""
    if trainer.shards is not None:
        out = trainer.shards.state(trainer.optimizer)
        opt = trainer.optimizer
        out.update({p: dict(opt.state[p]) for p in trainer._outside() if p in opt.state})
        return out
    return {p: dict(s) for p, s in trainer.optimizer.state.items()}


def _load_optimizer_state(trainer, state: dict) -> None:
    """The inverse of ``_optimizer_state``."""
    if trainer.shards is not None:
        outside = {id(p) for p in trainer._outside()}  # (whole: in the optimizer now)
        for p, s in state.items():
            if id(p) in outside:
                trainer.optimizer.state.setdefault(p, {}).update(s)
        trainer.shards.load({p: s for p, s in state.items() if id(p) not in outside})
        return
    for p, s in state.items():  # (a ZeRO run's master weights are not state here)
        trainer.optimizer.state.setdefault(p, {}).update(drop_masters(s))


def state_dict(trainer) -> dict:
    """This rank's part of the checkpoint (see the module docstring)."""
    rank, d = files.rank(), trainer.grid.dp_rank
    sd: dict = {}
    optim = _optimizer_state(trainer)  # whole per parameter, whatever the ZeRO stage
    with trainer.whole_params() as gathered:  # ZeRO-3: copies, the gathered ones freed after
        for name, _, p in _local(trainer):
            t = p.detach().clone() if gathered else p.detach()
            sd[f"model/{_scope(trainer)}{name}"] = wrap(t, _split(p))
    for name, _, p in _local(trainer):
        for k, v in optim.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                sd[f"optim/{_scope(trainer)}{name}/{k}"] = _like(p, v)
    params = {n: p for n, _, p in _local(trainer)}
    for kind_name, seg in _residual_segments(trainer).items():
        kind, name = kind_name.split("/", 1)
        p = params[name]
        sd[_residual_key(trainer, kind, d, name, p)] = wrap(seg.view(p.shape), _split(p))
    sd[f"rng/rank{rank}"] = rng.state()
    r, outer = trainer.reducer, trainer.outer
    if outer is not None:
        sd.update(_outer_tensors(trainer, d))
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


def save(trainer, root: str, keep: int = 2, asynchronous: bool = False, group=None):
    """Saves ``trainer`` under ``root`` (every rank calls it) and returns the
    checkpoint's path. Keeps the newest ``keep`` checkpoints.

    ``asynchronous``: returns a ``checkpoint_files.PendingSave`` as soon as
    the state has been copied; DCP writes the files from a thread, talking
    over ``group`` (a group of its own, so that its collectives never
    interleave with the training's), and ``wait()`` commits. Until then
    ``latest`` still names the previous checkpoint."""
    import torch.distributed.checkpoint as dcp

    rank = files.rank()
    name = files.folder_name(trainer.step_index)
    tmp = files.new_folder(root, name)
    final = os.path.join(root, name)
    sd = state_dict(trainer)
    try:
        files.check_room(_state_bytes(sd), root, name)
    except OSError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    writer = dcp.FileSystemWriter(tmp, sync_files=True)

    def commit() -> None:
        if rank == 0:
            files.commit(root, tmp, name, keep)

    if asynchronous:
        with files.single_process():
            future = dcp.async_save(
                sd, storage_writer=writer, process_group=group, planner=SavePlanner()
            )
        return files.PendingSave(future, commit, final)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with files.single_process():
            dcp.save(
                sd, storage_writer=writer, planner=SavePlanner(), no_dist=not dist.is_initialized()
            )
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        # The disk filled up meanwhile (another writer), or the write failed
        # otherwise: say where and how much room is left, in place of torch's
        # zip writer's "unexpected pos" message; `latest` is untouched.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        left = files.mb(files.free_bytes(root))
        raise OSError(
            f"clawcomm.train: writing checkpoint {name} into {root} failed ({left} free there "
            f"now): {str(e).strip().splitlines()[-1][:200]}"
        ) from e
    commit()
    files.barrier()
    return final


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
    if trainer.cfg.sync != "every-step" and meta["layout"].get("tp", 1) != trainer.cfg.tp:
        raise CheckpointError(
            f"{path} holds replicas that meet every few steps at tp "
            f"{meta['layout'].get('tp', 1)}; their outer state is kept per tensor-parallel rank, "
            f"and this run has tp {trainer.cfg.tp} (load it at tp {meta['layout'].get('tp', 1)})"
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
    """Loads the checkpoint at ``path`` into ``trainer`` on every rank and
    returns its step. ``path`` is a checkpoint, or a root: then the one
    ``latest`` names, or the newest intact one before it where its files
    are damaged (``checkpoint_files.choose``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if os.path.exists(os.path.join(path, ".metadata")):  # this checkpoint, and no other
        wrong = files.damage(path)
        if wrong:
            raise CheckpointError(wrong)
    else:
        found = files.choose(path)
        if found is None:
            raise CheckpointError(f"{path}: no checkpoint there (no .metadata, no latest)")
        path = found.path
    reader = dcp.FileSystemReader(path)
    have = reader.read_metadata().state_dict_metadata
    rank, d = files.rank(), trainer.grid.dp_rank
    if "meta" not in have:
        raise CheckpointError(f"{path} is not a clawcomm training checkpoint (no meta entry)")
    head = {"meta": None}
    own = f"trainer/rank{rank}"
    if own in have:
        head[own] = None
    with files.single_process():
        dcp.load(head, storage_reader=dcp.FileSystemReader(path), no_dist=not dist.is_initialized())
    meta = pickle.loads(head["meta"])
    _check(meta, trainer, path)
    # (checkpoints from before tensor parallelism name no tp: theirs was 1)
    old = {"tp": 1, "sequence_parallel": False, "ep": 1, "cp": 1, **meta["layout"]}
    same_layout = old == _layout(trainer)

    request: dict = {}
    if trainer.units is not None:  # ZeRO-3: the load writes whole parameters
        trainer.units.unshard()
    for name, _, p in _local(trainer):
        request[f"model/{_scope(trainer)}{name}"] = wrap(p.detach(), _split(p))
    optim_keys = {}
    for name, _, p in _local(trainer):
        prefix = f"optim/{_scope(trainer)}{name}/"
        for key, md in have.items():
            if key.startswith(prefix) and not isinstance(md, BytesStorageMetadata):
                # Moments live with their parameter (a GPU, maybe); torch's
                # optimizers keep the step count on the CPU.
                where = "cpu" if key.endswith("/step") else p.device
                whole = list(md.size) == whole_shape(p)
                shape = p.shape if whole else md.size
                t = torch.empty(shape, dtype=md.properties.dtype, device=where)
                request[key] = _like(p, t) if whole else t
                optim_keys[key] = (p, key[len(prefix) :])
    residual_keys: dict[tuple, tuple[list[str], float]] = {}
    r = trainer.reducer
    if r is not None and r.compressor is not None:
        for kind in r.compression_state.per_element():
            for name, _, p in _reduced(trainer):
                keys, factor = _residual_sources(trainer, meta, kind, name, p)
                for k in keys:
                    if k in have:
                        t = torch.empty(p.shape, dtype=have[k].properties.dtype)
                        request[k] = wrap(t, _split(p))
                        residual_keys.setdefault((kind, name), ([], factor))[0].append(k)
    if trainer.outer is not None:  # loaded in place
        request.update({k: t for k, t in _outer_tensors(trainer, d).items() if k in have})
    rng_key = f"rng/rank{rank}"
    if same_layout and rng_key in have:
        request[rng_key] = None
    with files.single_process():
        dcp.load(
            request,
            storage_reader=reader,
            planner=LoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    request = {k: v.local if isinstance(v, Pieces) else v for k, v in request.items()}

    optim: dict = {}
    for key, (p, k) in optim_keys.items():
        optim.setdefault(p, {})[k] = request[key]
    _load_optimizer_state(trainer, optim)
    state = pickle.loads(head[own]) if head.get(own) is not None else None
    # What the reducer learned holds at this layout only. Checkpoints written
    # before the reducer had a state_dict kept the same fields at the top.
    learned = state and state.get("reducer", state if "learned" in state else None)
    if r is not None and same_layout and learned:
        r.load_state_dict(learned)
    if trainer.outer is not None and same_layout and state and state.get("outer"):
        trainer.outer.load_small_state(state["outer"])
    if r is not None and r.compressor is not None:
        index = {n: i for n, i, _ in _reduced(trainer)}
        for (kind, name), (keys, factor) in residual_keys.items():
            (bucket, slot), cs = r.slot[index[name]], r.compression_state
            res = (cs.residual if kind == "residual" else cs.momentum)(bucket.index, bucket.zeros())
            saved = torch.stack([request[k] for k in keys]).mean(0) * factor
            bucket.segment(res, slot).copy_(saved.flatten())
    trainer.lay_out_shards()  # (ZeRO-3: sharded again before the next step, a layer at a time)
    if rng_key in request:
        rng.restore(request[rng_key])
    trainer.step_index = int(meta["step"])
    files.barrier()
    return trainer.step_index
