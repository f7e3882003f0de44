"""The cost model: what a collective takes on a topology of hosts x ranks.

The engine's ``CLAWCOMM_ALGO=auto`` chooses by the same closed forms
(``csrc/algorithms/selection.cc``; tests compare the two), and
``clawcomm simulate`` prints them at any scale. ``clawcomm.simulate.messages`` runs
the same algorithms message by message as a check.

A message between ranks of one host costs ``shm_alpha + bytes * shm_beta``.
One between hosts costs ``net_alpha + bytes * net_beta`` per stream, and the
streams that leave one host in the same step share its link, so ``s`` of
them take ``net_alpha + s * bytes * net_beta``. A step costs its slowest
message; reducing costs ``gamma`` per byte. docs/algorithms.md derives each
formula.

    from clawcomm.cost_model import CostModel, Topology, predict
    model = CostModel.load("model.json")            # clawcomm bench --calibrate
    predict("all_reduce", "hierarchical", 1 << 30, Topology(128, 8), model)
"""

from __future__ import annotations

import math

from clawcomm.cost_model.formulas import _FORMULAS, hierarchical_pieces
from clawcomm.cost_model.parameters import CostModel, Topology, busbw_factor, link_bits_per_s

__all__ = [
    "ALGORITHMS",
    "CostModel",
    "Topology",
    "busbw_factor",
    "choose",
    "hierarchical_pieces",
    "link_bits_per_s",
    "predict",
    "predict_sequence",
]

# Which algorithms each collective has: the engine's table
# (csrc/algorithms/selection.cc), its names and its order (ties in cost go
# to the later row).
ALGORITHMS = {
    "all_reduce": ("oneshot", "twoshot", "ring", "tree", "hierarchical"),
    "reduce_scatter": ("ring", "hierarchical", "direct"),
    "all_gather": ("ring", "hierarchical", "direct"),
    "broadcast": ("direct", "scatter_allgather", "tree"),
    "reduce": ("reducescatter_gather", "tree"),
    "all_to_all": ("pairwise", "hierarchical"),
}

# The collectives whose choice is the layout's, whatever the size
# (selection.cc's allToAllByLayout): with uneven splits no byte count is the
# same on every rank, and every rank must run the same algorithm.
BY_LAYOUT = {"all_to_all"}
# The sizes a choice by layout is checked at: the later row only where it
# is cheaper at every one.
LAYOUT_SIZES = [0.0] + [float(1 << b) for b in range(41)]

# The rows auto passes over (selection.cc's chooseAlgorithm): the two-shot
# all-reduce runs only where named (measured behind the ring at 3 ranks).
NAMED_ONLY = {("all_reduce", "twoshot")}


def predict(
    collective: str, algo: str, nbytes: float, topology: Topology, model: CostModel
) -> float:
    """Seconds for `collective` of `nbytes` per rank (an all-reduce's whole
    buffer; all-gather's output, reduce-scatter's and all-to-all's input, as
    nccl-tests counts them)."""
    if algo == "auto":
        algo = choose(collective, nbytes, topology, model)
    try:
        formula = _FORMULAS[(collective, algo)]
    except KeyError:
        raise ValueError(f"no {algo!r} algorithm for {collective}") from None
    return formula(float(nbytes), topology, model)


def choose(collective: str, nbytes: float, topology: Topology, model: CostModel) -> str:
    """What CLAWCOMM_ALGO=auto picks, as the engine does: the cheapest of
    the collective's algorithms but NAMED_ONLY, ties to the later row (one
    rank's all-reduce: the tree, which returns at once). The all-to-all's
    is the layout's (BY_LAYOUT): hierarchical only where it is cheaper at
    every size, whatever `nbytes`."""
    try:
        algos = ALGORITHMS[collective]
    except KeyError:
        known = ", ".join(ALGORITHMS)
        raise ValueError(f"no collective {collective!r}: one of {known}") from None
    if collective in BY_LAYOUT:
        first, later = (_FORMULAS[(collective, a)] for a in algos)
        if all(later(s, topology, model) < first(s, topology, model) for s in LAYOUT_SIZES):
            return algos[1]
        return algos[0]
    if collective == "all_reduce" and topology.size <= 1:
        return "tree"
    best, best_cost = algos[0], math.inf
    for a in algos:
        if (collective, a) in NAMED_ONLY:
            continue
        c = _FORMULAS[(collective, a)](float(nbytes), topology, model)
        if c <= best_cost:
            best, best_cost = a, c
    return best


def predict_sequence(collectives, topology: Topology, model: CostModel) -> float:
    """Seconds for ``collectives``, (name, bytes) pairs run one after
    another with the algorithms auto picks (a compressor's ``Wire``)."""
    return sum(predict(name, "auto", nbytes, topology, model) for name, nbytes in collectives)
