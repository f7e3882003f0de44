"""How the trainer's models split over a tensor-parallel group:
``parallelize`` applied to the whole model, built whole on every rank from
one seed, so that each rank keeps its slices of the very weights a single
process would train.

- gpt (Megatron-LM's split): attention's Q, K and V column-parallel with
  whole heads per rank, its output projection row-parallel; the MLP's up
  projection column-parallel, its down projection row-parallel; the token
  embedding and the tied output layer split by vocabulary, with the
  vocabulary-parallel cross-entropy as the loss. With sequence parallelism
  the residual stream, the LayerNorms and the position embedding hold
  ``seq_len / tp`` tokens; their parameters' gradients are partial and are
  summed over the group after the step's backward (``sum_partial_grads``).
- mlp: its linear layers alternate column- and row-parallel (an odd last
  one stays whole), so the activations between a pair are split and the
  logits whole.
- wait: each waiting layer holds 1/tp of its weight and waits 1/tp of the
  time, and exchanges what a sequence-parallel layer pair does: an
  all-gather of ``[micro-batch, seq_len, width]`` before, a reduce-scatter
  after, in forward and in the input-gradient pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from clawcomm.parallel.split import Split, block_of, cut_parameter, split_of, split_parameter
from clawcomm.parallel.tensor import comm
from clawcomm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


@dataclass
class TensorParallel:
    """This rank's place in its TP group, and how the layers talk."""

    group: object
    rank: int
    size: int
    sequence_parallel: bool
    overlap: bool
    tokens: int = 0  # wait: tokens per sample that a layer's exchange carries


def check(model_name: str, tp: int, heads: int, seq_len: int, sequence_parallel: bool) -> None:
    """Raises ValueError for a split ``parallelize`` cannot make (before any rank starts)."""
    if tp == 1:
        return
    if model_name == "gpt" and heads % tp:
        raise ValueError(
            f"tp {tp} splits attention by whole heads: heads {heads} is not a multiple of tp {tp}"
        )
    if sequence_parallel and model_name in ("gpt", "wait") and seq_len % tp:
        raise ValueError(
            f"sequence parallelism splits the tokens: seq_len {seq_len} is not a multiple of "
            f"tp {tp} (or --no-sequence-parallel)"
        )


class ParallelEmbedding(nn.Module):
    """The GPT's embedding: tokens split by vocabulary; positions whole,
    added to this rank's tokens."""

    token_positions: torch.Tensor | None = None  # as models.Embedding's

    def __init__(self, emb, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.tokens = VocabParallelEmbedding(emb.tokens, tp)
        self.positions = emb.positions

    def forward(self, idx):
        from clawcomm.train.models import held_positions

        pos = held_positions(self, idx)
        x = self.tokens(idx)
        if self.tp.sequence_parallel:
            per = idx.shape[1] // self.tp.size
            pos = pos[self.tp.rank * per : (self.tp.rank + 1) * per]
        return x + self.positions(pos)


def _split_block(block, tp: TensorParallel) -> set[int]:
    """A GPT block in place: its forward reads widths from its layers, so it
    runs split with ``heads / tp`` heads. Returns the ids of its whole
    parameters that every rank computes alike (``Parallelized.alike``)."""
    d = block.qkv.in_features
    start, width = block_of(d, tp.size, tp.rank)
    qkv_rows = tuple((j * d + start, width) for j in range(3))  # this rank's heads of Q, K, V
    block.qkv = ColumnParallelLinear(block.qkv, tp, qkv_rows)
    block.proj = RowParallelLinear(block.proj, tp)
    block.heads //= tp.size
    if "moe" in block._modules:  # every expert's hidden units split, as the MLP's
        return _split_experts(block.moe, tp)
    block.fc = ColumnParallelLinear(block.fc, tp)
    block.out = RowParallelLinear(block.out, tp)
    return set()


def _split_experts(moe, tp: TensorParallel) -> set[int]:
    """A mixture-of-experts MLP (train/moe.py) in place: each expert's up
    projection column-parallel and its down projection row-parallel (w1's
    and b1's hidden columns, w2's hidden rows); the router and b2 whole,
    computed alike on every rank (``Parallelized.alike``)."""
    experts = moe.experts
    hidden = (block_of(experts.b1.shape[1], tp.size, tp.rank),)
    for name, dim in (("w1", 2), ("b1", 1), ("w2", 1)):
        cut_parameter(getattr(experts, name), dim, hidden)
    moe.tp = experts.tp = tp
    return {id(moe.router.weight), id(experts.b2)}


class _Head(nn.Module):
    def __init__(self, head, weight: nn.Parameter, tp: TensorParallel):
        super().__init__()
        self.norm = head.norm
        linear = nn.Linear(head.proj.in_features, head.proj.out_features, bias=False)
        self.proj = ColumnParallelLinear(linear, tp, split_of(weight).pieces)
        self.proj.weight = weight  # tied to the embedding's block of the vocabulary

    def forward(self, x):
        return self.proj(self.norm(x))


class _WaitingExchange(torch.autograd.Function):
    """A waiting layer split over the group: 1/tp of each wait, and the
    bytes of a sequence-parallel layer pair around it."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.layer, ctx.rows = layer, x.shape[0]
        layer.exchange(layer.forward_s, ctx.rows)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        from clawcomm.pipeline.weight_grad import defer_weight_grad, notify_grad

        layer = ctx.layer
        layer.exchange(layer.input_s, ctx.rows)

        def weight_pass():
            time.sleep(layer.weight_s)
            notify_grad(layer.weight)

        defer_weight_grad(weight_pass)
        return grad.contiguous(), None, None


class ParallelWaitingLayer(nn.Module):
    def __init__(self, layer, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        w = layer.weight.shape[0]
        rows = (block_of(w, tp.size, tp.rank),)
        self.weight = split_parameter(layer.weight, Split((w, w), 0, rows))
        self.forward_s, self.input_s, self.weight_s = (
            layer.forward_s / tp.size,
            layer.input_s / tp.size,
            layer.weight_s / tp.size,
        )
        self.width = w

    def exchange(self, seconds: float, rows: int) -> None:
        """Gather the tokens of ``rows`` samples' input, wait ``seconds``,
        reduce-scatter the output; overlapped: each half of the wait cut
        into one block per rank, the blocks exchanged with every peer
        meanwhile (``comm.gather_apply``, ``comm.apply_scatter``)."""
        tp = self.tp
        rows = max(1, rows)
        x = torch.zeros(rows, tp.tokens // tp.size, self.width)
        per_block = seconds / 2 / tp.size
        if tp.overlap:  # (the "computation" makes nothing: an empty slice each)
            comm.gather_apply(x, lambda blk: time.sleep(per_block) or blk[:, :0], tp.group, False)
            comm.apply_scatter(lambda d: time.sleep(per_block) or x, tp.group)
        else:
            comm.all_gather_tokens(x, tp.group)
            time.sleep(seconds)
            comm.reduce_scatter_tokens(torch.zeros(rows, tp.tokens, self.width), tp.group)

    def forward(self, x):
        return _WaitingExchange.apply(x, self.weight, self)


@dataclass
class Parallelized:
    """What ``parallelize`` made: the loss to use, and the parameters it
    left whole (LayerNorms, row-parallel biases, positions, an odd last
    linear layer, a mixture of experts' router and output biases), whose
    copies on the TP ranks the trainer keeps equal; ``alike``: those of them
    every rank computes on the whole sequence even with sequence
    parallelism (the experts' router and output biases)."""

    tp: TensorParallel
    loss_fn: object
    replicated: list[nn.Parameter]
    alike: set[int] = field(default_factory=set)

    def replicated_ids(self) -> set[int]:
        return {id(p) for p in self.replicated}

    def sync_replicated_grads(self) -> None:
        """The whole parameters' gradients made one over the group (one
        all-reduce): with sequence parallelism each rank's is partial (its
        tokens only) and they are summed; otherwise (or ``alike``) they are
        equal and averaged, so that no rounding lets the copies drift apart."""
        held = [p for p in self.replicated if p.grad is not None]
        if not held:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in held])
        comm.all_reduce(flat, self.tp.group)
        sp = self.tp.sequence_parallel
        if not sp:
            flat /= self.tp.size
        at = 0
        for p in held:
            g = flat[at : at + p.numel()].view_as(p)
            at += p.numel()
            if sp and id(p) in self.alike:
                g /= self.tp.size
            p.grad.copy_(g)


def split_layers(model, loss_fn, cfg, grid, group) -> Parallelized:
    """The trainer's split (``--tp``): ``parallelize`` over ``group`` with
    the config's sequence parallelism and overlap, this rank being ``grid``'s
    TP rank. Every rank built the whole model from one seed, so each keeps
    its slices of the same weights."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"Trainer: tp {cfg.tp} splits the layers of an nn.Sequential model; got a list "
            "of stage modules"
        )
    tokens = cfg.seq_len if cfg.model == "wait" else 0
    tp = TensorParallel(
        group, grid.tp_rank, cfg.tp, cfg.sequence_parallel_on, cfg.tp_overlap_on, tokens
    )
    return parallelize(model, loss_fn, tp)


def _replicated(model: nn.Module) -> list[nn.Parameter]:
    out, seen = [], set()
    for p in model.parameters():
        if split_of(p) is None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def parallelize(model: nn.Sequential, loss_fn, tp: TensorParallel) -> Parallelized:
    """Splits ``model`` (one of the trainer's: gpt, mlp, wait) in place over
    ``tp``'s group; returns the loss to use and the parameters left whole."""
    from clawcomm.train import models

    layers = list(model)
    kinds = {type(m) for m in layers}
    if models.Block in kinds or models.Embedding in kinds:
        return _gpt(model, loss_fn, tp)
    if kinds == {models.WaitingLayer}:
        for i, m in enumerate(layers):
            model[i] = ParallelWaitingLayer(m, tp)
        return Parallelized(tp, loss_fn, _replicated(model))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    others = [
        m
        for m in model.modules()
        if not isinstance(m, nn.Linear | nn.Sequential | nn.ReLU | nn.GELU | nn.Tanh)
    ]
    if not linears or others:
        what = type(others[0]).__name__ if others else "no linear layer"
        raise ValueError(
            f"tp {tp.size}: clawcomm splits the gpt, mlp and wait models (or an nn.Sequential of "
            f"Linear layers and activations); this model has {what}"
        )
    pairs = len(linears) // 2 * 2  # an odd last layer stays whole
    replace = {}
    for i, lin in enumerate(linears[:pairs]):
        cls = ColumnParallelLinear if i % 2 == 0 else RowParallelLinear
        replace[id(lin)] = cls(lin, tp)
    _replace(model, replace)
    return Parallelized(tp, loss_fn, _replicated(model))


def _replace(module: nn.Module, new: dict) -> None:
    for name, child in module.named_children():
        if id(child) in new:
            setattr(module, name, new[id(child)])
        else:
            _replace(child, new)


def _gpt(model: nn.Sequential, loss_fn, tp: TensorParallel) -> Parallelized:
    from clawcomm.train import models

    if loss_fn is not models.gpt_loss:
        raise ValueError(
            "tp: the gpt's logits are split by vocabulary, so its loss is the vocabulary-parallel "
            "cross-entropy; the trainer replaces models.gpt_loss with it, and cannot replace "
            f"{getattr(loss_fn, '__name__', loss_fn)!r}"
        )
    emb = model[0]
    tied = emb.tokens.weight
    model[0] = ParallelEmbedding(emb, tp)
    weight = model[0].tokens.weight
    alike = set()
    for m in list(model)[1:-1]:
        alike |= _split_block(m, tp)
    head = model[-1]
    if head.proj.weight is not tied:
        raise ValueError("tp: the gpt's output layer must be tied to its token embedding")
    model[len(model) - 1] = _Head(head, weight, tp)
    start = model[0].tokens.start
    group = tp.group

    def loss(logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, start, group)

    return Parallelized(tp, loss, _replicated(model), alike)


# ---- what a split layer sends (the planner prices it) ----------------------------------

AG, RS, AR = "all_gather", "reduce_scatter", "all_reduce"


def block_collectives(act_bytes: float, sequence_parallel: bool) -> dict[str, list]:
    """What one transformer block split over a TP group sends for one
    micro-batch whose activation (``[micro-batch, tokens, width]``) is
    ``act_bytes``, by pass (``traffic`` says why)."""
    if sequence_parallel:
        return {"F": [(AG, act_bytes), (RS, act_bytes)] * 2,
                "B": [(AG, act_bytes)] * 4 + [(RS, act_bytes)] * 2}  # fmt: skip
    return {"F": [(AR, act_bytes)] * 2, "B": [(AR, act_bytes)] * 2}


def traffic(
    model: nn.Sequential, micro_batch_size: int, seq_len: int, sequence_parallel: bool
) -> list[dict[str, list[tuple[str, float]]]]:
    """Per layer of the whole (unsplit) model, the collectives its split form
    makes over the TP group for one micro-batch, by pass: "F" (forward) and
    "B" (backward; the input-gradient pass where it is split), each as
    (collective, bytes of the whole tensor: an all-gather's output, a
    reduce-scatter's input, an all-reduce's buffer, as the cost model takes
    them). The layers as ``parallelize`` splits them:

    - a gpt block, sequence parallel: forward gathers before its two
      column-parallel layers and reduce-scatters after its two row-parallel
      ones; backward gathers each column layer's input again and the row
      layers' gradients (4 all-gathers) and reduce-scatters the column
      layers' input gradients (2). Without: an all-reduce after each row
      layer forward, and after each column layer's input gradient;
    - the embedding: its lookup summed (reduce-scattered); the head: its
      input gathered, the loss's max and sums all-reduced (one float and
      two per token);
    - the mlp: an all-reduce after each row-parallel layer forward, and of
      each column-parallel layer's input gradient but the first's (the
      data's);
    - a waiting layer: an all-gather and a reduce-scatter of
      ``[micro-batch, seq_len, width]`` in forward and in backward."""
    from clawcomm.train import models

    layers = list(model)
    tokens = micro_batch_size * seq_len
    sp = sequence_parallel
    out: list[dict[str, list[tuple[str, float]]]] = []
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    role = {
        id(m): ("col" if i % 2 == 0 else "row")
        for i, m in enumerate(linears[: len(linears) // 2 * 2])
    }
    for layer in layers:
        f: list[tuple[str, float]] = []
        b: list[tuple[str, float]] = []
        if isinstance(layer, models.Block):
            passes = block_collectives(4.0 * tokens * layer.qkv.in_features, sp)
            f, b = passes["F"], passes["B"]
        elif isinstance(layer, models.Embedding):
            act = 4.0 * tokens * layer.tokens.embedding_dim
            f, b = ([(RS, act)], [(AG, act)]) if sp else ([(AR, act)], [])
        elif isinstance(layer, models.Head):
            act = 4.0 * tokens * layer.proj.in_features
            loss = [(AR, 4.0 * tokens), (AR, 8.0 * tokens)]
            f, b = ([(AG, act)] + loss, [(AG, act), (RS, act)]) if sp else (loss, [(AR, act)])
        elif isinstance(layer, models.WaitingLayer):
            act = 4.0 * tokens * layer.weight.shape[0]
            f = b = [(AG, act), (RS, act)]
        else:
            for m in layer.modules() if isinstance(layer, nn.Module) else ():
                r = role.get(id(m))
                if r == "row":
                    f.append((AR, 4.0 * micro_batch_size * m.out_features))
                elif r == "col" and m is not linears[0]:  # (the first one's input is the data)
                    b.append((AR, 4.0 * micro_batch_size * m.in_features))
        out.append({"F": f, "B": b})
    return out
