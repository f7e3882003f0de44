"""Step time of data-parallel training under five setups, in one run:

1. dp-overlap:   clawcomm.parallel.DataParallel(overlap=True), buckets reduced
                 during backward;
2. dp-after:     DataParallel(overlap=False), buckets reduced after backward;
3. dp-auto:      DataParallel() (overlap="auto", the default): the first steps
                 time both ways and keep the faster; the table says which;
4. ddp-gloo:     torch DDP over gloo;
5. ddp-clawcomm: torch DDP over clawcomm.

Models: an MLP (25M parameters), a small transformer encoder (27M), and
two whose backward waits instead of computing, as layers running on an
accelerator keep the host waiting without using its CPU (AcceleratedLayer):
"wait" (21.2M: ten layers whose backward sleeps 8 ms, 9 MB buckets so each
layer has its own) and "wait8" (33.6M: eight 2048 x 2048 layers whose
backward sleeps 15 ms, default buckets). There the CPU is free for
communication, and the step time should approach max(compute, comm) rather
than their sum. The others use the defaults (1 MB first bucket, then 25 MB).

Every setup runs in both ways of zeroing gradients (--zero-grad): "zero"
(zero_grad(set_to_none=False): gradients stay, and are accumulated into in
place) and "none" (set_to_none=True, what optimizer.zero_grad() does by
default: autograd hands over fresh gradient tensors every step).

For each setup and model it reports:
- step:    forward + backward + optimizer step, with communication;
- compute: the same without any communication (the plain module);
- comm:    the same gradient buckets all-reduced back to back, alone;
- hidden:  compute + comm - step (how much communication the step hid);
- overlap: hidden / comm;
- sync:    step - compute for dp-after (what synchronising after backward
           costs), and sync / comm.
Each figure is the median of --steps steps, best of --repeats rounds; the
rounds interleave the setups. Run:

    python3 bench/data_parallel_bench.py --json bench/results/data_parallel_2ranks.json \\
        --plot bench/results/data_parallel_2ranks.png
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from clawcomm.launch import run_ranks
from clawcomm.parallel import DataParallel

SETUPS = ["dp-overlap", "dp-after", "dp-auto", "ddp-gloo", "ddp-clawcomm"]


class AcceleratedLayer(torch.autograd.Function):
    """A layer whose work runs elsewhere, as on an accelerator: backward
    keeps the host waiting (sleeps) without using the CPU, then hands back
    gradients that are already computed (fixed tensors of the right shape),
    so the host only accumulates them, as it would a GPU's result."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.layer = layer
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.layer.sleep)
        return grad, ctx.layer.grad_weight, None


class WaitingLayer(nn.Module):
    """One weight and no bias: with a bias, a bucket would pair this layer's
    weight with the next layer's bias and leave one layer late."""

    def __init__(self, width, sleep_ms, generator):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width, generator=generator) / width)
        self.grad_weight = torch.randn(width, width, generator=generator) * 1e-3
        self.sleep = sleep_ms / 1e3

    def forward(self, x):
        return AcceleratedLayer.apply(x, self.weight, self)


class WaitingNet(nn.Module):
    """A small input layer, then ``depth`` wide ones: the input layer's
    gradient comes last in backward, and its bucket is the one nothing can
    hide. With 9 MB buckets each wide layer has its own, so none waits for
    the next layer's gradient."""

    def __init__(self, inputs=64, width=1536, depth=9, sleep_ms=8.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        widths = [inputs] + [width] * depth
        self.layers = nn.Sequential(*(WaitingLayer(w, sleep_ms, g) for w in widths))

    def forward(self, x):
        return self.layers(x)


class Encoder(nn.Module):
    def __init__(self, vocab=8192, d=512, layers=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        block = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def make_model(name: str):
    """The model, one batch, the loss and the bucket cap in MB."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, 1024),
        )  # fmt: skip
        batch = (torch.randn(16, 1024, generator=g),)
        return model, batch, lambda out: out.square().mean(), 25
    if name == "transformer":
        model = Encoder()
        batch = (torch.randint(0, 8192, (2, 16), generator=g),)
        return model, batch, lambda out: out.logsumexp(-1).mean(), 25
    if name == "wait":
        model = WaitingNet()
        batch = (torch.randn(1, 1536, generator=g),)
        return model, batch, lambda out: out.sum(), 9
    if name == "wait8":
        model = WaitingNet(inputs=2048, width=2048, depth=7, sleep_ms=15.0)
        batch = (torch.randn(1, 2048, generator=g),)
        return model, batch, lambda out: out.sum(), 25
    raise ValueError(f"unknown model {name!r}")


def _wrap(setup, model, gloo, cap):
    if setup == "dp-overlap":
        return DataParallel(model, bucket_cap_mb=cap, overlap=True)
    if setup == "dp-after":
        return DataParallel(model, bucket_cap_mb=cap, overlap=False)
    if setup == "dp-auto":
        return DataParallel(model, bucket_cap_mb=cap)
    if setup == "ddp-gloo":
        return DDP(model, process_group=gloo, bucket_cap_mb=cap)
    return DDP(model, bucket_cap_mb=cap)


def _timed_steps(model, batch, loss_fn, opt, steps, control, set_to_none=False):
    times = []
    for _ in range(steps):
        dist.barrier(group=control)
        t0 = time.perf_counter()
        loss_fn(model(*batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        times.append(time.perf_counter() - t0)
    return _slowest_median(times, control)


def _slowest_median(times, control):
    """The median of this rank's times, and the largest such median over the
    ranks (a step is as slow as its slowest rank)."""
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=control)
    return float(median)


def _timed_comm(buckets, group, average, steps, control):
    times = []
    for _ in range(steps):
        dist.barrier(group=control)
        t0 = time.perf_counter()
        for b in buckets:
            if average:
                dist.all_reduce(b, op=dist.ReduceOp.AVG, group=group)
            else:
                dist.all_reduce(b, group=group)
                b.div_(dist.get_world_size(group))
        times.append(time.perf_counter() - t0)
    return _slowest_median(times, control)


def _rank(rank, world, models, steps, repeats, modes, setups=tuple(SETUPS)):
    gloo = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo")  # barriers and maxima, never timed
    out = {}
    for name in models:
        base, batch, loss_fn, cap = make_model(name)
        params = sum(p.numel() for p in base.parameters())
        out[name] = {"params": params, "bucket_cap_mb": cap, "modes": {}}
        for mode in modes:
            none = mode == "none"
            plain = copy.deepcopy(base)
            wrapped = {s: _wrap(s, copy.deepcopy(base), gloo, cap) for s in setups}
            optims = {s: torch.optim.SGD(m.parameters(), lr=1e-6) for s, m in wrapped.items()}
            optims["compute"] = torch.optim.SGD(plain.parameters(), lr=1e-6)
            runners = {s: (wrapped[s], optims[s]) for s in setups}
            runners["compute"] = (plain, optims["compute"])
            # The buckets each setup reduces, for the comm-alone figure: the
            # DataParallel layout (DDP's default caps are the same: 1 MB, 25 MB).
            dp = next(m for s, m in wrapped.items() if s.startswith("dp-"))
            layout = [torch.zeros(b.numel) for b in dp.buckets]
            best: dict[str, float] = {}
            # Warm-up (and the buckets' rebuild; dp-auto's trial steps too).
            for key, (m, opt) in runners.items():
                _timed_steps(m, batch, loss_fn, opt, 10 if key == "dp-auto" else 2, control, none)
            for _ in range(repeats):
                for key, (m, opt) in runners.items():
                    t = _timed_steps(m, batch, loss_fn, opt, steps, control, none)
                    best[key] = min(best.get(key, t), t)
                for key, group, avg in (("comm-clawcomm", None, True), ("comm-gloo", gloo, False)):
                    t = _timed_comm(layout, group, avg, steps, control)
                    best[key] = min(best.get(key, t), t)
            rows = {}
            for s in setups:
                comm = best["comm-gloo" if s == "ddp-gloo" else "comm-clawcomm"]
                hidden = min(max(best["compute"] + comm - best[s], 0.0), comm)
                rows[s] = {
                    "step_ms": best[s] * 1e3,
                    "compute_ms": best["compute"] * 1e3,
                    "comm_ms": comm * 1e3,
                    "hidden_ms": hidden * 1e3,
                    "overlap": hidden / comm if comm else 0.0,
                    "sync_ms": (best[s] - best["compute"]) * 1e3,
                    "buckets": len(layout),
                }
            if "dp-auto" in rows:
                rows["dp-auto"]["choice"] = wrapped["dp-auto"].overlap_choice
            out[name]["modes"][mode] = rows
            del wrapped, runners, optims
    return out


def print_table(result, world):
    print(f"# data-parallel step time, {world} ranks (median of steps, best of rounds)")
    head = (f"# {'model':<8}{'params':>7} {'zero':>5}  {'setup':<14}{'step ms':>9}{'compute':>9}"
            f"{'comm':>8}{'sync':>8}{'sync/comm':>10}{'hidden':>8}{'overlap':>8}{'vs gloo':>8}"
            f"{'vs ddp':>7}")  # fmt: skip
    print(head)
    for name, r in result.items():
        for mode, rows in r["modes"].items():
            for s, row in rows.items():
                size = f"{r['params'] / 1e6:.1f}M"
                print(
                    f"  {name:<8}{size:>7} {mode:>5}  {s:<14}{row['step_ms']:>9.1f}"
                    f"{row['compute_ms']:>9.1f}{row['comm_ms']:>8.1f}{row['sync_ms']:>8.1f}"
                    f"{row['sync_ms'] / row['comm_ms']:>10.2f}{row['hidden_ms']:>8.1f}"
                    f"{row['overlap']:>8.0%}{row['step_ms'] / rows['ddp-gloo']['step_ms']:>8.2f}"
                    f"{row['step_ms'] / rows['ddp-clawcomm']['step_ms']:>7.2f}"
                )
            c = rows["dp-auto"].get("choice")
            if c:
                way = "during" if c["overlap"] else "after"
                print(f"  # dp-auto reduces {way} backward (trial medians: "
                      f"{c['during_backward_ms']:.1f} ms during, "
                      f"{c['after_backward_ms']:.1f} ms after)")  # fmt: skip


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(next(iter(result.values()))["modes"])
    fig, axes = plt.subplots(
        len(result), len(modes), figsize=(4.6 * len(modes), 3.2 * len(result)), squeeze=False
    )
    panels = [
        (axes[i][j], name, mode, r["modes"][mode])
        for i, (name, r) in enumerate(result.items())
        for j, mode in enumerate(modes)
    ]
    for ax, name, mode, rows in panels:
        xs = range(len(rows))
        compute = [row["compute_ms"] for row in rows.values()]
        exposed = [row["comm_ms"] - row["hidden_ms"] for row in rows.values()]
        hidden = [row["hidden_ms"] for row in rows.values()]
        ax.bar(xs, compute, label="compute")
        ax.bar(xs, exposed, bottom=compute, label="comm, exposed")
        ax.bar(xs, hidden, bottom=[c + e for c, e in zip(compute, exposed, strict=True)],
               label="comm, hidden", alpha=0.35, hatch="//")  # fmt: skip
        ax.plot(xs, [row["step_ms"] for row in rows.values()], "k_", markersize=30, label="step")
        ax.set_xticks(list(xs), list(rows), rotation=12, fontsize=8)
        ax.set_title(f"{name} ({result[name]['params'] / 1e6:.1f}M), zero_grad: {mode}", fontsize=9)
        ax.set_ylabel("ms per step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--models", default="mlp,transformer,wait,wait8")
    p.add_argument("--zero-grad", default="zero,none", help="zero_grad modes: zero, none")
    p.add_argument("--steps", type=int, default=12, help="timed steps per round (12)")
    p.add_argument("--repeats", type=int, default=5, help="rounds, best kept (5)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--replot", metavar="JSON", help="only redraw --plot from a --json file")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["result"], args.plot)
        return
    models = args.models.split(",")
    for m in models:
        make_model(m)  # a bad name fails here, before any rank starts
    modes = args.zero_grad.split(",")
    if any(m not in ("zero", "none") for m in modes):
        p.error(f"--zero-grad {args.zero_grad!r}: modes are zero and none")
    result = run_ranks(_rank, args.nproc, models, args.steps, args.repeats, modes, timeout=3600)[0]
    print_table(result, args.nproc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "result": result}, f, indent=1)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
