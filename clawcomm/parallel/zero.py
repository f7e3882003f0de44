"""ZeRO-1: each data-parallel rank keeps the optimizer state of its shard of
the parameters only (Rajbhandari et al., stage 1: optimizer state / dp).

    reducer = GradReducer(params, dp_group, zero=True, replicated=tied)
    shards = ZeroShards(reducer)
    ... backward; reducer.finish() ...
    optimizer = shards.ready(optimizer, make_optimizer)   # new shards after a new layout
    optimizer.step()                                      # on this rank's shards
    shards.all_gather()                               # everyone's updated parameters

How it works:

- The reducer lays parameters out in buckets (its learned order); each
  sharded bucket's gradient buffer is padded to a multiple of the group's
  size and reduce-scattered (AVG), so rank k holds the average of its
  k-th slice (``bucket.shard_grad``).
- ``build`` gives every sharded bucket a flat parameter buffer of the same
  layout and makes its parameters views of it (``p.data``); rank k's slice
  of that buffer is a leaf tensor, ``shard``, whose gradient is
  ``bucket.shard_grad``. The optimizer steps the shards (and the
  replicated parameters, whose gradients the reducer all-reduces: the
  tied ones that other pipeline ranks also update), in place.
- ``all_gather`` gathers each bucket's slices back into its buffer, which
  updates every parameter (the padding stays zero: zero gradient, zero
  weight).
- The optimizer must be elementwise (SGD, Adam, AdamW: a state tensor per
  element, updated from that element alone): one that looks across a
  tensor (LAMB's trust ratio, Adafactor's factored moments) would see a
  slice of a flat buffer instead of a parameter.
- ``full_state``/``load_full_state``: the optimizer state by original
  parameter, whole (gathered over the group; for checkpoints, which keep
  whole-model names whatever the stage).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from clawcomm._torch_names import all_gather_single
from clawcomm.parallel.reducer import GradReducer


class ZeroShards:
    """The parameter side of the reducer's sharded buckets (see the module
    docstring)."""

    def __init__(self, reducer: GradReducer):
        self.reducer = reducer
        self.group = reducer.group
        self.n = reducer.world_size
        self.k = dist.get_rank(reducer.group)
        self.entries: list[tuple] = []  # (bucket, flat parameters, shard)
        self.replicated: list[torch.Tensor] = []
        self._version = -1
        self._loaded: dict | None = None

    def ready(self, optimizer, make_optimizer):
        """The optimizer to step: ``optimizer`` while the layout holds, else
        ``make_optimizer`` over freshly laid-out shards, with the state
        carried over (or the state ``load`` was given) and the same LRs."""
        if not self.stale():
            return optimizer
        state = self._loaded
        if state is None and self.entries:
            state = self.full_state(optimizer)
        lrs = [g["lr"] for g in optimizer.param_groups]
        optimizer = make_optimizer(self.build())
        for g, lr in zip(optimizer.param_groups, lrs, strict=False):
            g["lr"] = lr
        if state:
            self.load_full_state(optimizer, state)
        self._loaded = None
        return optimizer

    def state(self, optimizer) -> dict:
        """The optimizer state by whole parameter (``full_state``; before
        the first layout, what ``load`` was given)."""
        if self.stale():
            return dict(self._loaded or {})
        return self.full_state(optimizer)

    def load(self, state: dict) -> None:
        """Whole per-parameter optimizer state, for the next ``ready``,
        which lays the (loaded) parameters out afresh."""
        self._loaded = state
        self._version = -1

    def stale(self) -> bool:
        """Whether the reducer's layout changed since ``build`` (or there
        was none yet)."""
        return self._version != self.reducer.layout_version

    def build(self) -> list[torch.Tensor]:
        """Lays the parameters out over the reducer's buckets and returns
        what the optimizer steps: this rank's shards, then the replicated
        parameters."""
        r = self.reducer
        self.entries = []
        for bucket in r.buckets:
            if not bucket.shards:
                continue
            flat = torch.zeros(bucket.padded, dtype=bucket.dtype, device=bucket.device)
            for i, offset in zip(bucket.params, bucket.offsets, strict=True):
                p = r.params[i]
                view = flat[offset : offset + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
            lo = self.k * bucket.shard
            shard = nn.Parameter(flat[lo : lo + bucket.shard])
            shard.grad = bucket.shard_grad
            self.entries.append((bucket, flat, shard))
        self.replicated = [p for i, p in enumerate(r.params) if not r.sharded(i)]
        self._version = r.layout_version
        return self.tensors()

    def tensors(self) -> list[torch.Tensor]:
        """What the optimizer steps (``build``'s list)."""
        return [shard for _, _, shard in self.entries] + self.replicated

    def all_gather(self) -> None:
        """Every rank's updated shards into every rank's parameters."""
        works = [
            all_gather_single(flat, shard.detach().clone(), self.group, async_op=True)
            for _, flat, shard in self.entries
        ]
        for w in works:
            w.wait()

    def sumsq(self, skip: set[int]) -> float:
        """This rank's part of the squared gradient norm, scaled so that
        the trainer's sum over every rank divided by dp is the whole norm:
        a shard counts dp times (each rank holds a different one), a
        replicated gradient once per replica. ``skip``: ids of replicated
        parameters another pipeline rank counts."""
        total = torch.zeros((), dtype=torch.float64)
        for _, _, shard in self.entries:
            total += self.n * shard.grad.double().square().sum().cpu()
        for p in self.replicated:
            if p.grad is not None and id(p) not in skip:
                total += p.grad.double().square().sum().cpu()
        return float(total)

    def full_state(self, optimizer) -> dict:
        """{parameter: {key: whole state tensor}} for every parameter of the
        reducer (collective over the group: every rank calls it)."""
        out: dict = {p: dict(optimizer.state.get(p, {})) for p in self.replicated}
        r = self.reducer
        for bucket, _, shard in self.entries:
            state = optimizer.state.get(shard, {})
            for key in sorted(state):
                v = state[key]
                if isinstance(v, torch.Tensor) and v.shape == shard.shape:
                    whole = v.new_empty(bucket.padded)
                    all_gather_single(whole, v.contiguous(), self.group)
                else:
                    whole = None  # a scalar (Adam's step): the same on every rank
                for i, offset in zip(bucket.params, bucket.offsets, strict=True):
                    p = r.params[i]
                    piece = v if whole is None else whole[offset : offset + p.numel()]
                    out.setdefault(p, {})[key] = piece if whole is None else piece.view_as(p)
        return out

    def load_full_state(self, optimizer, state: dict) -> None:
        """Sets the optimizer's state from whole per-parameter state (as
        ``full_state`` gives): this rank keeps its shards' slices."""
        r = self.reducer
        for p in self.replicated:
            if p in state:
                optimizer.state[p] = dict(state[p])
        for bucket, _, shard in self.entries:
            members = [
                (r.params[i], off) for i, off in zip(bucket.params, bucket.offsets, strict=True)
            ]
            keys = set().union(*(state.get(p, {}).keys() for p, _ in members))
            if not keys:
                continue
            mine = {}
            lo = self.k * bucket.shard
            for key in sorted(keys):
                sample = next(state[p][key] for p, _ in members if key in state.get(p, {}))
                if sample.shape == ():  # a scalar (Adam's step)
                    mine[key] = sample.clone()
                    continue
                whole = sample.new_zeros(bucket.padded)
                for p, off in members:
                    if key in state.get(p, {}):
                        whole[off : off + p.numel()] = state[p][key].reshape(-1)
                mine[key] = whole[lo : lo + bucket.shard].clone()
            optimizer.state[shard] = mine
