"""What ``--resume`` decides before the trainer is built: the global batch.

A checkpoint records its global batch (samples per optimizer step, every
replica together). A resume at another layout keeps it: the gradient
accumulation is derived from it, as torchtitan derives it from its fixed
global batch, so that the learning rate, its scaling and the data order
stay the same. Where no whole accumulation gives it, the resume is refused
with the flags that fix it; ``--allow-batch-change`` is the only way to
change it, and the change is printed.
"""

from __future__ import annotations

import dataclasses
import pickle

from clawcomm.train.config import TrainConfig


class BatchChangeError(ValueError):
    """A resume that would change the global batch without --allow-batch-change."""


def plan(cfg: TrainConfig) -> tuple[TrainConfig, str]:
    """``keep_batch`` for the checkpoint ``cfg`` resumes from, if any, and
    the lines to say: which one, where a newer one's files are damaged
    (``checkpoint_files.choose``), and a change of layout. Raises
    CheckpointError in one line where no checkpoint there is intact."""
    from clawcomm.train import checkpoint_files

    if not (cfg.resume and cfg.checkpoint_dir):
        return cfg, ""
    try:
        found = checkpoint_files.choose(cfg.checkpoint_dir)
    except checkpoint_files.CheckpointError as e:
        raise checkpoint_files.CheckpointError(
            f"--resume: {e}; without --resume the run starts from step 0 (its saves replace them)"
        ) from None
    if found is None:
        return cfg, ""
    try:
        meta = read_meta(found.path)
    except Exception as e:  # garbled bytes inside a file of the right size
        raise checkpoint_files.CheckpointError(
            f"--resume: {found.path}: its record (the meta item) cannot be read "
            f"({type(e).__name__}: {str(e)[:80]})"
        ) from None
    cfg, line = keep_batch(cfg, meta, found.path)
    if found.passed_over:
        fell_back = (
            f"clawcomm train: --resume: {'; '.join(found.passed_over)}; going on from "
            f"{found.path}, the newest intact checkpoint"
        )
        line = f"{fell_back}\n{line}" if line else fell_back
    return cfg, line


def read_meta(path: str) -> dict:
    """The checkpoint's own record (step, layout, global batch, ...), read by
    this rank alone (no collective)."""
    import torch.distributed.checkpoint as dcp

    from clawcomm.train.checkpoint_files import single_process

    head = {"meta": None}
    with single_process():
        dcp.load(head, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return pickle.loads(head["meta"])


def _layout(dp, pp, v, acc, mbs, mb) -> str:
    stages = f" x v {v}" if v > 1 else ""
    return f"dp {dp} x pp {pp}{stages}, {mb} micro-batches of {mbs}, accumulation {acc}"


def keep_batch(cfg: TrainConfig, meta: dict, path: str) -> tuple[TrainConfig, str]:
    """This run's config for resuming from ``meta`` (the checkpoint at
    ``path``), and the line that says what changed ('' when nothing did).
    Raises BatchChangeError naming the batch and the flags that fix it."""
    saved = meta.get("global_batch")
    was = meta.get("layout", {})
    if saved is None:  # a checkpoint from before the global batch was recorded
        return cfg, ""
    before = _layout(
        was.get("dp"), was.get("pp"), was.get("virtual_stages", 1), meta.get("accumulation"),
        meta.get("micro_batch_size"), meta.get("microbatches"),
    )  # fmt: skip
    if saved != cfg.effective_batch:
        if cfg.allow_batch_change:
            return cfg, (
                f"clawcomm train: --resume: the global batch changes from {saved} to "
                f"{cfg.effective_batch} (--allow-batch-change): {before} then, "
                f"{_describe(cfg)} now"
            )
        fix = "; or --allow-batch-change to change it"
        if cfg.global_batch:
            raise BatchChangeError(
                f"--resume: {path} was trained with a global batch of {saved}, and "
                f"--global-batch asks for {cfg.global_batch}: drop --global-batch to keep "
                f"{saved}{fix}"
            )
        if saved % cfg.round_batch:
            raise BatchChangeError(
                f"--resume: {path} was trained with a global batch of {saved} ({before}); here "
                f"a schedule run is micro-batch-size x microbatches x dp = "
                f"{cfg.micro_batch_size} x {cfg.microbatches} x {cfg.dp} = {cfg.round_batch} "
                f"samples, which does not divide it: choose --micro-batch-size or --microbatches "
                f"so that it does{fix}"
            )
        cfg = dataclasses.replace(cfg, global_batch=saved)
    elif (was.get("dp"), was.get("pp"), was.get("tp", 1)) == (cfg.dp, cfg.pp, cfg.tp) and meta.get(
        "accumulation"
    ) == cfg.accumulation:
        return cfg, ""
    return cfg, (
        f"clawcomm train: --resume at another layout keeps the global batch of {saved}: "
        f"{before} then, {_describe(cfg)} now"
    )


def _describe(cfg: TrainConfig) -> str:
    return _layout(
        cfg.dp, cfg.pp, cfg.virtual_stages, cfg.accumulation, cfg.micro_batch_size,
        cfg.microbatches,
    )  # fmt: skip
