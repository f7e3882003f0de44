"""``clawcomm train``: the trainer from the command line.

    clawcomm train --nproc 4 --dp 2 --pp 2 --schedule 1f1b --microbatches 8 --steps 300
    clawcomm train --model mlp --pp 4 --schedule zb1 --microbatches 8 --metrics runs/run.jsonl
    clawcomm train --config run.toml --compression topk:0.01
    torchrun --nproc-per-node 4 -m clawcomm.train --dp 2 --pp 2      # one host or many

It spawns ``--nproc`` local ranks (default dp * tp * pp), or, under torchrun,
uses the ranks torchrun started. Models: ``gpt`` (character-level, on the
Python documentation bundled with CPython or ``--text FILE``), ``mlp`` (on
scikit-learn's digits) and ``wait`` (layers that sleep as on an
accelerator, for measuring schedules). Rank 0 prints the effective batch and
the scaled learning rate, shows a progress bar, writes ``--metrics`` (JSON
lines: step, loss, lr, grad_norm, samples_per_s, tokens_per_s, step_ms,
bubble, bubble_predicted, bytes_sent, ...) and ends with a summary. Every
setting is a flag and a key of ``--config FILE.toml``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from clawcomm import outputs
from clawcomm.train import failure, flags, resume, stop
from clawcomm.train.config import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml", help="settings (flags given here win)")
    p.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (dp * tp * pp)")
    p.add_argument(
        "--transport", choices=("auto", "shm", "tcp"), default="auto", help="clawcomm transport"
    )
    p.add_argument("--backend", default="clawcomm", help="torch.distributed backend (clawcomm)")
    flags.add_arguments(p)


class Events:
    """Recovery events as JSON lines in ``<checkpoint_dir>/events.jsonl``
    (every rank appends; one clock, the host's): what examples/recovery.py
    splits the time from a kill to training again into. A no-op without a
    checkpoint directory."""

    def __init__(self, cfg: TrainConfig, rank: int):
        self.path = os.path.join(cfg.checkpoint_dir, "events.jsonl") if cfg.checkpoint_dir else ""
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def log(self, event: str, **fields) -> None:
        if not self.path:
            return
        import json

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        line = {"event": event, "time": time.time(), "rank": self.rank, "attempt": self.attempt}
        line.update(fields)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())


def train_rank(cfg: TrainConfig, announce: bool = True, launched: bool = False) -> list[dict]:
    """Runs the training on this rank (the process group is up); returns
    the metrics of every step (rank 0's carry the bubble prediction).
    ``launched``: below ``clawcomm train``'s launcher, which says the
    signals (its ranks hear a Ctrl-C as its SIGTERM)."""
    import signal

    import torch.distributed as dist

    from clawcomm.train import checkpoint_files, models
    from clawcomm.train.trainer import Trainer

    rank = dist.get_rank() if dist.is_initialized() else 0
    events = Events(cfg, rank)
    events.log("group_ready")
    model, loss, optimizer, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss, optimizer, cfg, tokens_per_sample=tokens, sample=sample)
    if rank == 0 and announce:
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        print(f"clawcomm train: {cfg.model}, {params / 1e6:.2f}M parameters", flush=True)
        print(trainer.describe(), flush=True)
    start = 0
    if cfg.resume and cfg.checkpoint_dir:
        found = checkpoint_files.choose(cfg.checkpoint_dir)  # (resume.plan said which)
        if found is None:
            if rank == 0 and announce:  # right for a first attempt, but said
                print(
                    f"clawcomm train: --resume: no checkpoint in {cfg.checkpoint_dir} yet; "
                    "starting from step 0",
                    flush=True,
                )
        else:
            t0 = time.perf_counter()
            start = trainer.load_checkpoint(found.path)
            events.log("resumed", step=start, load_s=time.perf_counter() - t0)
            if rank == 0 and announce:
                print(
                    f"clawcomm train: resumed from step {start} of {cfg.checkpoint_dir} "
                    f"(loaded in {time.perf_counter() - t0:.2f} s)",
                    flush=True,
                )
    first = [True]

    def after_step(m: dict) -> None:
        if first[0]:
            first[0] = False
            events.log("first_step", step=m["step"])
        if "checkpoint_ms" in m and rank == 0 and announce:
            say(saved_line(m, cfg.async_checkpoint))
        drill = rank == cfg.kill_rank and events.attempt == 0 and m["step"] == cfg.kill_at_step
        if drill:  # the fault drill: die as a crashed or preempted process would
            events.log("killed", step=m["step"])
            os.kill(os.getpid(), signal.SIGKILL)

    def durable(path: str, seconds: float) -> None:
        if announce:
            size = checkpoint_files.size_bytes(path) / 1e6
            say(f"clawcomm train: checkpoint {path} durable ({size:.1f} MB, {seconds:.2f} s)")

    def on_signal(signum: int) -> None:
        # torchrun ends the other ranks (SIGTERM) as soon as it sees one
        # die, which can be before a rank busy computing reaches its next
        # collective and hears of the death itself: the events then say it
        # was ended.
        events.log("terminated", signal=stop.name(signum))
        if rank == 0 and announce and not launched:
            say(stop.request_line(signum, cfg.checkpoint_dir))

    trainer.on_durable = durable if rank == 0 else None
    trainer.stop = stop.StopRequest(on_signal).install()
    batches = _batches(cfg, trainer, ds, start)
    try:
        return trainer.fit(
            batches,
            metrics_file=cfg.metrics or None,
            progress=not cfg.quiet,
            log=after_step,
            checkpoint_dir=cfg.checkpoint_dir or None,
            checkpoint_every=cfg.checkpoint_every,
            keep_checkpoints=cfg.keep_checkpoints,
            val_batches=_held_out(cfg, trainer, ds),
        )
    except BaseException as e:
        events.log("failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        failure.note_step(e, rank, trainer.step_index + 1)
        raise
    finally:
        if hasattr(batches, "close"):
            batches.close()
        trainer.stop.uninstall()
        trainer.close()


def _held_out(cfg: TrainConfig, trainer, ds) -> list | None:
    """``--eval-batches`` batches of ``--data-val``, the same at every
    evaluation (drawn with their own seed), or None."""
    if not cfg.data_val:
        return None
    from clawcomm.train import tokens

    val = tokens.TokenFile(cfg.data_val, cfg.seq_len, cfg.data_dtype)
    _check_val(ds, val)
    rows, need = trainer.data_rows()
    return tokens.held_out(val, cfg.effective_batch, cfg.seed, rows, need, cfg.eval_batches)


def _check_val(ds, val) -> None:
    if val.vocab > ds.vocab:
        raise ValueError(
            f"--data-val {val.path} holds ids up to {val.vocab - 1}, past the vocabulary of "
            f"--data {ds.path} ({ds.vocab}): tokenise both with one tokeniser"
        )


def read_corpus(cfg: TrainConfig) -> list[str]:
    """The corpus read as the ranks (and the planner) will read it, before
    they start: what they could not train on is refused in one line naming
    the file. Returns the lines that say what each token file was read as."""
    from clawcomm.train import data, tokens

    cfg.check_files()
    if not cfg.is_gpt:
        return []
    if cfg.text:
        data.CharText.check(data.read_text(cfg.text), cfg.seq_len, cfg.text)
    if not cfg.data:
        return []
    ds = tokens.TokenFile(cfg.data, cfg.seq_len, cfg.data_dtype)
    lines = [f"clawcomm train: --data {ds.describe()}"]
    if cfg.data_val:
        val = tokens.TokenFile(cfg.data_val, cfg.seq_len, cfg.data_dtype)
        _check_val(ds, val)
        lines.append(f"clawcomm train: --data-val {val.describe()}")
    return lines


def _batches(cfg: TrainConfig, trainer, ds, start: int):
    """The steps' batches: a token file's as this replica's rows, others
    whole; prefetched on a thread (``--prefetch``)."""
    from clawcomm.train import tokens
    from clawcomm.train.data import global_batches

    if isinstance(ds, tokens.TokenFile):
        rows, need = trainer.data_rows()
        batches = tokens.replica_batches(ds, cfg.effective_batch, cfg.seed, rows, need, start)
    else:
        batches = global_batches(ds, cfg.effective_batch, cfg.seed, start=start)
    if cfg.prefetch <= 0:
        return batches
    return tokens.Prefetcher(batches, cfg.prefetch, pin=trainer.device.type == "cuda")


def say(line: str) -> None:
    """One line on rank 0 that leaves the progress bar where it is."""
    from tqdm import tqdm

    tqdm.write(line)
    sys.stdout.flush()


def saved_line(m: dict, asynchronous: bool) -> str:
    from clawcomm.train import checkpoint_files

    if asynchronous:
        return (
            f"clawcomm train: checkpoint of step {m['step']}: state copied in "
            f"{m['checkpoint_ms']:.0f} ms; {m['checkpoint']} is written meanwhile"
        )
    size = checkpoint_files.size_bytes(m["checkpoint"]) / 1e6
    return (
        f"clawcomm train: checkpoint of step {m['step']} saved in {m['checkpoint']} "
        f"({size:.1f} MB, {m['checkpoint_ms']:.0f} ms)"
    )


def stopped_line(metrics: list[dict], signum: int = 0, resume: bool = False) -> str:
    """The run's last line when a signal stopped it, or ''. ``signum``: the
    signal the launcher took (its ranks heard it as SIGTERM); ``resume``:
    whether the command has --resume already."""
    if not metrics or not metrics[-1].get("stopped_by"):
        return ""
    m = metrics[-1]
    signum = signum or m["stopped_by"]
    again = "run the same command" if resume else "add --resume to the same command"
    where = (
        f"; checkpoint {m['checkpoint']}: {again} to go on"
        if "checkpoint" in m
        else "; nothing saved (no --checkpoint-dir)"
    )
    return f"clawcomm train: stopped by {stop.name(signum)} after step {m['step']}{where}"


def _spawned(rank, world, cfg):
    stop.ignore_sigint()  # the launcher passes a Ctrl-C on as one SIGTERM
    return train_rank(cfg, launched=True)


def summary(metrics: list[dict], cfg: TrainConfig) -> str:
    import statistics

    if not metrics:
        return "no steps run"
    tail = metrics[len(metrics) // 2 :] or metrics  # steady state: the second half
    numbers = [k for k, v in tail[-1].items() if isinstance(v, int | float)]
    med = {k: statistics.median(m[k] for m in tail if k in m) for k in numbers}
    first, last = metrics[0], metrics[-1]
    if first["step"] == 1:
        span = f"after {len(metrics)} steps (first {first['loss']:.4f})"
    else:  # a resumed run: its steps are not the run's
        span = (
            f"at step {last['step']}, after {len(metrics)} steps resumed from step "
            f"{first['step'] - 1} ({first['loss']:.4f} at step {first['step']})"
        )
    lines = [
        f"{len(metrics)} steps; the wait model's layers only wait (it has no loss)"
        if cfg.model == "wait"
        else f"final loss {last['loss']:.4f} {span}"
        + (f", held-out loss {last['val_loss']:.4f}" if "val_loss" in last else ""),
        f"median of the second half: step {med['step_ms']:.1f} ms, "
        f"{med['samples_per_s']:.1f} samples/s"
        + (f", {med['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in med else "")
        + f", bubble {med['bubble']:.3f}"
        + (f" (predicted {med['bubble_predicted']:.3f})" if "bubble_predicted" in med else "")
        + f", {med['bytes_sent'] / 1e6:.2f} MB sent per step"
        + (
            f", data wait {med['data_wait_ms']:.2f} ms "
            f"({100 * med['data_wait_ms'] / med['step_ms']:.1f}% of the step)"
            if "data_wait_ms" in med
            else ""
        ),
        _cost_line(med, metrics[0]),
    ]
    return "\n".join(lines)


def _cost_line(med: dict, first: dict) -> str:
    """What a step cost: device-seconds, the ranks' CPU-seconds, and energy
    where it was metered."""
    line = f"cost per step: {med.get('device_s', 0):.3f} device-s"
    if "cpu_s" in med:
        line += f" ({med['cpu_s']:.3f} CPU-s)"
    if "energy_j" in med:
        return line + (
            f", {med['energy_j']:.2f} J ({med['energy_per_sample_j'] * 1e3:.1f} mJ per sample)"
        )
    return line + f", energy n/a ({first.get('energy_note', 'not metered')})"


def run(args: argparse.Namespace) -> int:
    try:
        cfg = flags.from_args(args, args.config)
    except (ValueError, OSError) as e:
        print(f"clawcomm train: error: {e}", file=sys.stderr)
        return 2
    from clawcomm.launch import check_settings, under_torchrun

    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.nproc or cfg.world)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:  # (a CheckpointError and an outputs.OutputError are ValueErrors too)
        check_settings()  # every CLAWCOMM_* setting, once, before any rank starts (or a plan)
        read = read_corpus(cfg)  # (the planner reads it too)
        cfg.check_tp()  # (before a plan: the planner does not search tp)
        if cfg.layout == "auto":
            if torchrun:  # each rank would profile, and might choose, on its own
                raise ValueError(
                    "--layout auto plans before the ranks start: under torchrun, run "
                    "clawcomm plan and pass the layout flags it prints"
                )
            from clawcomm.plan import search as plan

            cfg = plan.choose(cfg, world, say=lambda text: print(text, flush=True))
        cfg.check(world)
        build_check(cfg)
        cfg, changed = resume.plan(cfg)
        for flag, (path, folder) in _outputs(cfg).items() if rank0 else ():
            outputs.check(flag, path, folder)
    except ValueError as e:
        print(f"clawcomm train: error: {str(e).removeprefix('clawcomm: ')}", file=sys.stderr)
        return 2
    for line in [*read, changed] if rank0 else ():
        if line:
            print(line, flush=True)
    if torchrun:
        import torch.distributed as dist

        import clawcomm  # noqa: F401  (registers the backend)

        os.environ.setdefault("CLAWCOMM_TRANSPORT", args.transport)
        os.environ.update(_engine_env(cfg))
        dist.init_process_group(args.backend)
        try:
            metrics = train_rank(cfg)
            if dist.get_rank() == 0:
                _finish(metrics, cfg)
        finally:
            dist.destroy_process_group()
        return _status(metrics)
    # Imported once here rather than by every forked rank: an optimizer's
    # construction imports torch._dynamo (2.5 s of CPU), a save DCP (1.5 s).
    import torch._dynamo  # noqa: F401

    from clawcomm.launch import RankFailure, run_ranks

    if cfg.checkpoint_dir:
        import torch.distributed.checkpoint  # noqa: F401
    with stop.Launcher(cfg.checkpoint_dir) as launcher:
        try:
            results = run_ranks(
                _spawned, world, cfg, backend=args.backend, timeout=24 * 3600, pg_timeout=300,
                env={"CLAWCOMM_TRANSPORT": args.transport, **_engine_env(cfg)},
            )  # fmt: skip
        except RankFailure as e:
            if launcher.killed:
                print(f"clawcomm train: stopped at once by a second {stop.name(launcher.signum)}",
                      file=sys.stderr)  # fmt: skip
                return stop.exit_status(launcher.signum)
            print(
                failure.summary(e.errors, e.pids, cfg.checkpoint_dir, cfg.resume), file=sys.stderr
            )
            return 1
    _finish(results[0], cfg, launcher.signum)
    return _status(results[0], launcher.signum)


def _engine_env(cfg: TrainConfig) -> dict[str, str]:
    """What the ranks' engines need from the config: the deterministic
    reductions under --deterministic."""
    from clawcomm.train.deterministic import ENV

    return {ENV: "1"} if cfg.deterministic else {}


def _finish(metrics: list[dict], cfg: TrainConfig, signum: int = 0) -> None:
    """What a run ends with on rank 0 (or the launcher): the summary, the
    files written, and how a signal stopped it. ``signum``: the signal the
    launcher took, which its ranks heard as SIGTERM."""
    print(summary(metrics, cfg))
    _say_written(cfg)
    line = stopped_line(metrics, signum, cfg.resume)
    if line:
        print(line, flush=True)


def _status(metrics: list[dict], signum: int = 0) -> int:
    """The exit status: 128 + the signal that stopped the run, else 0."""
    signum = signum or (metrics[-1].get("stopped_by", 0) if metrics else 0)
    return stop.exit_status(signum) if signum else 0


def _outputs(cfg: TrainConfig) -> dict[str, tuple[str, bool]]:
    """Every path the run writes: flag -> (path, whether it is a folder)."""
    return {
        "--metrics": (cfg.metrics, False),
        "--trace": (cfg.trace, False),
        "--timeline": (cfg.timeline, False),
        "--tensorboard": (cfg.tensorboard, True),
        "--chakra": (cfg.chakra, True),
        "--checkpoint-dir": (cfg.checkpoint_dir, True),
    }


def _say_written(cfg: TrainConfig) -> None:
    """One line for each file or folder the run wrote (checkpoints are said
    as they are saved)."""
    what = {"--metrics": "metrics", "--trace": "trace", "--timeline": "timeline",
            "--tensorboard": "TensorBoard logs", "--chakra": "Chakra traces"}  # fmt: skip
    for flag, (path, _) in _outputs(cfg).items():
        if flag in what and path and os.path.exists(path):
            outputs.wrote("clawcomm train", what[flag], path)


def build_check(cfg: TrainConfig) -> None:
    """Checks that need the model: more stages than layers."""
    layers = cfg.layers + 2 if cfg.is_gpt else cfg.layers
    if cfg.num_stages > layers:
        raise ValueError(
            f"{cfg.num_stages} stages (pp {cfg.pp} x v {cfg.virtual_stages}) but the {cfg.model} "
            f"model has only {layers} layers; use fewer stages or --layers {cfg.num_stages}"
            + (f" - 2 = {cfg.num_stages - 2} or more" if cfg.is_gpt else " or more")
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="clawcomm train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return run(p.parse_args(argv))
