"""Data parallelism with comm-compute overlap: gradients are averaged over the
group in buckets whose reduction starts while backward is still running.

    import clawcomm
    from clawcomm.parallel import DataParallel

    model = DataParallel(model)                  # broadcasts rank 0's parameters
    for x, y in loader:                          # each rank its own shard
        loss_fn(model(x), y).backward()          # returns with averaged gradients
        opt.step(); opt.zero_grad()

    torchrun --nproc-per-node 2 train.py         # (examples/data_parallel.py)

How a step goes:

1. Every parameter's gradient is a view of a flat bucket buffer
   (buckets.py). Buckets hold parameters in reverse registration order, the
   order backward usually produces them, up to ``bucket_cap_mb`` (the first
   up to ``first_bucket_mb``, so the first reduction starts early).
2. A post-accumulate-grad hook marks each gradient ready. When the next
   bucket in launch order has all its gradients, it is launched
   (reducer.py): a dense bucket as an asynchronous all-reduce straight from
   autograd's thread (the engine's progress thread does the work), a
   compressed one on the reduction thread (worker.py), while autograd
   computes the next layers' gradients. Buckets launch in index order on
   every rank, whatever order their gradients come in, so the ranks'
   collectives match.
3. A callback queued on the autograd engine runs when backward ends: it
   launches what is left and waits for every bucket, so ``backward()``
   returns with averaged gradients.
4. After the first step the buckets are rebuilt in the order gradients
   really became ready (rank 0's order, broadcast, so all ranks agree).

Gradient accumulation: inside ``no_sync()``, or on all but every
``accumulation_steps``-th forward, backward only accumulates into the
buckets; the next synchronised backward reduces the sum once. The reduced
gradient is the average over ranks of each rank's accumulated sum, as with
torch DDP: to get the mean over the effective batch (ranks x micro-batches),
divide each micro-batch's loss by the number of micro-batches.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from clawcomm.compression import Compressor, CompressorState, get_compressor
from clawcomm.parallel.buckets import FIRST_BUCKET_MB, GradBucket
from clawcomm.parallel.overlap_choice import OverlapChooser
from clawcomm.parallel.reducer import GradReducer

MB = 1 << 20


class DataParallel(nn.Module):
    """Wraps ``module`` for data-parallel training over ``process_group``.

    ``compression``: a spec ("fp16", "topk:0.01", ...) or a ``Compressor``;
    each bucket is averaged through it, with error-feedback residuals kept per
    bucket in ``compression_state`` (checkpoint it with its ``state_dict()``).
    The first ``compression_warmup_steps`` synchronised steps are reduced
    densely, as Deep Gradient Compression warms up.
    ``overlap``: ``"auto"`` (the default) times both ways in the first
    steps and keeps the faster (overlap_choice.py; ``overlap_choice`` reports
    it), ``True`` reduces buckets during backward, ``False`` after it (the
    baseline overlap is measured against). ``find_unused_parameters`` lets a
    forward leave parameters out: their buckets are reduced with zeros from
    this rank, and a parameter no rank used keeps ``grad`` as it was.
    ``broadcast_buffers`` copies rank 0's buffers (batch-norm statistics) to
    every rank before each forward.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = FIRST_BUCKET_MB,
        compression: str | Compressor | None = None,
        overlap: bool | str = "auto",
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        accumulation_steps: int = 1,
        compression_warmup_steps: int = 0,
    ):
        super().__init__()
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"DataParallel: {name} must be a positive number, got {value!r}")
        steps = accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"DataParallel: accumulation_steps must be an int >= 1, got {steps!r}")
        self.module = module
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        if overlap not in (True, False, "auto"):
            raise ValueError(
                f"DataParallel: overlap must be True, False or 'auto', got {overlap!r}"
            )
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.accumulation_steps = accumulation_steps
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DataParallel: the module has no parameters that require gradients")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        warmup = compression_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(
                f"DataParallel: compression_warmup_steps must be an int >= 0, got {warmup!r}"
            )
        self.compression_warmup_steps = warmup
        self.compressor = None if compression is None else get_compressor(compression)
        if self.compressor is not None:
            for n, p in named:
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"DataParallel: compression {self.compressor.spec!r} needs float32 "
                        f"gradients, parameter {n!r} is {p.dtype}"
                    )
        _check_same_parameters(module, process_group, self.rank)
        _broadcast(list(module.parameters()) + list(module.buffers()), self._root, process_group)

        self._reducer = GradReducer(
            self._params,
            process_group,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            compressor=self.compressor,
            compression_warmup_steps=warmup,
            overlap=overlap is not False,
            names=self._names,
        )
        auto = overlap == "auto" and self.world_size > 1
        self._chooser = OverlapChooser(process_group, self.rank) if auto else None
        weakref.finalize(self, self._reducer.close)
        self._hooks = [
            p.register_post_accumulate_grad_hook(_ready_hook(weakref.ref(self), i))
            for i, p in enumerate(self._params)
        ]
        self._no_sync = False
        self._micro_step = 0
        self._sync = True  # decided by each forward
        self._reset_step()

    # ---- the public surface -------------------------------------------------

    @property
    def buckets(self) -> list[GradBucket]:
        """The gradient buckets, in launch order."""
        return list(self._reducer.buckets)

    @property
    def overlap_choice(self) -> dict | None:
        """Under ``overlap="auto"``, once decided: ``{"overlap": bool,
        "during_backward_ms", "after_backward_ms", "trial_steps"}`` (the
        slowest rank's median backward-and-reduction time each way)."""
        return self._chooser.choice if self._chooser is not None else None

    @property
    def compression_state(self) -> CompressorState:
        """Error-feedback residuals (per bucket) and the step count;
        checkpoint it with its ``state_dict()``."""
        return self._reducer.compression_state

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self._no_sync:
            self._micro_step += 1
        self._sync = not self._no_sync and self._micro_step % self.accumulation_steps == 0
        if torch.is_grad_enabled():
            self._reducer.release_dropped()
        if self.broadcast_buffers and self.world_size > 1:
            _broadcast(list(self.module.buffers()), self._root, self.process_group)
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._sync and self.find_unused_parameters:
            self._unreached = self._unreached_params(out)
        chooser = self._chooser
        if torch.is_grad_enabled() and self._sync and chooser is not None:
            if self._reducer.learned and not chooser.decided:
                self._reducer.set_overlap(chooser.begin())
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one
        after it reduces the accumulated sum."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    # ---- buckets ------------------------------------------------------------

    def _rebuild(self) -> None:
        """Lays buckets out in the order gradients became ready in the first
        step (the reducer's rule: rank 0's order, so every rank launches the
        same buckets)."""
        self._reducer.learn()

    # ---- one step -----------------------------------------------------------

    def _reset_step(self) -> None:
        self._ready = [False] * len(self._params)
        self._has_grad = [False] * len(self._params)
        self._in_backward = False
        self._unreached: list[int] = []
        self._reducer.reset()

    def _grad_ready(self, i: int) -> None:
        if not self._sync:
            return  # accumulating: the gradient stays in its (local) bucket
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            for j in self._unreached:  # known before backward reached them
                self._mark_ready(j, used=False)
        if self._ready[i]:
            raise RuntimeError(
                f"DataParallel: parameter {self._names[i]!r} received a gradient twice in one "
                "synchronised backward; run the other backward passes under no_sync()"
            )
        self._mark_ready(i, used=True)

    def _mark_ready(self, i: int, used: bool) -> None:
        self._has_grad[i] = self._reducer.take_grad(i)
        self._ready[i] = True
        self._reducer.mark(i)

    def _end_of_backward(self) -> None:
        try:
            self._finish_step()
        finally:
            self._reset_step()

    def _finish_step(self) -> None:
        missing = [i for i, r in enumerate(self._ready) if not r]
        if missing and not self.find_unused_parameters:
            self._reducer.launch_all()
            self._reducer.wait()
            names = ", ".join(repr(self._names[i]) for i in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise RuntimeError(
                f"DataParallel: parameters {names}{more} received no gradient in this backward; "
                "pass find_unused_parameters=True when the forward does not use every parameter"
            )
        for i in missing:
            self._mark_ready(i, used=False)
        self._reducer.launch_all()  # without overlap: every bucket, here, in order
        used = None
        if self.find_unused_parameters:
            used = torch.tensor(self._has_grad, dtype=torch.int32)
            self._reducer.submit(
                lambda async_op: dist.all_reduce(used, group=self.process_group, async_op=async_op)
            )
        self._reducer.wait()
        for i, p in enumerate(self._params):
            bucket, s = self._reducer.slot[i]
            if used is not None and not used[i]:
                p.grad = None  # no rank used it: as if it were not in the model
            elif p.grad is None or p.grad.data_ptr() != bucket.views[s].data_ptr():
                p.grad = bucket.views[s]  # others used it: the average is its gradient
        if not self._reducer.learned:
            self._rebuild()
        self._reducer.end_step()
        if self._chooser is not None and not self._chooser.decided:
            decided = self._chooser.end()
            if decided is not None:
                self._reducer.set_overlap(decided)

    def _unreached_params(self, out) -> list[int]:
        """Parameters the autograd graph of ``out`` does not reach: their
        buckets need not wait for them."""
        index = {id(p): i for i, p in enumerate(self._params)}
        reached: set[int] = set()
        seen: set = set()
        stack = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None and id(var) in index:
                reached.add(index[id(var)])
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        return [i for i in range(len(self._params)) if i not in reached]


def _ready_hook(owner: weakref.ref, i: int):
    def hook(_param):
        dp = owner()
        if dp is not None:
            dp._grad_ready(i)

    return hook


def _check_same_parameters(module: nn.Module, group, rank: int) -> None:
    """Every rank must wrap the same parameters (names, shapes, dtypes)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    params = list(module.named_parameters())
    layout = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in params)
    mine = torch.tensor(
        [len(params), sum(p.numel() for _, p in params), zlib.crc32(layout.encode())],
        dtype=torch.int64,
    )
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if not torch.equal(theirs, mine):
            raise ValueError(
                f"DataParallel: the module's parameters differ across ranks: rank {r} has "
                f"{int(theirs[0])} parameters ({int(theirs[1])} elements), rank {rank} has "
                f"{int(mine[0])} ({int(mine[1])} elements)"
                + (
                    ""
                    if theirs[:2].tolist() != mine[:2].tolist()
                    else " with other names or shapes"
                )
                + "; every rank must wrap the same model"
            )


def _broadcast(tensors: list[torch.Tensor], root: int, group) -> None:
    """Copies rank ``root``'s values into ``tensors`` on every rank, one
    collective per dtype."""
    if dist.get_world_size(group) == 1:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, root, group=group)
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
