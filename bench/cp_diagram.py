"""Draws where the tokens and the key/value blocks go under ``clawcomm train
--cp 4``: the picture in docs/context_parallel.md.

    python3 bench/cp_diagram.py bench/results/cp_ring.png

Top, the sequence cut into 2 x cp chunks, each coloured by the rank that
holds it (chunks i and 2cp - 1 - i). Below, causal attention's blocks
(query chunk down, key chunk across): each computed block is coloured by
the rank that computes it and says at which ring step (the step at which
that key chunk's owner's block reaches it); blocks above the diagonal are
masked and never computed, those on it causally. Every rank's count of
blocks is the same: the load-balanced mask.
"""

from __future__ import annotations

import sys

from clawcomm.parallel.context import chunks

COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def layout(cp: int) -> tuple[dict[int, int], dict[tuple[int, int], tuple[int, int]]]:
    """(chunk -> the rank holding it, (query chunk, key chunk) -> (the rank
    computing it, the ring step at which it does))."""
    owner = {ch: r for r in range(cp) for ch in chunks(r, cp)}
    blocks = {}
    for qc in range(2 * cp):
        for kc in range(qc + 1):
            r = owner[qc]
            blocks[(qc, kc)] = (r, (r - owner[kc]) % cp)
    return owner, blocks


def draw(path: str, cp: int = 4) -> None:
    from clawcomm._optional import require

    require("matplotlib", "bench/cp_diagram.py").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    owner, blocks = layout(cp)
    n = 2 * cp
    fig, ax = plt.subplots(figsize=(8.5, 9.5))
    for ch in range(n):  # the sequence, top
        ax.add_patch(Rectangle((ch, n + 0.6), 1, 0.8, color=COLOURS[owner[ch]]))
        ax.text(ch + 0.5, n + 1.0, f"chunk {ch}", ha="center", va="center", fontsize=7,
                color="white")  # fmt: skip
    for (qc, kc), (r, step) in blocks.items():
        y = n - 1 - qc
        diag = qc == kc
        ax.add_patch(Rectangle((kc + 0.04, y + 0.04), 0.92, 0.92, color=COLOURS[r],
                               alpha=0.55 if diag else 0.9))  # fmt: skip
        ax.text(kc + 0.5, y + 0.5, f"step {step}" + ("\ncausal" if diag else ""),
                ha="center", va="center", fontsize=7, color="white")  # fmt: skip
    for i in range(n):
        ax.text(-0.15, n - 1 - i + 0.5, f"q {i}", ha="right", va="center", fontsize=8)
        ax.text(i + 0.5, -0.3, f"k {i}", ha="center", va="top", fontsize=8)
    per_rank = {r: 0.0 for r in range(cp)}
    for (qc, kc), (r, _) in blocks.items():
        per_rank[r] += 0.5 if qc == kc else 1.0
    counts = ", ".join(f"rank {r}: {v:g}" for r, v in per_rank.items())
    handles = [Patch(color=COLOURS[r], label=f"rank {r}: chunks {chunks(r, cp)}")
               for r in range(cp)]  # fmt: skip
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=cp,
              fontsize=8)  # fmt: skip
    ax.set_title(
        f"--cp {cp}: the sequence in {n} chunks (top), causal attention's blocks by the rank "
        f"that computes them\nand the ring step at which the keys arrive (a causal block "
        f"counts half): {counts}",
        fontsize=9,
    )
    ax.set_xlim(-1.0, n + 0.2)
    ax.set_ylim(-1.0, n + 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "runs/cp_ring.png")
