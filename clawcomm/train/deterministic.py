"""Deterministic training (``--deterministic``, ``TrainConfig.deterministic``):
at a fixed micro-batch size and global batch, the losses, gradient norms
and weights are bitwise the same for every dp x pp x ZeRO stage (power-of-two
counts). docs/deterministic.md states the guarantee and its limits.

Where the bits of a step come from, and what this module fixes:

- Each micro-batch's gradient: the same kernels on the same shapes at one
  intra-op thread (``enter``), whichever rank runs it.
- Their sum: a fixed binary tree over the *global* micro-batch index,
  neighbours paired recursively, the lower index on the left. A replica's
  micro-batches are a contiguous block of that index (replica, then
  accumulation round, then micro-batch: ``data.rounds``), so its subtree is
  summed here as the backward passes come (``MicroBatchTree``: a binary
  counter of partial sums, log2 of the micro-batches' gradients held), and
  the engine's deterministic reductions (``CLAWCOMM_DETERMINISTIC=1``, the
  same tree over ranks) add the replicas' subtrees. The reducer launches
  nothing before the tree's root: deterministic mode gives up overlapping
  the data-parallel reduction with backward.
- A weight used by two layers (the GPT's embedding and output projection):
  each use's gradient has its own tree and its own reduction over the
  replicas, and the two are added last, whether the layers sit on one rank
  (``keep_head_apart``, ``models.Head.keep_apart``) or on two pipeline ranks (the trainer's ties).
- The loss and the squared gradient norm: summed exactly (integers per
  binary exponent, ``exact_totals``), so no rank boundary, shard boundary or
  order of addition shows; the clip factor follows.
- Scalings are powers of two (1/dp in the reduction, dp in the loss scale),
  exact in binary floating point.
"""

from __future__ import annotations

import os
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

from clawcomm.pipeline.actions import B
from clawcomm.train.models import Embedding, Head, unique_params

ENV = "CLAWCOMM_DETERMINISTIC"


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check(cfg) -> None:
    """Raises ValueError naming the first setting deterministic mode cannot
    keep bitwise (called by ``TrainConfig.check``)."""
    if not cfg.deterministic:
        return
    cuts = {
        "tp": "each rank multiplies a slice of every row: the matmuls themselves change",
        "cp": "each rank attends over part of the sequence: the softmax sums change",
        "ep": "experts compute on batches grouped by rank: their matmuls change",
    }
    for name, why in cuts.items():
        if getattr(cfg, name) > 1:
            raise ValueError(f"deterministic: {name} {getattr(cfg, name)} is refused ({why})")
    refused = (
        (cfg.compression, f"compression {cfg.compression!r}: its rounding depends on the layout"),
        (cfg.sync != "every-step", f"sync {cfg.sync!r}: replicas that drift depend on dp"),
        (
            cfg.schedule == "zb1",
            "schedule zb1: its weight-gradient jobs of one micro-batch run after the next "
            "micro-batch's backward, which a micro-batch's own gradient cannot be kept apart from",
        ),
        (cfg.param_compression != "none", "param_compression: it rounds the weights"),
    )
    for bad, why in refused:
        if bad:
            raise ValueError(f"deterministic: {why}")
    per_replica = cfg.microbatches * cfg.accumulation
    for name, n in (("dp", cfg.dp), ("microbatches x accumulation", per_replica)):
        if not _power_of_two(n):
            raise ValueError(
                f"deterministic: {name} = {n} is not a power of two; the micro-batch tree's "
                "subtrees must fall on replica boundaries"
            )


def enter(world_size: int) -> None:
    """What every rank fixes before building the model: one intra-op thread
    (a matmul's blocking may follow the thread count), torch's
    deterministic kernels (warning where one has none), and, on several
    ranks, the engine's deterministic reductions."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if world_size > 1:
        if dist.get_backend() != "clawcomm":
            raise ValueError(
                f"deterministic: the process group's backend is {dist.get_backend()!r}; its "
                "reductions add in an order of their own: use the clawcomm backend"
            )
        if os.environ.get(ENV) != "1":
            raise ValueError(
                f"deterministic: {ENV}=1 must be set before init_process_group (the engine's "
                "reductions in the canonical tree); clawcomm train sets it"
            )


def keep_head_apart(local: dict[int, nn.Module]) -> list[tuple[nn.Parameter, list]]:
    """The GPT head's projection, tied to the embedding in the same stage on
    this rank, made to leave its gradient in a list of its own (see the
    module docstring); returns [(weight, that list)]."""
    mods = [m for s in sorted(local) for m in local[s].modules()]
    tokens = {id(m.tokens.weight) for m in mods if isinstance(m, Embedding)}
    out = []
    for m in mods:
        if isinstance(m, Head) and id(m.proj.weight) in tokens:
            out.append((m.proj.weight, m.keep_apart()))
    return out


class MicroBatchTree:
    """The trainer's tracker in deterministic mode: after each backward pass
    it takes the stage's gradients into a binary counter of partial sums,
    and ``collapse`` leaves the replica's subtree root in ``.grad``. Around
    it, ``inner`` (ZeRO-3's parameter units) hears every action."""

    def __init__(self, local: dict, per_replica: int, microbatches: int, apart, inner=None):
        self.params = {
            s: unique_params(p for p in mod.parameters() if p.requires_grad)
            for s, mod in local.items()
        }
        self.apart = apart  # [(weight, list of its kept-apart gradients)]
        self.per_replica = per_replica
        self.inner = inner
        self._stacks: dict = {s: [] for s in local}  # [(count, tensors)], counts decreasing
        self._apart_trees: list = [[] for _ in apart]
        self._taken = dict.fromkeys(local, 0)
        self.microbatches = microbatches  # per schedule run
        self._apart_roots: list[torch.Tensor] = []

    def begin_action(self, action) -> None:
        if self.inner is not None:
            self.inner.begin_action(action)

    def end_action(self, action) -> None:
        if self.inner is not None:
            self.inner.end_action(action)
        if action.kind == B:
            self._take(action.stage, action.microbatch)

    def _take(self, s: int, mb: int) -> None:
        expected = self._taken[s] % self.microbatches
        if mb != expected:
            raise RuntimeError(
                f"deterministic: stage {s} ran the backward of micro-batch {mb} where "
                f"{expected} was next; the micro-batch tree needs each stage's backward passes "
                "in micro-batch order"
            )
        self._taken[s] += 1
        grads = []
        for p in self.params[s]:
            g = p.grad
            if g is None:  # unused by this micro-batch
                grads.append(torch.zeros_like(p))
            elif g._base is not None:  # the reducer's bucket view: stays, zeroed
                grads.append(g + 0.0)  # (+ 0.0: a -0 is +0 on every path)
                g.zero_()
            else:
                grads.append(g.add_(0.0))
                p.grad = None
        _push(self._stacks[s], grads)
        for (_, sink), stack in zip(self.apart, self._apart_trees, strict=True):
            while sink:
                _push(stack, [sink.pop(0) + 0.0])

    def collapse(self) -> None:
        """Every stage's gradients set to its tree's root (the step's
        micro-batches all taken); the kept-apart gradients' roots wait for
        ``add_apart``."""
        for s, stack in self._stacks.items():
            root = _root(stack, self.per_replica, f"stage {s}")
            for p, g in zip(self.params[s], root, strict=True):
                if p.grad is not None and p.grad._base is not None:
                    p.grad.copy_(g)
                else:
                    p.grad = g
        self._apart_roots = [_root(st, self.per_replica, "the head")[0] for st in self._apart_trees]
        self._taken = dict.fromkeys(self._taken, 0)

    def add_apart(self, group=None) -> None:
        """Each kept-apart gradient's root, averaged over ``group`` (the
        replicas, None for none) as the weight's own gradient was, added to
        it last (the tree's last level, as across pipeline ranks)."""
        for (p, _), root in zip(self.apart, self._apart_roots, strict=True):
            if group is not None:
                dist.all_reduce(root, dist.ReduceOp.AVG, group=group)
            p.grad.add_(root)
        self._apart_roots = []


def _push(stack: list, grads: list[torch.Tensor]) -> None:
    """One leaf onto the binary counter: equal neighbours merge, the left
    (lower micro-batch indices) first."""
    stack.append((1, grads))
    while len(stack) >= 2 and stack[-1][0] == stack[-2][0]:
        n, right = stack.pop()
        _, left = stack[-1]
        torch._foreach_add_(left, right)
        stack[-1] = (2 * n, left)


def _root(stack: list, count: int, what: str) -> list[torch.Tensor]:
    if len(stack) != 1 or stack[0][0] != count:
        raise RuntimeError(
            f"deterministic: {what} took {sum(n for n, _ in stack)} micro-batch gradients in "
            f"the step, not {count}"
        )
    return stack.pop()[1]


# ---- exact sums ----------------------------------------------------------------------

# A float32 x = M 2^(e-24), M < 2^24 an integer (torch.frexp's exponent e in
# [-148, 128]; 0 has M = 0). Bin b = e + 149 holds the integers of the values
# with that exponent: their sum is exact in int64 and in any order.
_BINS = 280
_SHIFT = 149


def _bins(x: torch.Tensor, square: bool) -> torch.Tensor:
    """[4, _BINS] int64 of ``x``'s values (float32): the signed sum of M,
    or, with ``square``, of M^2's high and low 24 bits, per exponent; and
    (row 3, bin 0) how many are not finite."""
    x = x.detach().reshape(-1).float()
    out = torch.zeros(4, _BINS, dtype=torch.int64, device=x.device)
    finite = torch.isfinite(x)
    out[3, 0] = (~finite).sum()
    m, e = torch.frexp(torch.where(finite, x, 0.0))
    big = (m * (1 << 24)).to(torch.int64)
    idx = (e.to(torch.int64) + _SHIFT).clamp_(0, _BINS - 1)
    if square:
        sq = big * big  # < 2^48: each half < 2^24, so 2^39 values per bin fit
        out[1].index_add_(0, idx, sq >> 24)
        out[2].index_add_(0, idx, sq & ((1 << 24) - 1))
    else:
        out[0].index_add_(0, idx, big)
    return out.cpu()


def exact_totals(losses: list[torch.Tensor], grads: list[tuple[torch.Tensor, int]], group=None):
    """(sum of every rank's ``losses``, sum of every rank's squared
    ``grads``, each counted its multiplicity times), exact and rounded once
    to floats (nan where a value was not finite): one int64 all-reduce over
    ``group``."""
    total = torch.zeros(4, _BINS, dtype=torch.int64)
    if losses:
        total += _bins(torch.stack([v.reshape(()) for v in losses]), square=False)
    for g, times in grads:
        total += times * _bins(g, square=True)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    rows = total.tolist()
    if rows[3][0]:
        return float("nan"), float("nan")
    loss = sum(Fraction(v) * Fraction(2) ** (b - _SHIFT - 24) for b, v in enumerate(rows[0]) if v)
    sq = sum(
        Fraction((h << 24) + lo) * Fraction(2) ** (2 * (b - _SHIFT - 24))
        for b, (h, lo) in enumerate(zip(rows[1], rows[2], strict=True))
        if h or lo
    )
    return float(Fraction(loss)), float(Fraction(sq))
