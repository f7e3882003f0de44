"""``clawcomm experiment compression``: one small real training run per
compressor, on local ranks, with wire traffic measured by clawcomm.

    clawcomm experiment compression                     # 2 ranks, the default compressors
    clawcomm experiment compression --nproc 4 -c none,topk:0.01,topk:0.001 \\
        --json out.json --plot out.png
    clawcomm experiment compression --model gpt         # the trainer's GPT

Two tasks, both offline, trained through stock torch DDP on the clawcomm
backend with each compressor installed as a DDP comm hook (clawcomm.hooks);
every run starts from the same weights and sees the same batches:

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
import math
import sys
import time

DEFAULT = "none,fp16,powersgd:4,int8,qsgd:4,sign,topk:0.01,dgc:0.01,randomk:0.01"


# Per model: steps, batch per rank, learning rate.
MODEL_DEFAULTS = {"mlp": (1000, 32, 0.15), "gpt": (300, 16, 3e-3)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp", help="task (mlp)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (2)")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu, or cuda: the model, data and gradients on the rank's GPU (ranks share one "
        "when GPUs are fewer), compressed by clawcomm's CUDA kernels",
    )
    p.add_argument("--json", metavar="FILE", help="write the results and loss curves")
    p.add_argument("--plot", metavar="FILE", help="draw the loss curves (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _data(seed: int):
    import numpy as np

    from clawcomm._optional import require

    load_digits = require("sklearn.datasets", "--model mlp (the digits data)").load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def _wire_bytes(device: str) -> int:
    """Bytes this rank sent so far, on the CPU communicator and, for CUDA
    runs, the CUDA one (CUDA IPC payload included)."""
    import clawcomm

    devices = ["cpu"] + (["cuda"] if device == "cuda" else [])
    return sum(v["bytes_sent"] for d in devices for v in clawcomm.comm_stats(device=d).values())


def _mlp_task(cfg: dict, rank: int):
    """The model, an optimizer factory, a batch sampler, and an evaluation
    returning (loss, accuracy) of the task."""
    import torch

    dev = cfg.get("device", "cpu")
    xtr, ytr, xte, yte = (torch.from_numpy(a).to(dev) for a in _data(cfg["seed"]))
    torch.manual_seed(cfg["seed"])
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)

    def make_opt(params):
        return torch.optim.SGD(
            params, lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"]
        )

    def batch():
        idx = torch.randint(0, len(xtr), (cfg["batch"],), generator=gen).to(dev)
        return xtr[idx], ytr[idx]

    def evaluate():
        with torch.no_grad():
            loss = float(loss_fn(model(xtr), ytr))
            accuracy = float((model(xte).argmax(1) == yte).float().mean())
        return loss, accuracy

    return model, loss_fn, make_opt, batch, evaluate


def _gpt_task(cfg: dict, rank: int):
    import torch

    from clawcomm.train import data, models

    ds = data.CharText(data.default_text(), 64)
    torch.manual_seed(cfg["seed"])
    model = models.gpt(ds.vocab, 128, 4, 4, 64)

    def loss_fn(logits, y):
        return models.gpt_loss(logits, y) / y.numel()

    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    dev = cfg.get("device", "cpu")
    held_out = [
        tuple(
            t.to(dev)
            for t in ds.batch(
                torch.randint(
                    0, len(ds.val) - 65, (16,), generator=torch.Generator().manual_seed(i)
                ),
                "val",
            )
        )
        for i in range(32)
    ]

    def make_opt(params):
        return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])

    def batch():
        x, y = ds.batch(torch.randint(0, len(ds), (cfg["batch"],), generator=gen))
        return x.to(dev), y.to(dev)

    def evaluate():
        total = correct = tokens = 0.0
        with torch.no_grad():
            for x, y in held_out:
                logits = model(x)
                total += float(models.gpt_loss(logits, y))
                correct += float((logits.argmax(-1) == y).sum())
                tokens += y.numel()
        return total / tokens, correct / tokens

    return model, loss_fn, make_opt, batch, evaluate


def train(rank: int, world_size: int, spec: str, cfg: dict) -> dict | None:
    """One run on one rank; rank 0 returns the measurements."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clawcomm.hooks import CompressionHookState, compression_hook

    device = cfg.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    task = _gpt_task if cfg["model"] == "gpt" else _mlp_task
    model, loss_fn, make_opt, batch, evaluate = task(cfg, rank)
    ddp = DDP(model.to(device))
    hook = CompressionHookState(spec, warmup_steps=cfg["warmup"])
    ddp.register_comm_hook(hook, compression_hook)
    opt = make_opt(ddp.parameters())
    # Linear decay to zero: the final loss then measures where training
    # converged rather than the noise of the last mini-batches.
    schedule = torch_lr_schedule(opt, cfg["steps"])
    every = max(1, cfg["steps"] // 50)
    curve, step_seconds = [(0, evaluate()[0])], 0.0
    before = _wire_bytes(device)
    for step in range(1, cfg["steps"] + 1):
        if step == cfg["warmup"] + 1:  # bytes per step count compressed steps only
            before = _wire_bytes(device)
        x, y = batch()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        schedule.step()
        step_seconds += time.perf_counter() - t0
        if step % every == 0 or step == cfg["steps"]:
            curve.append((step, evaluate()[0]))
    if device == "cuda":
        torch.cuda.synchronize()
    sent = _wire_bytes(device) - before
    final_loss, accuracy = evaluate()
    result = {
        "compressor": spec,
        "bytes_per_step": sent / max(1, cfg["steps"] - cfg["warmup"]),
        "step_ms": 1e3 * step_seconds / cfg["steps"],
        "final_loss": final_loss,
        "test_accuracy": accuracy,
        "curve": curve,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    dist.barrier()
    return result if rank == 0 else None


def torch_lr_schedule(opt, steps: int):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)


def _table(results: list[dict]) -> str:
    dense = next((r for r in results if r["compressor"] == "none"), results[0])
    lines = [
        "# compressor          bytes/step   vs dense   step (ms)   final loss   test acc"
        "   loss gap",
        "#                   (compressed)",
    ]
    for r in results:
        ratio = r["bytes_per_step"] / dense["bytes_per_step"]
        gap = (r["final_loss"] - dense["final_loss"]) / dense["final_loss"]
        diverged = not math.isfinite(r["final_loss"])
        loss = "    diverged" if diverged else f"{r['final_loss']:12.4f}"
        gap_text = "       n/a" if diverged else f"{gap:+10.2%}"
        lines.append(
            f"  {r['compressor']:<18} {r['bytes_per_step']:11.0f} {ratio:9.2%} "
            f"{r['step_ms']:11.2f} {loss} {r['test_accuracy']:10.2%} {gap_text}"
        )
    return "\n".join(lines)


def run(args) -> int:
    from clawcomm.compression import get_compressor
    from clawcomm.testing import run_ranks

    specs = [s.strip() for s in args.compressors.split(",") if s.strip()]
    steps, batch, lr = MODEL_DEFAULTS[args.model]
    args.steps = steps if args.steps is None else args.steps
    args.batch = batch if args.batch is None else args.batch
    args.lr = lr if args.lr is None else args.lr
    try:
        for s in specs:
            get_compressor(s)
        if args.nproc < 1 or args.steps < 1 or args.batch < 1 or args.warmup < 0:
            raise ValueError("--nproc, --steps and --batch must be positive, --warmup >= 0")
        if args.device == "cuda":
            import torch

            if not (torch.backends.cuda.is_built() and torch.cuda.device_count() > 0):
                raise ValueError("--device cuda: no CUDA GPU (or torch is a CPU build)")
    except ValueError as e:
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
        )
    }
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(specs, file=sys.stderr, unit="run", leave=False)
    results = []
    for spec in specs:
        if progress is not None:
            progress.set_description(spec)
        out = run_ranks(
            train, args.nproc, spec, cfg, timeout=3600, env={"CLAWCOMM_TRANSPORT": args.transport}
        )
        results.append(out[0])
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    task = "digits MLP" if args.model == "mlp" else "character GPT"
    what = "images" if args.model == "mlp" else "sequences of 64"
    print(
        f"# clawcomm experiment compression: {task} ({results[0]['parameters']} parameters), "
        f"{args.nproc} ranks, {args.steps} steps of {args.batch} {what}/rank, "
        f"{args.warmup} dense warm-up steps, transport {args.transport}, device {args.device}"
    )
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
    if args.plot:
        from clawcomm._optional import require

        require("matplotlib", "clawcomm experiment compression --plot").use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in results:
            pts = [c for c in r["curve"] if math.isfinite(c[1])]
            ax.plot([c[0] for c in pts], [c[1] for c in pts], label=r["compressor"])
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(
            "training loss (full training set)" if args.model == "mlp" else "held-out loss"
        )
        ax.set_title(f"{task}, {args.nproc} ranks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        plt.close(fig)
    return 0
