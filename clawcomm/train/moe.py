"""The mixture-of-experts MLP of ``--model moe`` (the GPT with an ``MoE`` in
place of the MLP of every ``--moe-every``-th block): a learned router picks
``top_k`` of ``experts`` two-layer MLPs for each token, as in Switch
(top-1) and GShard/Mixtral (top-2, the two gates renormalised).

- **Capacity** (``capacity_factor`` c > 0): an expert takes at most
  ceil(c * tokens * top_k / experts) of a micro-batch's token slots; the
  slots beyond it are dropped (that token's output from this expert is
  zero, its residual passes through). Every token's first choice is queued
  before any second choice, in token order (Switch's priority). c = 0: no
  token is dropped.
- **Auxiliary losses**, added to the training objective through the
  backward pass (``_AuxLoss``, Megatron's MoEAuxLossAutoScaler): Switch's
  load-balancing loss ``experts * sum_e f_e * P_e`` (f_e: the share of
  slots routed to e before dropping; P_e: the mean router probability of
  e) times ``balance_coeff``, and the router z-loss ``mean(logsumexp(logits)^2)``
  (ST-MoE) times ``z_coeff``. Each micro-batch's weighs ``aux_scale``
  (the trainer sets 1 / the micro-batches a replica runs per step, so that
  the objective is the language-model loss plus the mean over every
  micro-batch of the coefficients times the losses).
- **Routing figures** (``ROUTING``): slots, dropped slots and the two
  losses as computed, added up until the trainer reads them each step.

Which rank computes which expert is ``clawcomm.parallel.expert``'s: this
module's ``MoE`` hands the tokens, the routing and its ``Experts`` to
``expert.dispatch`` (all local at ep 1; two all-to-alls at ep > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clawcomm.parallel import expert
from clawcomm.parallel.tensor import comm


@dataclass
class Routing:
    """A micro-batch's routing: for each of its N tokens, the ``top_k``
    experts chosen (``chosen`` [N, k]), their gates ([N, k], summing to 1
    at k = 2) and whether each slot fits its expert's capacity ([N, k])."""

    chosen: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor
    balance: torch.Tensor  # Switch's load-balancing loss (without its coefficient)
    z: torch.Tensor  # the router z-loss (without its coefficient)


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int | None:
    """Token slots an expert takes from a micro-batch of ``tokens`` (None:
    no limit, at factor 0)."""
    if factor <= 0:
        return None
    return math.ceil(factor * tokens * top_k / experts)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """The routing of ``logits`` [N, experts] (see the module docstring)."""
    n, experts = logits.shape
    logits = logits.float()
    probs = logits.softmax(-1)
    gates, chosen = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    with torch.no_grad():
        # Each slot's place in its expert's queue: first choices first, in token order.
        queued = chosen.t().reshape(-1)
        place = F.one_hot(queued, experts).cumsum(0).gather(1, queued[:, None]).squeeze(1) - 1
        cap = capacity(n, experts, top_k, capacity_factor)
        keep = torch.ones_like(place, dtype=torch.bool) if cap is None else place < cap
        keep = keep.view(top_k, n).t()
        share = torch.bincount(chosen.reshape(-1), minlength=experts).float() / (n * top_k)
    balance = experts * (share * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return Routing(chosen, gates, keep, balance, z)


class RoutingFigures:
    """Slots routed, slots dropped and the auxiliary losses, added up over
    every MoE layer's forward (with gradients: not an evaluation's) until
    ``lap()`` reads them."""

    def __init__(self):
        self._parts: list[torch.Tensor] = []

    def add(self, r: Routing) -> None:
        with torch.no_grad():
            slots = float(r.keep.numel())
            dropped = (~r.keep).sum().to(torch.float64)
            self._parts.append(
                torch.stack(
                    [
                        torch.tensor(slots, dtype=torch.float64, device=dropped.device),
                        dropped,
                        r.balance.detach().to(torch.float64),
                        r.z.detach().to(torch.float64),
                        torch.ones((), dtype=torch.float64, device=dropped.device),
                    ]
                )
            )

    def lap(self) -> tuple[float, float, float, float, float]:
        """(slots, dropped slots, sum of balance losses, sum of z-losses,
        layer forwards) since the last lap."""
        if not self._parts:
            return (0.0,) * 5
        total = torch.stack(self._parts).sum(0).tolist()
        self._parts = []
        return tuple(total)


ROUTING = RoutingFigures()


class _AuxLoss(torch.autograd.Function):
    """The identity on ``out``; in backward, ``aux`` gets gradient
    ``scale``, so that the auxiliary loss joins the objective wherever the
    layer sits in a pipeline, with no change to the loss function."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class Experts(nn.Module):
    """``experts`` two-layer MLPs (dim -> hidden -> dim, GELU), their weights
    stacked along a leading expert dimension (what expert parallelism splits:
    a rank holds a block of them, ``first`` being the first's index)."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.b1 = nn.Parameter(torch.zeros(experts, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.b2 = nn.Parameter(torch.zeros(experts, dim))
        for w in (self.w1, self.w2):  # (the GPT initialises them again, as GPT-2 does)
            nn.init.normal_(w, 0.0, 0.02)
        self.first = 0

    # At tp > 1 (parallel.tensor.parallelize): the TP group this rank's block
    # of every expert's hidden units is one of.
    tp = None

    @property
    def count(self) -> int:
        """The experts this rank holds."""
        return self.w1.shape[0]

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by the expert they go to (``counts[e]`` of them for
        this rank's e-th expert), each through its expert."""
        if self.tp is not None:
            return self._split_forward(rows, counts)
        out = []
        for e, x in enumerate(rows.split(counts)):
            h = F.gelu(torch.addmm(self.b1[e], x, self.w1[e]))
            out.append(torch.addmm(self.b2[e], h, self.w2[e]))
        return torch.cat(out)

    def _split_forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Tensor-parallel experts, as Megatron-LM's MLP: every TP rank has the
        same rows and a block of each expert's hidden units (w1's columns, w2's
        rows); the partial outputs are summed over the group and the whole b2
        added after. The rows' gradient is summed over the group in backward."""
        group = self.tp.group
        rows = comm.copy_to_tp(rows, group)
        out = [
            F.gelu(torch.addmm(self.b1[e], x, self.w1[e])) @ self.w2[e]
            for e, x in enumerate(rows.split(counts))
        ]
        y = comm.sum_over_tp(torch.cat(out), group)
        return y + self.b2.repeat_interleave(torch.tensor(counts, device=y.device), dim=0)


class MoE(nn.Module):
    """The MoE MLP (see the module docstring); ``ep_group``: the group its
    experts are spread over (set by ``clawcomm.parallel.expert.split``)."""

    def __init__(
        self,
        dim: int,
        experts: int,
        top_k: int = 2,
        capacity_factor: float = 0.0,
        balance_coeff: float = 1e-2,
        z_coeff: float = 1e-3,
        hidden: int | None = None,
    ):
        super().__init__()
        if top_k not in (1, 2) or top_k > experts:
            raise ValueError(
                f"moe: top_k must be 1 or 2 and at most experts {experts}, got {top_k}"
            )
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, hidden or 4 * dim)
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.balance_coeff, self.z_coeff = balance_coeff, z_coeff
        self.aux_scale = 1.0
        self.ep_group = None
        self.tp = None  # at tp > 1, the TP group its experts are split over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism every TP rank routes the whole sequence,
        # the same way (its experts hold a block of hidden units each).
        whole = self.tp is not None and self.tp.sequence_parallel
        if whole:
            x = comm.gather_whole(x, self.tp.group)
        tokens = x.reshape(-1, x.shape[-1])
        r = route(self.router(tokens), self.top_k, self.capacity_factor)
        out = expert.dispatch(tokens, r.chosen, r.gates, r.keep, self.experts, self.ep_group)
        if torch.is_grad_enabled():
            ROUTING.add(r)
            aux = self.balance_coeff * r.balance + self.z_coeff * r.z
            out = _AuxLoss.apply(out, aux, self.aux_scale)
        out = out.view(x.shape)
        return comm.own_tokens(out, self.tp.group) if whole else out


def layers_of(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """What each micro-batch's auxiliary losses weigh in the gradient."""
    for m in layers_of(model):
        m.aux_scale = scale


def maker(cfg):
    """What makes each MoE layer of ``cfg``'s model."""

    def make() -> MoE:
        return MoE(
            cfg.dim, cfg.experts, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coeff,
            cfg.z_loss_coeff,
        )  # fmt: skip

    return make


def check(cfg) -> None:
    """The MoE settings suit each other and the layout (ValueError)."""
    if cfg.model != "moe":
        if cfg.ep > 1:
            raise ValueError(f"ep {cfg.ep} spreads experts: it needs --model moe, not {cfg.model}")
        return
    for name in ("experts", "moe_every", "ep"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.top_k not in (1, 2) or cfg.top_k > cfg.experts:
        raise ValueError(
            f"top_k must be 1 or 2, and at most experts {cfg.experts}: got {cfg.top_k}"
        )
    if cfg.capacity_factor < 0:
        raise ValueError(f"capacity_factor must be >= 0 (0: no limit), got {cfg.capacity_factor}")
    if cfg.dp % cfg.ep:
        raise ValueError(
            f"ep {cfg.ep} must divide dp {cfg.dp}: expert parallelism spreads each expert "
            "copy over ep of the data-parallel ranks"
        )
    if cfg.experts % cfg.ep:
        raise ValueError(f"experts {cfg.experts} must be a multiple of ep {cfg.ep}")
    if cfg.ep > 1:
        for name, value, why in (
            ("sync", cfg.sync != "every-step", "replicas that meet every H steps"),
        ):
            if value:
                raise ValueError(
                    f"ep {cfg.ep} with {name} {getattr(cfg, name)!r} is not supported yet "
                    f"({why}): use ep 1 for it"
                )
    if cfg.activation_checkpoint == "full":
        raise ValueError(
            "activation_checkpoint full with --model moe is not supported yet (the recomputed "
            "forward would route and count the tokens again): use selective or none"
        )
