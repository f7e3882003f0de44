"""Averaging gradient buckets over a group while backward runs: the part of
data parallelism that DataParallel and the pipeline trainer share.

A ``GradReducer`` owns the buckets of a list of parameters. Its user says
when a parameter's gradient is final for the step (``ready``); when the next
bucket in launch order has all its gradients, it is launched, so the ranks'
collectives match whatever order their gradients come in. ``wait`` returns
when every bucket is averaged.

How a bucket is averaged:

- dense: ``dist.all_reduce(flat, AVG, async_op=True)`` straight from the
  thread that marks it ready (autograd's); the engine's progress thread does
  the work, so nothing waits on a Python thread hand-off. gloo has no AVG:
  there it is a SUM, divided after the wait.
- compressed: the compressor's ``all_reduce_mean`` is several collectives
  and some Python, so with overlap it runs on a ``ReductionThread`` (which
  waits with the GIL released) in launch order; without, on the caller's
  thread. Its error-feedback residuals are kept per bucket in
  ``compression_state``.

Sharded buckets (``zero=1``, ZeRO-1): each bucket's flat buffer is
padded to a multiple of the group's size, and once the order is learned
each bucket is reduce-scattered (AVG) into ``bucket.shard_grad``, this
rank's part: ``clawcomm.parallel.zero.ZeroShards`` steps the optimizer on
those parts and all-gathers the parameters. The first step, which learns
the order, launches nothing before ``finish``: there it learns first and
then reduce-scatters over the bucket layout it learned, as later steps do
(at ZeRO-2 and 3 one bucket at a time, each full buffer and part made as
it launches, from the gradients as they are: the whole gradient is held
once, as at ZeRO-0).
``zero=2`` (ZeRO-2; and 3, whose parameters ``clawcomm.parallel.zero3``
handles) keeps gradients as those parts only, but while a
pipeline round's backward runs: the full buffers come at its first backward
action and go once reduce-scattered (``finish``; with several accumulation
rounds, each round's are reduce-scattered and added into the parts when the
next round begins, ``begin_round``). Inside a round a gradient gets
contributions from every micro-batch, so its full buffer lives until the
round's last backward (as torchtitan's FSDP under PP keeps it; DeepSpeed
refuses ZeRO-2 with PP).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from clawcomm._torch_names import reduce_scatter_single
from clawcomm.compression import Compressor, CompressorState
from clawcomm.parallel.buckets import FIRST_BUCKET_MB, BucketBuffers, GradBucket, assign_buckets
from clawcomm.parallel.worker import ReductionThread

MB = 1 << 20


class GradReducer(BucketBuffers):
    """Buckets over ``params`` (gradients become views of them), averaged
    over ``group``.

    ``expected[i]``: how many times parameter i is marked ready in a step
    (1 by default; learned in the first step under ``track_final_grads``,
    and 0 means never). ``overlap=False`` launches nothing before
    ``launch_all``. ``names``: the parameters' names, for errors.

    When a gradient is final is the reducer's rule alone (see "readiness"
    below): its user marks gradients (``mark``) or, in a pipeline, says
    which action runs (``begin_action``/``end_action``); the reducer learns
    in the first step the order (and, under ``track_final_grads``, the
    number) of the marks, lays its buckets out in rank 0's order, and from
    the second step launches each bucket as its last mark arrives. Its
    ``state_dict`` carries what it learned into checkpoints.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        group=None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = FIRST_BUCKET_MB,
        compressor: Compressor | None = None,
        compression_warmup_steps: int = 0,
        overlap: bool = True,
        order: list[int] | None = None,
        names: list[str] | None = None,
        zero: int = 0,
        replicated: set[int] | None = None,
        units: list[int] | None = None,
    ):
        if zero and compressor is not None:
            if not compressor.reduces_scatter:
                raise ValueError(
                    f"GradReducer: zero (sharded gradients) needs a compressor with a "
                    f"reduce-scatter; {compressor.spec!r} has none"
                )
        self.params = params
        # ZeRO-1/2 (see "sharded buckets" above): every parameter but those
        # in `replicated` sits in a bucket sharded over the group.
        self.zero = int(zero)  # the ZeRO stage
        self._fresh_shards = True  # this step's first reduce-scatter overwrites the parts
        self._final_round = True  # see begin_round
        self.peak_grad_bytes = 0  # the most gradient bytes held during the last step
        self._peak = 0  # (ZeRO-3: noted as each bucket's buffer is made)
        self._in_flight: list = []  # ZeRO-3: (done(), full buffer) being reduce-scattered
        self.replicated = set(replicated or ())
        # ZeRO-3: the layer (unit) each parameter belongs to; a bucket never
        # spans two, so that a layer's parameters are gathered and freed alone.
        self.units = units
        self.buckets_version = 0
        self.names = names or [str(i) for i in range(len(params))]
        self.group = group
        self.cap_bytes = int(bucket_cap_mb * MB)
        self.first_cap_bytes = int(first_bucket_mb * MB)
        self.compressor = compressor
        self.compression_state = CompressorState()
        self.compression_warmup_steps = compression_warmup_steps
        self.overlap = overlap
        self.world_size = dist.get_world_size(group)
        self._average_op = dist.get_backend(group) == "clawcomm"  # gloo has no AVG
        # A thread only for compressed buckets launched during backward.
        self._thread = ReductionThread() if compressor is not None and overlap else None
        self._works: list = []  # (work, bucket or None) launched this step
        self._to_release: list[GradBucket] = []  # see release_dropped
        self.expected = [1] * len(params)
        # Readiness: what the first step teaches (see track_final_grads).
        self.learned = False
        self.final_actions: frozenset = frozenset()
        self.armed = False  # the action running now gives final contributions
        self._counting = False  # learning `expected` by counting the first step's marks
        self._overlap_after = overlap
        self._marks = [0] * len(params)
        self._first_order: list[int] = []
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooks: list = []
        self.build(order if order is not None else list(reversed(range(len(params)))))
        self.reset()

    # ---- bucket layout --------------------------------------------------------

    def sharded(self, i: int) -> bool:
        """Whether parameter i's gradient and optimizer state are sharded."""
        return self.zero >= 1 and i not in self.replicated

    def _kind(self, i: int):
        """What a bucket holds one of: sharded or not, and (ZeRO-3) the unit."""
        if not self.sharded(i):
            return None
        return self.units[i] if self.units is not None else True

    def build(self, order: list[int]) -> None:
        groups = assign_buckets(
            order, self.params, self.cap_bytes, self.first_cap_bytes, kind=self._kind
        )
        n = self.world_size
        # ZeRO-2 and 3, once learned: a sharded bucket's full buffer is made
        # when it is needed (ZeRO-2: the round's first backward action;
        # ZeRO-3: its launch), from the gradients as they are then.
        later = self.learned and self.zero >= 2
        self.buckets = []
        for b, idx in enumerate(groups):
            sharded, tensors = self.sharded(idx[0]), [self.params[i] for i in idx]
            bucket = GradBucket(b, idx, tensors, n if sharded else 0, not (later and sharded))
            self.buckets.append(bucket)
        for bucket in self.buckets:
            if bucket.shards and not later:  # (else made as it launches: see finish)
                bucket.part()
            # What lies in each bucket, for compressors that work per matrix (PowerSGD).
            self.compression_state.shapes[bucket.index] = list(bucket.shapes)
        self.buckets_version += 1
        self.slot: dict[int, tuple[GradBucket, int]] = {}
        for bucket in self.buckets:
            for s, i in enumerate(bucket.params):
                self.slot[i] = (bucket, s)

    def rebuild(self, order: list[int]) -> None:
        """Lays the buckets out in ``order`` (the same on every rank), moving
        gradients and error-feedback residuals with their parameters."""
        if order == [i for b in self.buckets for i in b.params]:
            return
        old_slot = self.slot
        kinds = self.compression_state.per_element()
        old = {kind: dict(buffers) for kind, buffers in kinds.items()}
        for buffers in kinds.values():
            buffers.clear()
        self.compression_state.memory.clear()  # laid out by bucket: starts afresh
        self.build(order)
        for i, p in enumerate(self.params):
            old_bucket, s = old_slot[i]
            bucket, t = self.slot[i]
            if bucket.flat is not None:  # (else made from p.grad when needed: ZeRO-2, 3)
                if old_bucket.views[s] is not None:  # not released (ZeRO-2)
                    bucket.views[t].copy_(old_bucket.views[s])
                if p.grad is not None:
                    p.grad = bucket.views[t]
            for kind, buffers in kinds.items():
                was = old[kind].get(old_bucket.index)
                if was is not None:
                    if bucket.index not in buffers:
                        buffers[bucket.index] = bucket.zeros()
                    bucket.segment(buffers[bucket.index], t).copy_(old_bucket.segment(was, s))
        for bucket in {id(b): b for b, _ in old_slot.values()}.values():
            bucket.free_part()
        self.reset()

    # ---- one step -------------------------------------------------------------

    def reset(self) -> None:
        """Ready for the next step's marks."""
        self._next_launch = 0
        self._marks = [0] * len(self.params)
        for bucket in self.buckets:
            bucket.pending = sum(self.expected[i] for i in bucket.params)

    def ready(self, i: int, count: int = 1) -> None:
        """Parameter i's gradient got ``count`` of its expected final marks."""
        bucket, _ = self.slot[i]
        bucket.pending -= count
        if self.overlap and (self.learned or not self.zero):  # (a sharded first step: finish)
            self._launch_in_order()

    def set_overlap(self, on: bool) -> None:
        """From the next step: launch buckets as they fill (True), or all of
        them in ``launch_all`` (False)."""
        self.overlap = self._overlap_after = on

    def launch_all(self) -> None:
        """Launches every bucket not launched yet, in order."""
        self._launch_in_order(everything=True)

    def submit(self, collective) -> None:
        """Runs ``collective(async_op)`` after the buckets launched so far, in
        the same order on every rank (the unused-parameter map uses this)."""
        if self._compressing():
            if self._thread is not None:
                self._thread.submit(lambda: collective(False))
            else:
                collective(False)
        else:
            self._works.append((collective(True), None, None))

    def wait(self) -> None:
        """Blocks until every launched bucket is averaged."""
        works, self._works = self._works, []
        error = None
        for work, summed, into in works:
            try:
                if work is not None:
                    work.wait()
                if summed is not None and not self._average_op:
                    summed.div_(self.world_size)
                if into is not None:  # a later round's part (ZeRO-2)
                    into.add_(summed)
            except BaseException as e:  # wait for the rest before raising
                error = error or e
        if self._thread is not None:
            self._thread.wait()
        if error is not None:
            raise error

    def end_step(self) -> None:
        if self.compressor is not None:
            self.compression_state.step += 1
        self._fresh_shards = True
        self.reset()

    # ---- ZeRO-2: gradients kept as shards between steps ---------------------------

    def begin_round(self, round_index: int, last: bool = True) -> None:
        """An accumulation round of the pipeline starts (``last``: the
        step's last, whose final gradients launch their buckets). ZeRO-2,
        once the bucket layout is learned: a later round first reduce-scatters the
        earlier rounds' contributions into the parts and lets the full
        buffers go; they come back, zeroed, at the round's first backward
        action (``begin_action``), so no full gradient is held while only
        forwards run. (Before the bucket layout is learned, the rounds add up in
        the full buffers, as at ZeRO-1.)"""
        self._final_round = last
        if self.zero < 2 or not self.learned or round_index == 0:
            return
        if self.zero == 2:
            self._allocate_full()  # (a rank that ran no backward: zeros)
        for b in self.buckets:  # the same buckets in the same order on every rank
            if b.shards:
                self._launch(b)
        self.wait()
        self._fresh_shards = False
        self._release_full(scratch=False)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- readiness: when a gradient is final -------------------------------------

    def track_final_grads(self, final_actions) -> None:
        """A pipeline's readiness: a gradient is final once it has had every
        contribution the ``final_actions`` (on this rank: the last backward
        actions of each stage) give it, which can be several (tied weights,
        W jobs). The first step counts them, launching nothing before
        ``finish``; later steps launch on that count. Contributions reach the
        reducer through autograd's post-accumulate hooks and ``notify_grad``
        while an armed action runs."""
        from clawcomm.pipeline.weight_grad import notify_grad

        self.final_actions = frozenset(final_actions)
        self._counting = True
        self._overlap_after, self.overlap = self.overlap, False
        self._hooks = [p.register_post_accumulate_grad_hook(notify_grad) for p in self.params]

    def begin_action(self, action, final_round: bool = True) -> None:
        """``action`` starts; in the last accumulation round an action in
        ``final_actions`` arms the reducer until ``end_action``."""
        from clawcomm.pipeline.weight_grad import set_listener

        if self.zero == 2 and self.learned and getattr(action, "kind", "F") != "F":
            self._allocate_full()  # ZeRO-2: the first backward action of the round
        self.armed = final_round and self._final_round and action in self.final_actions
        set_listener(self._mark_param if self.armed else None)

    def end_action(self, action) -> None:
        from clawcomm.pipeline.weight_grad import set_listener

        self.armed = False
        set_listener(None)

    def _mark_param(self, param: torch.Tensor) -> None:
        i = self._index.get(id(param))
        if i is not None:
            self.mark(i)

    def mark(self, i: int) -> None:
        """Parameter i's gradient received a final contribution."""
        self._marks[i] += 1
        if not self.learned and self._marks[i] == 1:
            self._first_order.append(i)
        if self._counting and not self.learned:
            return  # counted; launched by finish
        if self._marks[i] > self.expected[i]:
            raise RuntimeError(
                f"GradReducer: parameter {self.names[i]!r} received more final gradient "
                f"contributions ({self._marks[i]}) than in the first step ({self.expected[i]}): "
                "its stage's control flow changed; train with overlap=False"
            )
        self.ready(i)

    def all_final(self) -> None:
        """Every gradient became final at once (the deterministic trainer's
        micro-batch tree): one mark each, in parameter order."""
        for i in range(len(self.params)):
            self.mark(i)

    def finish(self) -> float:
        """Ends the step: launches what is left, waits for every bucket, and
        after the first step learns. Returns the seconds it waited."""
        t0 = time.perf_counter()
        if self.zero and not self.learned:
            # A sharded first step launched nothing (``ready``): learn first,
            # so that it reduce-scatters over the bucket layout it learned,
            # as later steps do. At ZeRO-2 and 3 each bucket's full buffer
            # and part are made as it launches, from the gradients as they
            # are, and the buffer goes before the next is made: the whole
            # gradient is held once, and no more.
            self.learn()
            while self.zero >= 2 and self._next_launch < len(self.buckets):
                bucket = self.buckets[self._next_launch]
                self._next_launch += 1
                self._launch(bucket)
                self.wait()
                if bucket.shards:
                    bucket.release()
        self.launch_all()
        self.wait()
        waited = time.perf_counter() - t0
        if not self.learned:
            self.learn()  # from this step's marks, before end_step clears them
        self.peak_grad_bytes = max(self._peak, self.grad_bytes())
        self._peak, self._in_flight = 0, []
        if self.zero >= 2:
            self._release_full()
        self.end_step()
        return waited

    def learn(self) -> None:
        """What the first step taught: the counts of final marks (under
        ``track_final_grads``) and the order gradients became final, rank
        0's, so that every rank lays out and launches the same buckets."""
        if self._counting:
            self.expected = list(self._marks)
        seen = set(self._first_order)
        order = self._first_order + [i for i in range(len(self.params)) if i not in seen]
        if self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64)
            dist.broadcast(t, dist.get_global_rank(self.group, 0) if self.group else 0, self.group)
            order = t.tolist()
        self.learned = True
        self.overlap = self._overlap_after
        self.rebuild(order)
        self.reset()

    def state_dict(self) -> dict:
        """What the reducer learned and its compression step (the residuals
        are the caller's to save, cut by parameter)."""
        return {
            "learned": self.learned,
            "expected": list(self.expected),
            "order": [i for b in self.buckets for i in b.params],
            "compression_step": self.compression_state.step,
            "calls": dict(self.compression_state.calls),
            # Small per-bucket tensors (PowerSGD's Q): valid at this bucket layout only.
            "memory": {k: v.cpu() for k, v in self.compression_state.memory.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state["learned"]:
            self.expected = list(state["expected"])
            self.learned = True
            self.overlap = self._overlap_after
            self.rebuild(state["order"])
            for b in self.buckets:  # (the shards take them as their gradients)
                if b.shards:
                    b.part()
        self.compression_state.step = int(state["compression_step"])
        self.compression_state.calls = dict(state["calls"])
        device = self.buckets[0].device if self.buckets else "cpu"
        self.compression_state.memory = {
            k: v.to(device) for k, v in state.get("memory", {}).items()
        }
        self.reset()

    # ---- launching -------------------------------------------------------------

    def _compressing(self) -> bool:
        return (
            self.compressor is not None
            and self.compression_state.step >= self.compression_warmup_steps
        )

    def _launch_in_order(self, everything: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0 and not everything:
                return
            self._next_launch += 1
            self._launch(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        sharded = bucket.shards and self.learned
        lazy = sharded and self.zero == 3  # the buffer let go once launched
        if bucket.shards and bucket.flat is None:  # made now (ZeRO-2, 3)
            self._collect(bucket)
        flat = bucket.flat
        into = None
        if sharded:  # into the part, or (a later round) added into it after
            out = bucket.part()
            if not self._fresh_shards:
                if bucket.scratch is None:
                    bucket.scratch = torch.empty_like(bucket.shard_grad)
                out, into = bucket.scratch, bucket.shard_grad
        if self._compressing():
            state, group, c = self.compression_state, self.group, self.compressor
            finished = threading.Event() if lazy else None
            if sharded:

                def job():
                    c.reduce_scatter_mean(flat, out, state, bucket.index, group)
                    if into is not None:
                        into.add_(out)
                    if finished is not None:
                        finished.set()
            else:
                job = lambda: c.all_reduce_mean(flat, state, bucket.index, group)
            if self._thread is not None:
                self._thread.submit(job)
            else:
                job()  # without overlap, on the caller's thread
            if lazy:
                self._hand_off(bucket, finished.is_set)
        elif sharded:
            op = dist.ReduceOp.AVG if self._average_op else dist.ReduceOp.SUM
            work = reduce_scatter_single(out, flat, op=op, group=self.group, async_op=True)
            self._works.append((work, out, into))
            if lazy:
                self._hand_off(bucket, work.is_completed)
        else:
            self._works.append((self._dense(bucket, async_op=True), bucket.flat, None))

    def _dense(self, bucket: GradBucket, async_op: bool):
        op = dist.ReduceOp.AVG if self._average_op else dist.ReduceOp.SUM
        work = dist.all_reduce(bucket.flat, op=op, group=self.group, async_op=async_op)
        if not async_op and not self._average_op:
            bucket.flat.div_(self.world_size)
        return work
