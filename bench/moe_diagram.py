"""Draws where the tokens go in ``clawcomm train --model moe --dp 2 --ep 2``:
the picture in docs/expert_parallel.md, from a real routing (the first MoE
layer of the untrained model, each rank's first micro-batch of the first
step).

    python3 bench/moe_diagram.py bench/results/moe_tokens.png

Left, each rank's token slots (tokens x top-k); right, the experts, the
first half held by rank 0, the rest by rank 1; each band's width is the
slots one rank sends one expert. Bands that cross to the other rank are
the all-to-all's traffic (and come back by the second all-to-all); the
others stay on the rank.
"""

from __future__ import annotations

import sys

import torch

from clawcomm.train import TrainConfig, moe
from clawcomm.train import models as train_models
from clawcomm.train.data import global_batches, replica_rows


def routed_counts(cfg: TrainConfig) -> torch.Tensor:
    """[rank, expert] slots each rank's first micro-batch sends each expert
    at the first MoE layer (dropped ones excluded)."""
    model, _, _, ds, _, _ = train_models.build(cfg)
    layer = moe.layers_of(model)[0]
    seen = []
    layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    x, _ = next(iter(global_batches(ds, cfg.effective_batch, cfg.seed)))
    counts = torch.zeros(cfg.dp, cfg.experts, dtype=torch.long)
    with torch.no_grad():
        for d in range(cfg.dp):
            rows = replica_rows(cfg, d)
            seen.clear()
            model(x[rows][: cfg.micro_batch_size])
            tokens = seen[0].reshape(-1, cfg.dim)
            r = moe.route(layer.router(tokens), cfg.top_k, cfg.capacity_factor)
            counts[d] = torch.bincount(r.chosen[r.keep], minlength=cfg.experts)
    return counts


def draw(path: str) -> None:
    from clawcomm._optional import require

    require("matplotlib", "bench/moe_diagram.py").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, PathPatch
    from matplotlib.path import Path

    cfg = TrainConfig(model="moe", dp=2, ep=2, quiet=True)
    counts = routed_counts(cfg)
    per_rank = cfg.experts // cfg.ep
    width = cfg.dim * 4  # float32 bytes of one token's activation
    fig, ax = plt.subplots(figsize=(11, 6))
    total = counts.sum().item()
    scale = 4.0 / total  # a band's height per slot
    colours = ("#4C72B0", "#DD8452")
    # Sources: each rank's slots stacked; sinks: the experts, grouped by rank.
    src_y = {0: 4.6, 1: 0.4}
    sink_y = [5.6 - e * 0.72 - (0.4 if e >= per_rank else 0.0) for e in range(cfg.experts)]
    offsets_src = {d: 0.0 for d in range(cfg.dp)}
    offsets_sink = [0.0] * cfg.experts
    crossing = 0
    for d in range(cfg.dp):
        for e in range(cfg.experts):
            n = counts[d, e].item()
            h = n * scale
            y0 = src_y[d] + offsets_src[d]
            y1 = sink_y[e] + offsets_sink[e] * 0.4
            offsets_src[d] += h
            offsets_sink[e] += h
            owner = e // per_rank
            crossing += n if owner != d else 0
            verts = [(1.2, y0), (3.0, y0), (3.4, y1), (5.2, y1), (5.2, y1 + h * 0.4),
                     (3.4, y1 + h * 0.4), (3.0, y0 + h), (1.2, y0 + h), (1.2, y0)]  # fmt: skip
            codes = [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4, Path.LINETO,
                     Path.CURVE4, Path.CURVE4, Path.CURVE4, Path.CLOSEPOLY]  # fmt: skip
            ax.add_patch(PathPatch(Path(verts, codes), color=colours[d],
                                   alpha=0.55 if owner != d else 0.25, lw=0))  # fmt: skip
    for d in range(cfg.dp):
        h = counts[d].sum().item() * scale
        ax.add_patch(FancyBboxPatch((0.2, src_y[d]), 1.0, h, boxstyle="round,pad=0.02",
                                    color=colours[d]))  # fmt: skip
        ax.text(0.7, src_y[d] + h / 2, f"rank {d}\n{counts[d].sum().item()} slots\n"
                f"({cfg.micro_batch_size} x {cfg.seq_len} tokens\nx top-{cfg.top_k})",
                ha="center", va="center", color="white", fontsize=8)  # fmt: skip
    for e in range(cfg.experts):
        h = max(counts[:, e].sum().item() * scale * 0.4, 0.25)
        owner = e // per_rank
        ax.add_patch(FancyBboxPatch((5.2, sink_y[e]), 1.3, h, boxstyle="round,pad=0.02",
                                    color=colours[owner], alpha=0.9))  # fmt: skip
        ax.text(5.85, sink_y[e] + h / 2, f"expert {e}: {counts[:, e].sum().item()}",
                ha="center", va="center", color="white", fontsize=8)  # fmt: skip
    ax.text(6.7, sink_y[0], "held by rank 0", fontsize=9, va="bottom", color=colours[0])
    ax.text(6.7, sink_y[per_rank], "held by rank 1", fontsize=9, va="bottom", color=colours[1])
    mb = crossing * width / 1e6
    ax.set_title(
        f"--model moe --dp 2 --ep 2: one micro-batch's token slots to their experts "
        f"(first MoE layer, untrained router)\ndark bands cross ranks: {crossing} of {total} "
        f"slots, {mb:.2f} MB each way by the all-to-all (counts exchanged first); light ones "
        "stay on the rank",
        fontsize=10,
    )
    ax.set_xlim(0, 8.2)
    ax.set_ylim(0, 6.6)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "runs/moe_tokens.png")
