"""``clawcomm experiment compression``: one small real training run per
compressor, on local ranks, with wire traffic measured by clawcomm.

    clawcomm experiment compression                     # 2 ranks, the default compressors
    clawcomm experiment compression --nproc 4 -c none,topk:0.01,topk:0.001 \\
        --json runs/out.json --plot runs/out.png
    clawcomm experiment compression --model gpt         # the trainer's GPT
    clawcomm experiment compression --layout 2x2 -c none,int8,diloco:8:fragments=2:delay=1

Two tasks, both offline, trained through stock torch DDP on the clawcomm
backend with each compressor installed as a DDP comm hook (clawcomm.hooks),
or at ``--layout DPxPP`` with PP > 1 through the trainer's pipeline
(clawcomm.experiments.layout); sync methods (clawcomm.experiments.methods)
meet through ``clawcomm.train.outer``. Every run starts from the same
weights and sees the same batches:

- ``mlp`` (default): scikit-learn's bundled digits (1797 8x8 images, 10
  classes), an MLP (64-256-256-10, 85k parameters), SGD (momentum 0.5,
  weight decay 1e-2, learning rate decaying linearly to zero), 1000 steps
  of 32 images per rank from a fixed 80/20 split. Final loss: the whole
  training set; accuracy: the test set.
- ``gpt``: ``clawcomm train``'s character-level GPT (4 blocks of width 128,
  0.8M parameters, 64-character context) on the Python documentation bundled
  with CPython, AdamW (learning rate decaying linearly to zero), 300 steps
  of 16 sequences per rank. Final loss: 32 fixed batches of the held-out
  10%; accuracy: next-character accuracy on them.

The table: bytes each rank sent per step (measured on the wire by
clawcomm.comm_stats, frame headers included), the ratio to dense, the mean
step time, the final loss, the accuracy, and the loss gap to dense.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from clawcomm import outputs
from clawcomm.experiments import lab, layout, tasks
from clawcomm.experiments.methods import COMPUTE, parse_method

DEFAULT = (
    "none,fp16,powersgd:4,int8,qsgd:4,sign,topk:0.01,dgc:0.01,randomk:0.01,diloco:32,"
    "diloco:32+int8"
)


# Per model: steps, batch per rank, learning rate.
MODEL_DEFAULTS = {"mlp": (1000, 32, 0.15), "gpt": (300, 16, 3e-3)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp", help="task (mlp)")
    p.add_argument("--nproc", type=int, default=None, help="local ranks (2; or dp x pp)")
    p.add_argument(
        "--layout",
        metavar="DPxPP",
        help="data-parallel replicas x pipeline ranks (2x1, the default; with PP > 1 every "
        "method trains through clawcomm train's pipeline, each stage exchanging over its own "
        "data-parallel group)",
    )
    p.add_argument("-c", "--compressors", "--methods", default=DEFAULT,
                   help=f"comma list of compressor specs ({DEFAULT})")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="training steps (mlp 1000, gpt 300)")
    p.add_argument("--batch", type=int, default=None, help="batch per rank (mlp 32, gpt 16)")
    p.add_argument(
        "--lr", type=float, default=None, help="learning rate (mlp SGD 0.15, gpt AdamW 3e-3)"
    )
    p.add_argument("--warmup", type=int, default=50, help="dense steps before compressing (50)")
    p.add_argument("--weight-decay", type=float, default=1e-2, help="(1e-2)")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (0.5)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer LR (0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="diloco: outer Nesterov momentum (0.9)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu, or cuda: the model, data and gradients on the rank's GPU (ranks share one "
        "when GPUs are fewer), compressed by clawcomm's CUDA kernels",
    )
    p.add_argument("--links", metavar="RATES",
                   help="comma list of link rates (1gbit,10gbit): run on namespace hosts "
                        "with shaped links (root, iproute2)")  # fmt: skip
    p.add_argument("--target-loss", type=float, default=None,
                   help="loss to time methods to (default: 1.05 x dense's final loss)")  # fmt: skip
    p.add_argument(
        "--cost-model",
        metavar="FILE",
        help="calibrated cost model for the projections (clawcomm bench --calibrate)",
    )
    p.add_argument("--json", metavar="FILE", help="write the results and loss curves")
    p.add_argument("--plot", metavar="FILE", help="draw the loss curves (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _wire_bytes(device: str, groups=(None,)) -> int:
    """Bytes this rank sent so far through ``groups`` (None: the default
    group), on the CPU communicator and, for CUDA runs, the CUDA one (CUDA
    IPC payload included)."""
    import clawcomm

    devices = ["cpu"] + (["cuda"] if device == "cuda" else [])
    return sum(
        v["bytes_sent"]
        for g in groups
        for d in devices
        for v in clawcomm.comm_stats(g, device=d).values()
    )


def train_any(rank: int, world_size: int, spec: str, cfg: dict) -> dict | None:
    """One run on one rank: through DDP, or at pp > 1 through the trainer
    (clawcomm.experiments.layout); rank 0 returns the measurements."""
    run = layout.train if cfg.get("pp", 1) > 1 else train
    return run(rank, world_size, spec, cfg)


def train(rank: int, world_size: int, spec: str, cfg: dict) -> dict | None:
    """One run on one rank; rank 0 returns the measurements."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clawcomm.hooks import CompressionHookState, compression_hook
    from clawcomm.train.energy import StepEnergy

    device = cfg.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    task = tasks.gpt_task if cfg["model"] == "gpt" else tasks.mlp_task
    model, loss_fn, make_opt, batch, evaluate = task(cfg, rank)
    method = parse_method(spec)
    outer, groups = None, (None,)  # the groups whose bytes count
    if spec == COMPUTE:  # the same steps, nothing exchanged: the bound
        ddp = DDP(model.to(device))
        ddp.register_comm_hook(None, _no_exchange)
    elif method.sync == "every-step":
        ddp = DDP(model.to(device))
        hook = CompressionHookState(method.compressor, warmup_steps=cfg["warmup"])
        ddp.register_comm_hook(hook, compression_hook)
    else:  # replicas on their own, meeting every H steps (clawcomm.train.outer)
        from clawcomm.train.outer import OuterSync

        ddp = model.to(device)
        # Delayed meetings exchange on a thread, over a group of their own.
        exchange = dist.new_group(list(range(world_size))) if method.delay else None
        outer = OuterSync(list(model.parameters()), None, method.outer_settings(cfg), exchange)
        if exchange is not None:
            groups = (None, exchange)
    opt = make_opt(ddp.parameters())
    # Linear decay to zero: the final loss then measures where training
    # converged rather than the noise of the last mini-batches.
    schedule = torch_lr_schedule(opt, cfg["steps"])
    every = max(1, cfg["steps"] // 50)
    # The curve: (step, loss, bytes sent so far, seconds of steps so far,
    # joules of those steps on every metered rank or None), measured.
    from clawcomm.compression.coding import coding_stats, reset_coding_stats

    reset_coding_stats()  # what +ec did in this run only
    start = _wire_bytes(device, groups)
    meter = StepEnergy(torch.device(device), int(os.environ.get("LOCAL_RANK", rank)))
    joules, running = [0.0], 0.0  # this rank's, at each curve point, and so far
    curve, step_seconds = [(0, evaluate()[0], 0, 0.0)], 0.0
    # Bytes count the compressed steps (all of them if the warm-up is longer than the run).
    counted = cfg["warmup"] + 1 if cfg["warmup"] < cfg["steps"] else 1
    before = start
    for step in range(1, cfg["steps"] + 1):
        if step == counted:  # bytes per step count compressed steps only
            before = _wire_bytes(device, groups)
        x, y = batch()
        t0 = time.perf_counter()
        meter.lap()  # (what came between steps, the evaluations, does not count)
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        schedule.step()
        if outer is not None:
            outer.after_step(step)
        step_seconds += time.perf_counter() - t0
        running += max(meter.lap(), 0.0)
        if step % every == 0 or step == cfg["steps"]:
            curve.append((step, evaluate()[0], _wire_bytes(device, groups) - start, step_seconds))
            joules.append(running)
    if outer is not None:
        outer.close()
    if device == "cuda":
        torch.cuda.synchronize()
    sent = _wire_bytes(device, groups) - before
    final_loss, accuracy = evaluate()
    curve = _with_joules(curve, meter, joules)  # (after the bytes are counted: it sends some)
    result = {
        "coding": coding_stats() if "+ec" in spec else None,
        "compressor": spec,
        "bytes_per_step": sent / (cfg["steps"] - counted + 1),
        "step_ms": 1e3 * step_seconds / cfg["steps"],
        "final_loss": final_loss,
        "test_accuracy": accuracy,
        "curve": curve,
        "parameters": sum(p.numel() for p in model.parameters()),
        "ranks": world_size,
        "energy_note": meter.reason if meter.meter is None else meter.meter.name,
    }
    dist.barrier()
    return result if rank == 0 else None


def _with_joules(curve: list, meter, joules: list[float]) -> list:
    """Each curve point with the joules of the steps up to it on every
    metered rank (one all-reduce), or None where no rank has a meter."""
    import torch
    import torch.distributed as dist

    mine = [*joules, 1.0] if meter.meter is not None else [0.0] * (len(joules) + 1)
    total = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(total)
    metered = total[-1] > 0
    return [(*p, float(total[k]) if metered else None) for k, p in enumerate(curve)]


def _no_exchange(state, bucket):
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())  # each rank's own gradient, unaveraged
    return fut


def torch_lr_schedule(opt, steps: int):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)


def run(args) -> int:
    from clawcomm.cost_model import CostModel
    from clawcomm.launch import RankFailure, check_settings, run_ranks

    specs = [s.strip() for s in args.compressors.split(",") if s.strip()]
    steps, batch, lr = MODEL_DEFAULTS[args.model]
    args.steps = steps if args.steps is None else args.steps
    args.batch = batch if args.batch is None else args.batch
    args.lr = lr if args.lr is None else args.lr
    try:
        check_settings()  # every CLAWCOMM_* setting, before any rank starts
        args.dp, args.pp = layout.parse_layout(args.layout) if args.layout else (args.nproc or 2, 1)
        if args.nproc not in (None, args.dp * args.pp):
            raise ValueError(f"--nproc {args.nproc} is not --layout {args.layout}'s dp x pp")
        args.nproc = args.dp * args.pp
        for s in specs:
            parse_method(s, vars(args))
        if args.nproc < 1 or args.steps < 1 or args.batch < 1 or args.warmup < 0:
            raise ValueError("--nproc, --steps and --batch must be positive, --warmup >= 0")
        if args.pp > 1:
            layout.check(vars(args))
        if args.device == "cuda":
            import torch

            if not (torch.backends.cuda.is_built() and torch.cuda.device_count() > 0):
                raise ValueError("--device cuda: no CUDA GPU (or torch is a CPU build)")
        outputs.check("--json", args.json)
        outputs.check("--plot", args.plot)
    except ValueError as e:  # (an outputs.OutputError too)
        print(f"clawcomm experiment compression: error: {e}", file=sys.stderr)
        return 2
    cfg = {
        k: getattr(args, k)
        for k in (
            "model",
            "steps",
            "batch",
            "lr",
            "warmup",
            "seed",
            "weight_decay",
            "momentum",
            "device",
            "outer_lr",
            "outer_momentum",
            "dp",
            "pp",
        )
    }
    links = [x.strip() for x in (args.links or "").split(",") if x.strip()]
    if links and lab.links_unavailable():
        links = []
    runs = specs + ([COMPUTE] if COMPUTE not in specs else [])
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=len(runs) * max(1, len(links)), file=sys.stderr, unit="run",
                        leave=False)  # fmt: skip
    # A DDP's first construction imports torch._dynamo (2-3 s of CPU): once
    # here, and every rank forked for every method has it.
    import torch._dynamo  # noqa: F401

    groups: dict[str, list[dict]] = {}
    interrupted: list[int] = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, on_interrupt)
    try:
        if links:
            for link in links:
                groups[link] = []  # filled run by run: an interrupt counts what finished
                lab.run_on_link(runs, cfg, link, 3600, progress, groups[link])
        else:
            groups["one host"] = []
            for spec in runs:
                if progress is not None:
                    progress.set_description(spec)
                out = run_ranks(train_any, args.nproc, spec, cfg, timeout=3600,
                                env={"CLAWCOMM_TRANSPORT": args.transport})  # fmt: skip
                groups["one host"].append(out[0])
                if progress is not None:
                    progress.update(1)
    except (KeyboardInterrupt, RankFailure) as e:
        # Ctrl-C reaches the ranks too: whichever notices first, it is one line
        if not interrupted and not isinstance(e, KeyboardInterrupt):
            raise
        if progress is not None:
            progress.close()
            progress = None
        done, total = sum(len(g) for g in groups.values()), len(runs) * max(1, len(links))
        print(f"clawcomm experiment compression: interrupted after {done} of {total} runs; "
              "nothing written", file=sys.stderr)  # fmt: skip
        return 130
    finally:
        signal.signal(signal.SIGINT, before)
        if progress is not None:
            progress.close()
    model = CostModel.load(args.cost_model) if args.cost_model else None
    task = "digits MLP" if args.model == "mlp" else "character GPT"
    what = "images" if args.model == "mlp" else "sequences of 64"
    report = {}
    for link, results in groups.items():
        report[link] = lab.analyse(results, args.target_loss, link if links else None, model)
        shape = f"dp {args.dp} x pp {args.pp}" if args.pp > 1 else ""
        where = (
            f"{args.nproc} hosts, links {link}" if links else f"{args.nproc} ranks on one host"
        ) + (f", {shape}" if shape else "")
        print(
            f"# clawcomm experiment compression: {task} ({results[0]['parameters']} parameters), "
            f"{where}, {args.steps} steps of {args.batch} {what}/rank, {args.warmup} dense "
            f"warm-up steps (compressors; sync methods start local), target loss "
            f"{report[link]['target_loss']}"
        )
        print(lab.table(results))
        report[link]["results"] = results
    prog = "clawcomm experiment compression"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "links": report}, f, indent=1)
        outputs.wrote(prog, "results", args.json)
    if args.plot:
        ylabel = "training loss (full set)" if args.model == "mlp" else "held-out loss"
        lab.plot(groups, args.plot, task, ylabel)
        outputs.wrote(prog, "plot", args.plot)
    return 0
