"""ZeRO-3: parameters held as shards between uses (Rajbhandari et al.,
stage 3: parameters / dp as well as gradients and optimizer state); and, at
ZeRO-1 and 2, the next forward waiting only for the buckets it needs.

    units = ParamUnits(shards, stages, last_backward, group=params_dp_group,
                       reshard_after_forward=True)
    executor.run(..., tracker=Trackers(reducer, units))   # gathers and frees by action
    ... optimizer.step(); units.updated()                # shards stepped: all freed

How it works:

- A *unit* is a layer: each child of a stage module (the stage itself for
  parameters of its own). The reducer's buckets never span two units
  (``GradReducer(units=...)``), so a unit is a set of buckets, and each
  bucket's flat parameter buffer (``ZeroShards``: the parameters are views
  of it) is gathered and freed whole. Freeing resizes the buffer's storage
  to zero bytes; gathering gives it back and all-gathers every rank's
  shard into it. The parameters stay the same tensors throughout, so what
  autograd saved in the forward reads the regathered values in backward.
- A unit is gathered in its forward pre-hook (and the next unit of the
  stage prefetched, asynchronously), and, if it was freed meanwhile, when
  the gradient of its output arrives in backward (a hook on the output;
  the unit before it prefetched).
- When it is freed is the action list's to say. ``reshard_after_forward``
  (the trainer's default at pp 1) frees a unit after each forward and, in
  backward, once backward has reached the unit before it (whose input
  gradient needs every node through this unit), as FSDP does: the shards
  and about two layers are held. Without it a unit stays gathered from its
  first use in an accumulation round to the end of its stage's last
  backward action in that round (under pipelining every micro-batch uses
  every layer, and regathering for each would multiply the all-gathers by
  the micro-batches; torchtitan keeps them too).
- The gathers run on the reducer's group, from the thread that runs the
  schedule (autograd's hooks included), so every rank issues them and the
  reductions in one order; where the reducer issues collectives from a
  thread of its own (compressed, overlapped), on a group of their own
  (``group``: the same ranks), so that the two never interleave.
- The parameters are sharded from the start: ``Trainer`` builds the shards
  at once, over the reducer's first bucket layout, and the first step
  gathers and frees by unit as every step does. When the first step's
  learned order changes the bucket layout, the shards are laid out anew from
  the old ones a bucket at a time (``ZeroShards.build``): a layer's old
  buffers are gathered, never the model. A load writes whole parameters
  (``unshard``) and the shards are laid out from them at once.
- The gradients: each bucket's full buffer is made as it launches, from
  autograd's gradients, and let go once reduce-scattered (the reducer).
- At ZeRO-1 and 2 (``shards.frees`` False) the parameters stay whole: after the
  optimizer's step every bucket's gather starts at once, in forward order,
  and each layer's forward pre-hook waits for its own buckets only.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from clawcomm.parallel.buckets import free_storage, holds_storage, restore_storage
from clawcomm.parallel.zero import ZeroShards


def gathers_per_round(microbatches: int, reshard_after_forward: bool) -> tuple[int, int]:
    """How many times an accumulation round all-gathers each unit: (before
    forwards, in backward). Resharding after forward, before every
    micro-batch's forward and again in its backward; else once, at its
    first use, and kept until the stage's last backward (the module
    docstring). The next unit is prefetched while one computes."""
    return (microbatches, microbatches) if reshard_after_forward else (1, 0)


def gathered_bytes(unit_bytes: list[float], reshard_after_forward: bool) -> float:
    """The bytes of whole units a rank holds beside its shards at a step's
    peak, for units of ``unit_bytes`` each: resharding after forward, about
    two (the one computing and the next, prefetched: the two largest
    counted); else every unit of its stages, kept across the round."""
    return sum(sorted(unit_bytes)[-2:]) if reshard_after_forward else sum(unit_bytes)


def unit_modules(stages: dict[int, nn.Module]) -> list[tuple[int, nn.Module]]:
    """(stage, module) of every unit, in forward order: each child of a
    stage that has parameters, then the stage itself if it has some of
    its own."""
    units = []
    for s in sorted(stages):
        mod = stages[s]
        units += [(s, child) for child in mod.children() if any(True for _ in child.parameters())]
        if any(True for _ in mod.parameters(recurse=False)):
            units.append((s, mod))
    return units


def unit_params(stages: dict[int, nn.Module]) -> list[list[torch.Tensor]]:
    """Every unit's parameters (all it uses: a parameter that two layers of
    a stage share is in both)."""
    roots = set(map(id, stages.values()))
    return [list(mod.parameters(recurse=id(mod) not in roots)) for _, mod in unit_modules(stages)]


def unit_of_params(params: list[torch.Tensor], stages: dict[int, nn.Module]) -> list[int]:
    """The unit of each parameter (the first that uses it; -1: none)."""
    first: dict[int, int] = {}
    for u, ps in enumerate(unit_params(stages)):
        for p in ps:
            first.setdefault(id(p), u)
    return [first.get(id(p), -1) for p in params]


class ParamUnits:
    """See the module docstring. ``last_backward``: stage -> the last
    backward action (B, I or W) of that stage in this rank's list."""

    def __init__(
        self,
        shards: ZeroShards,
        stages: dict[int, nn.Module],
        last_backward: dict,
        group=None,
        reshard_after_forward: bool = False,
    ):
        self.shards = shards
        self.group = group
        self.reshard = reshard_after_forward
        # False at ZeRO-1 and 2: the parameters stay whole, and the units
        # only say what the next forward must wait for after a step.
        self.frees = shards.frees
        self._stale: set[int] = set()  # buckets whose buffer holds old values
        self.last_backward = set(last_backward.values())
        self.units = unit_modules(stages)
        self._params = [[id(p) for p in ps] for ps in unit_params(stages)]
        self._entries: list[list] = [[] for _ in self.units]  # unit -> its buckets' entries
        self._pending: dict[int, object] = {}  # bucket index -> gather to complete
        self._built = -1  # the shards' build the units map
        self._hooks = []
        for u, (_, mod) in enumerate(self.units):
            self._hooks.append(
                mod.register_forward_pre_hook(lambda m, a, u=u: self._before_forward(u))
            )
            if self.frees:
                self._hooks.append(
                    mod.register_forward_hook(lambda m, a, out, u=u: self._after_forward(u, out))
                )

    # ---- state --------------------------------------------------------------------

    def active(self) -> bool:
        """Whether parameters are sharded now (the bucket layout is built)."""
        if self.shards.stale() or not self.shards.entries:
            return False
        if self._built != self.shards.builds:
            self._map()
        return True

    def _map(self) -> None:
        for finish in self._pending.values():  # (gathers into the old bucket layout: let them land)
            finish()
        owner = {}
        for entry in self.shards.entries:
            bucket = entry[0]
            for i in bucket.params:
                owner[id(self.shards.reducer.params[i])] = entry
        for u, ids in enumerate(self._params):
            seen, self._entries[u] = set(), []
            for pid in ids:
                entry = owner.get(pid)
                if entry is not None and entry[0].index not in seen:
                    seen.add(entry[0].index)
                    self._entries[u].append(entry)
        self._pending, self._stale = {}, set()
        self._built = self.shards.builds

    # ---- gather and free ----------------------------------------------------------

    def prefetch(self, u: int) -> None:
        """Starts gathering unit ``u``'s freed buckets."""
        if not 0 <= u < len(self.units):
            return
        for entry in self._entries[u]:
            bucket, flat, _ = entry
            fresh = holds_storage(flat) and bucket.index not in self._stale
            if bucket.index in self._pending or fresh:
                continue
            restore_storage(flat)
            self._stale.discard(bucket.index)
            self._pending[bucket.index] = self.shards.gather(entry, self.group)
        self._track()

    def use(self, u: int) -> None:
        """Unit ``u``'s parameters whole, now."""
        self.prefetch(u)
        for bucket, _, _ in self._entries[u]:
            finish = self._pending.pop(bucket.index, None)
            if finish is not None:
                finish()

    def free(self, u: int) -> None:
        if not self.frees:
            return
        for bucket, flat, _ in self._entries[u]:
            finish = self._pending.pop(bucket.index, None)
            if finish is not None:
                finish()  # a gather in flight writes into the storage: let it land
            free_storage(flat)

    def free_stage(self, stage: int) -> None:
        for u, (s, _) in enumerate(self.units):
            if s == stage:
                self.free(u)

    def free_all(self) -> None:
        for u in range(len(self.units)):
            self.free(u)

    def updated(self) -> None:
        """The optimizer stepped the shards: every gathered copy is stale.
        ZeRO-3 frees them all; ZeRO-1 and 2 start gathering every bucket,
        in the order the next forward needs them, and that forward waits
        for each unit's buckets only (``settle`` waits for all)."""
        self.shards.updated()
        if not self.active():
            return
        if self.frees:
            self.free_all()
            return
        self._stale = {entry[0].index for entry in self.shards.entries}
        for u in range(len(self.units)):
            self.prefetch(u)

    def settle(self) -> None:
        """The gathers in flight landed. At ZeRO-1 and 2 that makes every
        parameter whole; stage 3 leaves the units it freed as they are."""
        if self.active():
            if self.frees:
                self.land()
            else:
                self._use_all()

    def land(self) -> None:
        """Every gather in flight landed (before the shards are laid out
        anew, which frees the buffers they write into)."""
        pending, self._pending = self._pending, {}
        for finish in pending.values():
            finish()

    def unshard(self) -> None:
        """Every parameter whole, and left so (a load writes them; the
        shards laid out from them afterwards free them again)."""
        if self.active():
            self._use_all()

    @contextlib.contextmanager
    def whole(self):
        """Every parameter whole inside (for a checkpoint); yields whether
        they were sharded (and are freed again after: stage 3)."""
        if not self.active():
            yield False
            return
        self._use_all()
        try:
            yield self.frees
        finally:
            self.free_all()

    def _use_all(self) -> None:
        for u in range(len(self.units)):
            self.use(u)

    def _track(self) -> None:
        self.shards.note_peak()

    # ---- hooks and actions --------------------------------------------------------

    def _before_forward(self, u: int) -> None:
        if self.active():
            self.use(u)
            self.prefetch(self._neighbour(u, +1))

    def _after_forward(self, u: int, out) -> None:
        if not self.active():
            return
        # The gradient of the unit's output: its backward is next (a tensor
        # hook, lighter than a module's full backward hook).
        outs = out if isinstance(out, tuple | list) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, u=u: self._before_backward(u))
        if self.reshard and torch.is_grad_enabled():
            self.free(u)

    def _before_backward(self, u: int) -> None:
        if not self.active():
            return
        self.use(u)
        after = self._neighbour(u, +1)
        if self.reshard and after >= 0:
            self.free(after)  # backward went through it: no node left needs its weights
        self.prefetch(self._neighbour(u, -1))

    def _neighbour(self, u: int, step: int) -> int:
        """The unit next to ``u`` in its stage (-1: none)."""
        v = u + step
        if 0 <= v < len(self.units) and self.units[v][0] == self.units[u][0]:
            return v
        return -1

    def begin_action(self, action) -> None:
        pass

    def end_action(self, action) -> None:
        """The end of a backward action frees its stage's units when it is the
        round's last for that stage (or, resharding, after every one)."""
        if action.kind == "F" or not self.frees or not self.active():
            return
        if self.reshard or action in self.last_backward:
            self.free_stage(action.stage)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class Trackers:
    """Several trackers heard as one by the pipeline executor (each
    ``begin_action`` in order, each ``end_action`` in reverse)."""

    def __init__(self, *trackers):
        self.trackers = [t for t in trackers if t is not None]

    def begin_action(self, action) -> None:
        for t in self.trackers:
            t.begin_action(action)

    def end_action(self, action) -> None:
        for t in reversed(self.trackers):
            t.end_action(action)
