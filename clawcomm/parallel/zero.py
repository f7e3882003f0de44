"""ZeRO-1: each data-parallel rank keeps the optimizer state of its shard of
the parameters only (Rajbhandari et al., stage 1: optimizer state / dp).

    reducer = GradReducer(params, dp_group, zero=1, replicated=tied)
    shards = ZeroShards(reducer)
    ... backward; reducer.finish() ...
    optimizer = shards.ready(optimizer, make_optimizer)   # new shards after a new bucket layout
    optimizer.step()                                      # on this rank's shards
    shards.all_gather()                               # everyone's updated parameters

(The trainer gathers through ``clawcomm.parallel.zero3.ParamUnits`` instead:
the gathers start after the step and each layer's forward waits for its own.)

How it works:

- The reducer lays parameters out in buckets (its learned order); each
  sharded bucket's gradient buffer is padded to a multiple of the group's
  size and reduce-scattered (AVG), so rank k holds the average of its
  k-th slice (``bucket.shard_grad``).
- ``build`` gives every sharded bucket a flat parameter buffer laid out
  as its gradient's (the same offsets) and makes its parameters views of
  it (``p.data``); rank k's slice of that buffer is a leaf tensor, ``shard``, whose gradient is
  ``bucket.shard_grad``. The optimizer steps the shards (and the
  replicated parameters, whose gradients the reducer all-reduces: the
  tied ones that other pipeline ranks also update), in place.
- ``all_gather`` gathers each bucket's slices back into its buffer, which
  updates every parameter (the padding stays zero: zero gradient, zero
  weight).
- At ZeRO-3 (``frees``) a buffer holds storage only while its layer is
  gathered (``clawcomm.parallel.zero3``). ``build`` then takes each shard
  from the parameters directly, and when the reducer lays its buckets out
  anew (the first step's learned order), from the old shards, gathering
  one old bucket at a time: no step holds the whole model.
- The optimizer must be elementwise (SGD, Adam, AdamW: a state tensor per
  element, updated from that element alone): one that looks across a
  tensor (LAMB's trust ratio, Adafactor's factored moments) would see a
  slice of a flat buffer instead of a parameter.
- ``full_state``/``load_full_state``: the optimizer state by original
  parameter, whole (gathered over the group; for checkpoints, which keep
  whole-model names whatever the ZeRO stage).
- ``param_compression`` (ZeRO++'s qwZ): the all-gather sends each shard in
  fp16, bf16 or int8 (blocks of 256 values with a float32 scale, rounded to
  nearest), and every rank, this one included, computes with the decoded
  weights; each keeps its shard's float32 master weights apart, as the
  optimizer's parameter. Checkpoints keep the decoded weights as the
  model's and the masters whole, under the optimizer-state key ``MASTER``,
  so a resumed run continues bit for bit (a run loaded without
  ``param_compression`` drops them and starts from the decoded weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from clawcomm._torch_names import all_gather_single
from clawcomm.compression.quantized import dequantize, quantize
from clawcomm.parallel.buckets import free_storage, restore_storage
from clawcomm.parallel.reducer import GradReducer

MASTER = "zero_master"  # optimizer-state key of the float32 weights (param_compression)
_BLOCK = 256  # int8 parameter blocks
_WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def model_state_bytes(params: float, dp: int, zero: int,
                      optimizer_bytes: float = 8.0) -> dict[str, float]:  # fmt: skip
    """What a rank holds between steps of ``params`` float32 parameters over
    ``dp`` replicas at ZeRO stage ``zero``, as the trainer holds it (an
    optimizer of ``optimizer_bytes`` a parameter: AdamW's two moments, 8):
    optimizer state 1/dp from ZeRO-1; gradients 1/dp from ZeRO-2 (ZeRO-1
    keeps the full buffers beside its shards); parameters 1/dp at ZeRO-3
    between uses (the layers gathered while they compute come on top)."""
    shard = lambda stage: dp if zero >= stage else 1  # noqa: E731
    grads = 4.0 * params * (1 + 1 / dp if zero == 1 and dp > 1 else 1 / shard(2))
    return {"param_bytes": 4.0 * params / shard(3), "grad_bytes": grads,
            "optim_bytes": optimizer_bytes * params / shard(1)}  # fmt: skip


def step_peak_bytes(params: float, dp: int, zero: int, gathered: float = 0.0,
                    optimizer_bytes: float = 8.0) -> dict[str, float]:  # fmt: skip
    """The most a rank holds during a step, as the trainer's
    ``--max-memory-mb`` counts it: ``model_state_bytes`` with the gradients
    at their peak (from ZeRO-1 on the full buffers beside the parts while a
    round's backward runs) and, at ZeRO-3, the ``gathered`` bytes of the
    layers held whole beside the shards (``zero3.gathered_bytes``)."""
    held = model_state_bytes(params, dp, zero, optimizer_bytes)
    held["grad_bytes"] = 4.0 * params * (1 + 1 / dp if zero >= 1 and dp > 1 else 1)
    held["param_bytes"] += gathered if zero == 3 else 0.0
    return held


def drop_masters(state: dict) -> dict:
    """One parameter's optimizer state without the master weights a run
    with ``param_compression`` saved."""
    return {k: v for k, v in state.items() if k != MASTER}


class ZeroShards:
    """The parameter side of the reducer's sharded buckets (see the module
    docstring)."""

    def __init__(self, reducer: GradReducer, param_compression: str = "none"):
        if param_compression not in ("none", "int8", *_WIRES):
            raise ValueError(
                f"ZeroShards: param_compression must be none, fp16, bf16 or int8, not "
                f"{param_compression!r}"
            )
        self.codec = None if param_compression == "none" else param_compression
        # ZeRO-3: a bucket's flat parameters hold storage only while gathered
        # (clawcomm.parallel.zero3 gathers and frees them by layer).
        self.frees = reducer.zero == 3
        # Each shard in storage of its own, not a view of its bucket's flat
        # parameters (ZeRO-3 frees those between uses; compressed gathers
        # keep float32 masters apart from the decoded weights).
        self.separate = self.frees or self.codec is not None
        self.peak_bytes = 0  # the most parameter bytes held since reset_peak
        self._encoded: dict[int, list[torch.Tensor]] = {}  # bucket -> this step's wire parts
        self.reducer = reducer
        self.group = reducer.group
        self.n = reducer.world_size
        self.k = dist.get_rank(reducer.group)
        self.entries: list[tuple] = []  # (bucket, flat parameters, shard)
        self.replicated: list[torch.Tensor] = []
        self._version = -1  # the reducer's bucket layout the shards were built over
        self.builds = 0  # how many times they were (each build makes new buffers)
        self._loaded: dict | None = None

    def ready(self, optimizer, make_optimizer):
        """The optimizer to step: ``optimizer`` while the bucket layout holds, else
        ``make_optimizer`` over freshly laid-out shards, with the state
        carried over (or the state ``load`` was given) and the same LRs.
        At ZeRO-3 a new bucket layout (the first step's learned order) is
        built from the old one's shards (``build(from_shards=True)``)."""
        if not self.stale():
            return optimizer
        old = self.entries
        moved = self.frees and self._loaded is None and bool(old)
        state = self._loaded
        if state is None and old:
            # (Whole, if there is any: a new bucket layout comes in the first
            # step, before the optimizer's first. Moved shards carry their
            # float32 masters themselves.)
            state = self.full_state(optimizer, masters=not moved)
        lrs = [g["lr"] for g in optimizer.param_groups]
        optimizer = make_optimizer(self.build(from_shards=moved))
        for g, lr in zip(optimizer.param_groups, lrs, strict=False):
            g["lr"] = lr
        if state:
            self.load_full_state(optimizer, state)
        self._loaded = None
        return optimizer

    def state(self, optimizer) -> dict:
        """The optimizer state by whole parameter (``full_state``; before
        the first bucket layout, what ``load`` was given)."""
        if self.stale():
            return dict(self._loaded or {})
        return self.full_state(optimizer)

    def load(self, state: dict) -> None:
        """Whole per-parameter optimizer state, for the next ``ready``,
        which lays the (loaded) parameters out afresh."""
        self._loaded = state
        self._version = -1

    def stale(self) -> bool:
        """Whether the reducer's bucket layout changed since ``build`` (or there
        was none yet)."""
        return self._version != self.reducer.buckets_version

    def build(self, from_shards: bool = False) -> list[torch.Tensor]:
        """Lays the parameters out over the reducer's buckets and returns
        what the optimizer steps: this rank's shards, then the replicated
        parameters. Bucket by bucket, each parameter read as it is (at
        construction; after a load, which wrote it whole) or, with
        ``from_shards``, from the old bucket layout's shards, each old
        bucket gathered (float32, exactly) when a new one first needs it.
        At ZeRO-3 (``frees``) a new bucket's buffer is never filled (its
        shard takes its part of each parameter), and each old bucket is
        freed, with its shard, once every parameter has left it: as the
        reducer's buckets never span two layers, about one layer's old
        buffers are whole at once beside the shards (more where the learned
        order comes back to a layer it has left), never the model."""
        r = self.reducer
        old, self.entries = self.entries, []
        source: dict[int, tuple] = {}  # parameter -> its old entry
        left: dict[int, int] = {}  # old bucket -> its parameters not laid out anew yet
        gathered: set[int] = set()
        for entry in old:
            left[entry[0].index] = len(entry[0].params)
            for i in entry[0].params:
                source[id(r.params[i])] = entry
        for bucket in r.buckets:
            if not bucket.shards:
                continue
            froms: dict[int, tuple] = {}  # old bucket -> its entry, for this bucket's parameters
            for i in bucket.params:
                entry = source.get(id(r.params[i]))
                if entry is not None:
                    froms.setdefault(entry[0].index, entry)
                    left[entry[0].index] -= 1
            for b, entry in froms.items():
                if from_shards and b not in gathered:
                    gathered.add(b)
                    self._gather_exact(entry)
            flat, shard = self._lay_out(bucket)
            shard.grad = bucket.shard_grad
            self.entries.append((bucket, flat, shard))
            self.note_peak(self._bytes(old))
            for b, entry in froms.items():
                if self.frees and left[b] == 0:  # every parameter left it
                    free_storage(entry[1])
                    if from_shards:
                        free_storage(entry[2])
                        entry[2].grad = None
        self._encoded = {}  # (by bucket index: the old bucket layout's)
        self.replicated = [p for i, p in enumerate(r.params) if not r.sharded(i)]
        self._version = r.buckets_version
        self.builds += 1
        return self.tensors()

    def _lay_out(self, bucket) -> tuple[torch.Tensor, nn.Parameter]:
        """One bucket's flat parameters, with its parameters made views of
        it, and this rank's shard, from the parameters' values now. At
        ZeRO-3 the buffer's storage goes as soon as the views exist: the
        shard takes its part of each parameter directly."""
        params = [self.reducer.params[i] for i in bucket.params]
        lo, hi = self.k * bucket.shard, (self.k + 1) * bucket.shard
        make = torch.empty if self.frees else torch.zeros
        flat = make(bucket.padded, dtype=bucket.dtype, device=bucket.device)
        offsets = bucket.offsets
        views = [flat[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets, strict=True)]
        if not self.frees:
            for p, view in zip(params, views, strict=True):
                view.copy_(p.detach())
                p.data = view
            own = flat[lo:hi]
            return flat, nn.Parameter(own.detach().clone() if self.separate else own)
        free_storage(flat)
        own = torch.zeros(bucket.shard, dtype=bucket.dtype, device=bucket.device)
        for p, o, view in zip(params, offsets, views, strict=True):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                own[a - lo : b - lo] = p.detach().reshape(-1)[a - o : b - o]
            p.data = view
        return flat, nn.Parameter(own)

    def _gather_exact(self, entry) -> None:
        """One old bucket's float32 shards, uncompressed, into its flat
        parameters (``build(from_shards=True)``: the masters move as they
        are, whatever the gathers send)."""
        bucket, flat, shard = entry
        restore_storage(flat)
        all_gather_single(flat, shard.detach(), self.group)

    def tensors(self) -> list[torch.Tensor]:
        """What the optimizer steps (``build``'s list)."""
        return [shard for _, _, shard in self.entries] + self.replicated

    def all_gather(self) -> None:
        """Every rank's updated shards into every rank's parameters (sent
        as ``param_compression`` says, and decoded)."""
        self.updated()
        for finish in [self.gather(entry) for entry in self.entries]:
            finish()

    def updated(self) -> None:
        """The optimizer stepped: the shards' wire forms are stale."""
        self._encoded = {}

    def gather(self, entry, group=None):
        """Starts gathering one bucket's shards into its flat parameters
        (over ``group``, by default the reducer's); returns what completes
        it (waits, and decodes what came compressed)."""
        bucket, flat, shard = entry
        group = group if group is not None else self.group
        if self.codec is None:
            src = shard.detach()
            if not self.separate:  # the shard is a slice of `flat`: no aliasing
                src = src.clone()
            work = all_gather_single(flat, src, group, async_op=True)
            return work.wait
        parts = self._encoded.get(bucket.index)
        if parts is None:
            parts = self._encoded[bucket.index] = self._encode(shard.detach())
        wholes = [p.new_empty(self.n * p.numel()) for p in parts]
        works = [
            all_gather_single(w, p, group, async_op=True)
            for w, p in zip(wholes, parts, strict=True)
        ]

        def finish():
            for w in works:
                w.wait()
            flat.copy_(self._decode(wholes, bucket.shard))

        return finish

    def param_bytes(self) -> int:
        """The bytes of parameters this rank holds now: the flat buffers
        (ZeRO-3: those gathered), the shards kept apart and the replicated
        parameters."""
        replicated = sum(p.numel() * p.element_size() for p in self.replicated)
        return self._bytes(self.entries) + replicated

    def _bytes(self, entries) -> int:
        held = sum(flat.untyped_storage().nbytes() for _, flat, _ in entries)
        if self.separate:
            held += sum(s.untyped_storage().nbytes() for _, _, s in entries)
        return held

    def reset_peak(self) -> None:
        self.peak_bytes = self.param_bytes()

    def note_peak(self, besides: int = 0) -> None:
        """Notes what is held now (and ``besides``: an old bucket layout's
        buffers not freed yet) for ``peak_bytes``."""
        self.peak_bytes = max(self.peak_bytes, self.param_bytes() + besides)

    def _encode(self, master: torch.Tensor) -> list[torch.Tensor]:
        if self.codec in _WIRES:
            return [master.to(_WIRES[self.codec])]
        padded = master.new_zeros(-(-master.numel() // _BLOCK) * _BLOCK)
        padded[: master.numel()] = master
        return list(quantize(padded, 8, _BLOCK))

    def _decode(self, wholes: list[torch.Tensor], shard: int) -> torch.Tensor:
        """Every rank's shard, decoded, back to back (the flat buffer's order)."""
        if self.codec in _WIRES:
            return wholes[0].float()
        rows = dequantize(wholes[0], wholes[1], 8, _BLOCK).view(self.n, -1)
        return rows[:, :shard].reshape(-1)

    def owned(self, skip: set[int]) -> list[tuple[torch.Tensor, int]]:
        """This rank's gradients in the squared gradient norm, each with the
        times it counts, so that the trainer's sum over every rank divided
        by dp is the whole norm: a shard dp times (each rank holds a
        different one), a replicated gradient once per replica. ``skip``:
        ids of replicated parameters another pipeline rank counts."""
        out = [(shard.grad, self.n) for _, _, shard in self.entries]
        return out + [
            (p.grad, 1) for p in self.replicated if p.grad is not None and id(p) not in skip
        ]

    def full_state(self, optimizer, masters: bool = True) -> dict:
        """{parameter: {key: whole state tensor}} for every parameter of the
        reducer (collective over the group: every rank calls it); with
        ``param_compression`` and ``masters``, the float32 weights too."""
        out: dict = {p: dict(optimizer.state.get(p, {})) for p in self.replicated}
        r = self.reducer
        for bucket, _, shard in self.entries:
            state = dict(optimizer.state.get(shard, {}))
            if self.codec and masters:
                state[MASTER] = shard.detach()
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
            if MASTER in keys:
                keys.discard(MASTER)
                if self.codec:  # the float32 weights this rank's shard had
                    lo = self.k * bucket.shard
                    whole = shard.detach().new_zeros(bucket.padded)
                    for p, off in members:
                        if MASTER in state.get(p, {}):
                            whole[off : off + p.numel()] = state[p][MASTER].reshape(-1)
                    shard.data.copy_(whole[lo : lo + bucket.shard])
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
