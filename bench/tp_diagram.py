"""Draws how ``clawcomm train --tp 2`` splits a GPT block (with sequence
parallelism) over two ranks: the picture in docs/tensor_parallel.md.

    python3 bench/tp_diagram.py bench/results/tp_layer.png

Each rank is a row; boxes are what it holds and computes, left to right in
forward order; arrows between the rows are the collectives. Shapes are per
rank for a micro-batch of b samples of t tokens, width d, h heads.
"""

from __future__ import annotations

import sys

BOXES = [  # (label, rank 0's part, rank 1's part, colour)
    ("LayerNorm", "tokens 0..t/2", "tokens t/2..t", "#8172B3"),
    ("all-gather", "", "", None),
    (
        "Q, K, V\ncolumn-parallel",
        "heads 0..h/2\n[b, t, 3d/2]",
        "heads h/2..h\n[b, t, 3d/2]",
        "#4C72B0",
    ),
    ("attention", "its heads,\nwhole sequence", "its heads,\nwhole sequence", "#4C72B0"),
    (
        "out proj\nrow-parallel",
        "rows of its heads\npartial [b, t, d]",
        "rows of its heads\npartial [b, t, d]",
        "#4C72B0",
    ),
    ("reduce-scatter", "", "", None),
    ("+ residual,\nLayerNorm", "tokens 0..t/2", "tokens t/2..t", "#8172B3"),
    ("all-gather", "", "", None),
    ("MLP up\ncolumn-parallel", "[b, t, 2d]", "[b, t, 2d]", "#55A868"),
    ("GELU", "its columns", "its columns", "#55A868"),
    ("MLP down\nrow-parallel", "partial [b, t, d]", "partial [b, t, d]", "#55A868"),
    ("reduce-scatter", "", "", None),
    ("+ residual", "tokens 0..t/2", "tokens t/2..t", "#8172B3"),
]


def draw(path: str) -> None:
    from clawcomm._optional import require

    require("matplotlib", "bench/tp_diagram.py").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(15, 4.2))
    x, w, gap = 0.0, 1.25, 0.18
    for label, r0, r1, colour in BOXES:
        if colour is None:  # a collective: arrows across the ranks
            arrow = FancyArrowPatch((x + 0.25, 2.0), (x + 0.25, 1.5), arrowstyle="<|-|>",
                                    mutation_scale=12, color="#C44E52", lw=1.5)  # fmt: skip
            ax.add_patch(arrow)
            ax.text(x + 0.25, 3.05, label.replace("-", "-\n"), ha="center", va="bottom",
                    fontsize=8, color="#C44E52")  # fmt: skip
            x += 0.5 + gap
            continue
        for y, part in ((2.0, r0), (0.6, r1)):
            ax.add_patch(FancyBboxPatch((x, y), w, 0.9, boxstyle="round,pad=0.02",
                                        color=colour, alpha=0.85))  # fmt: skip
            ax.text(x + w / 2, y + 0.45, part, ha="center", va="center", fontsize=7,
                    color="white")  # fmt: skip
        ax.text(x + w / 2, 3.05, label, ha="center", va="bottom", fontsize=8)
        x += w + gap
    ax.text(-0.15, 2.45, "rank 0", ha="right", va="center", fontsize=10)
    ax.text(-0.15, 1.05, "rank 1", ha="right", va="center", fontsize=10)
    ax.set_xlim(-1.0, x)
    ax.set_ylim(0.3, 3.6)
    ax.axis("off")
    ax.set_title("A GPT block at tp 2 with sequence parallelism (forward; backward runs the "
                 "collectives the other way: each all-gather's gradient is a reduce-scatter)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "runs/tp_layer.png")
