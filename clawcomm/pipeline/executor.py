"""One executor for any action list: the rank's stages, its actions, and
clawcomm's point-to-point operations between them.

    ex = PipelineExecutor(stages={1: stage1}, actions=schedule[rank], ...)
    stats = ex.run(inputs=None, targets=micro_targets, loss_scale=1 / count)

How it runs a rank's list:

- F: the stage's forward on the micro-batch's input (the data on stage 0,
  a received or handed-over activation elsewhere, marked to require a
  gradient). The last stage applies the loss, which sums over the
  micro-batch; the executor multiplies it by ``loss_scale``.
- B: ``torch.autograd.backward`` from the stage's output with the received
  gradient (from the scaled loss on the last stage). I is the same inside
  ``deferring`` (weight_grad.py): the input gradient now, the linear layers'
  weight gradients stored; W runs them.
- SEND_F / SEND_B: ``isend`` of the activation / input gradient, not waited
  for: the transfer runs while the rank computes; every send is waited for
  at the end of the step, before its tensor can be freed.
- RECV_F / RECV_B: ``irecv`` into a fresh buffer. Each receive is posted one
  compute action before its own place in the list (so the bytes land in it
  while the rank still has work), and waited for by the action that
  consumes it. Shapes travel once: before the first activation of each
  stage, a small header (dtype and shape) goes ahead of it; gradients have
  the shape of the activation they belong to.
- Stages on the same rank (pp == 1) hand tensors over without messages.

Messages are tagged by (kind, stage, micro-batch), so a message can never be
taken for another. Each compute action is timed (the trainer turns the
times into the measured bubble and compares it with ``clock.timing``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from clawcomm.pipeline.actions import (
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    W,
)
from clawcomm.pipeline.schedules import stage_to_rank
from clawcomm.pipeline.weight_grad import WeightGradStore, deferring

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 16  # int64s: dtype code, ndim, up to 14 dims
_ACT, _GRAD, _HEAD = 0, 1, 2


@dataclass
class RunStats:
    """One ``run``: per compute action (action, start, end) in seconds on
    this rank's clock, the time spent waiting for received tensors, and the
    loss of each micro-batch (last stage only; unscaled sums)."""

    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    # Each wait for a peer: (what, start, end): a received tensor, or the
    # sends still in flight at the end of the run.
    waits: list[tuple[str, float, float]] = field(default_factory=list)
    recv_wait: float = 0.0
    # Host time between compute actions that was neither compute nor a
    # wait for a peer's tensor: posting sends and receives, bookkeeping.
    host: float = 0.0
    losses: list[torch.Tensor] = field(default_factory=list)
    # Each send and receive between ranks: (action, bytes, when issued or
    # waited for); what a Chakra trace of the step needs (train/chakra.py).
    messages: list[tuple[Action, int, float]] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def busy(self) -> float:
        return sum(t1 - t0 for _, t0, t1 in self.timeline)


class PipelineExecutor:
    """Runs ``actions`` (this rank's list) over ``group`` (the pipeline's
    process group; this rank is ``pp_rank`` in it).

    ``stages``: stage index -> module, for the stages on this rank.
    ``loss_fn(output, target)``: the sum of the loss over the micro-batch.
    ``device``: where this rank's stages are (receive buffers are made there).
    ``run``'s ``tracker`` (the trainer's GradReducer), if given, is told
    when each compute action begins and ends (``begin_action(a)``,
    ``end_action(a)``): that is all the executor knows of gradients; which
    actions make a gradient final is the reducer's rule.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        actions: list[Action],
        num_stages: int,
        microbatches: int,
        pp_rank: int,
        pp: int,
        group=None,
        loss_fn: Callable | None = None,
        device: torch.device | str = "cpu",
    ):
        self.stages = stages
        self.actions = actions
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.pp_rank = pp_rank
        self.pp = pp
        self.group = group
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        # The group's own send/recv (ranks within the group): the same
        # operations as dist.isend/irecv without their Python checks, which
        # cost about as much as the transfer of a small activation.
        self._pg = group if group is not None else (dist.group.WORLD if pp > 1 else None)
        self._in_meta: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}  # stage -> input
        self._sent_header: set[int] = set()
        self._head_recv: dict[int, tuple] = {}  # stage -> (work, header) in flight
        # A list without backward actions (an evaluation's) keeps no
        # activations for them.
        self._backward_follows = any(a.kind in (B, I) for a in actions)
        # Before compute action k, post the receives listed here (the ones
        # that sit between k and the next compute action).
        self._prefetch: dict[int, list[int]] = {}
        last_compute = None
        for k, a in enumerate(actions):
            if a.kind in (RECV_F, RECV_B) and last_compute is not None:
                self._prefetch.setdefault(last_compute, []).append(k)
            if a.is_compute:
                last_compute = k

    # ---- one pass over the list ---------------------------------------------------

    def run(
        self,
        inputs: list[torch.Tensor] | None = None,
        targets: list | None = None,
        loss_scale: float = 1.0,
        tracker=None,
    ) -> RunStats:
        """Runs the list once over ``microbatches`` micro-batches: ``inputs``
        on the rank that holds stage 0, ``targets`` on the one that holds the
        last stage; ``tracker`` hears each compute action begin and end."""
        self._inputs_data, self._targets = inputs, targets
        self._scale = loss_scale
        self._x: dict = {}  # (stage, mb) -> the stage's input
        self._out: dict = {}  # (stage, mb) -> its output (scaled loss on the last stage)
        self._gin: dict = {}  # (stage, mb) -> gradient of its input, to send
        self._handoff_act: dict = {}  # (stage, mb) -> activation from a stage on this rank
        self._handoff_grad: dict = {}  # (stage, mb) -> gradient from a stage on this rank
        self._recv: dict = {}  # (kind, stage, mb) -> (work, buffer) posted
        self._sends: list = []
        self._stores: dict = {}
        stats = RunStats(start=time.perf_counter())
        self._stats = stats
        self._last_end = stats.start
        for k, a in enumerate(self.actions):
            for j in self._prefetch.get(k, ()):
                self._post_recv(self.actions[j], early=True)
            if a.is_compute:
                self._compute(a, tracker)
            elif a.kind in (RECV_F, RECV_B):
                self._post_recv(a, early=False)
            elif a.kind == SEND_F:
                self._send_activation(a)
            elif a.kind == SEND_B:
                grad = self._gin.pop((a.stage, a.microbatch))
                self._send(grad, a.stage - 1, self._tag(_GRAD, a.stage, a.microbatch))
                stats.messages.append((a, grad.numel() * grad.element_size(), time.perf_counter()))
            elif a.kind == REDUCE_GRAD:
                pass  # the trainer starts each reduction itself (see GradReducer)
        drain = time.perf_counter()
        for work in self._sends:
            work.wait()
        self._sends = []
        stats.end = time.perf_counter()
        if stats.end - drain > 20e-6:
            stats.waits.append(("sends in flight", drain, stats.end))
        if not self._backward_follows:
            self._x.clear()
            self._out.clear()
        leftover = [k for k in (self._x, self._out, self._gin, self._recv) if k]
        if leftover:
            raise RuntimeError(
                f"pipeline executor: rank {self.pp_rank} finished its list with tensors "
                f"left over: {leftover}"
            )
        return stats

    # ---- compute -----------------------------------------------------------------

    def _compute(self, a: Action, tracker) -> None:
        s, mb = a.stage, a.microbatch
        waited = self._stats.recv_wait
        grad = None
        if a.kind == F:
            x = self._input_of(s, mb)
        elif a.kind in (B, I):
            grad = None if s == self.num_stages - 1 else self._grad_of(s, mb)
        t0 = time.perf_counter()
        self._stats.host += (t0 - self._last_end) - (self._stats.recv_wait - waited)
        if tracker is not None:
            tracker.begin_action(a)
        try:
            if a.kind == F:
                self._forward(s, mb, x)
            else:
                self._backward_pass(a, grad)
        finally:
            if tracker is not None:
                tracker.end_action(a)
        if self.device.type == "cuda":  # the action's time on the GPU, not its queueing
            torch.cuda.current_stream(self.device).synchronize()
        self._last_end = time.perf_counter()
        self._stats.timeline.append((a, t0, self._last_end))

    def _backward_pass(self, a: Action, grad) -> None:
        if a.kind == W:
            self._stores.pop((a.stage, a.microbatch)).run()
        else:
            self._backward(a.stage, a.microbatch, grad, split=a.kind == I)

    def _forward(self, s: int, mb: int, x: torch.Tensor) -> None:
        out = self.stages[s](x)
        if s == self.num_stages - 1:
            target = self._targets[mb]
            loss = self.loss_fn(out, target)
            self._stats.losses.append(loss.detach())
            out = loss * self._scale
        elif stage_to_rank(s + 1, self.pp) == self.pp_rank:
            self._handoff_act[(s + 1, mb)] = out.detach()
        self._x[(s, mb)] = x
        self._out[(s, mb)] = out

    def _backward(self, s: int, mb: int, grad, split: bool) -> None:
        out = self._out.pop((s, mb))
        x = self._x.pop((s, mb))
        if split:
            store = WeightGradStore()
            with deferring(store):
                torch.autograd.backward(out, grad)
            self._stores[(s, mb)] = store
        else:
            torch.autograd.backward(out, grad)
        if s > 0:
            if stage_to_rank(s - 1, self.pp) == self.pp_rank:
                self._handoff_grad[(s - 1, mb)] = x.grad
            else:
                self._gin[(s, mb)] = x.grad

    def _input_of(self, s: int, mb: int) -> torch.Tensor:
        if s == 0:
            return self._inputs_data[mb]
        if stage_to_rank(s - 1, self.pp) == self.pp_rank:
            return self._handoff_act.pop((s, mb)).requires_grad_()
        return self._wait_recv(RECV_F, s, mb).requires_grad_()

    def _grad_of(self, s: int, mb: int) -> torch.Tensor:
        if stage_to_rank(s + 1, self.pp) == self.pp_rank:
            return self._handoff_grad.pop((s, mb))
        return self._wait_recv(RECV_B, s, mb)

    # ---- point to point --------------------------------------------------------------

    def _tag(self, kind: int, stage: int, mb: int) -> int:
        return 1 + kind + 3 * (mb + self.microbatches * stage)

    def _send_activation(self, a: Action) -> None:
        t = self._out[(a.stage, a.microbatch)].detach()
        if a.stage not in self._sent_header:
            self._sent_header.add(a.stage)
            if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
                raise ValueError(
                    f"pipeline: stage {a.stage} outputs a {t.dtype} tensor of shape "
                    f"{tuple(t.shape)}; stages may pass one tensor of up to {_HEADER - 2} "
                    f"dimensions, of dtype {', '.join(map(str, _DTYPES))}"
                )
            head = torch.zeros(_HEADER, dtype=torch.int64)
            head[0], head[1] = _DTYPES.index(t.dtype), t.dim()
            head[2 : 2 + t.dim()] = torch.tensor(t.shape)
            self._send(head, a.stage + 1, self._tag(_HEAD, a.stage + 1, 0))
        self._send(t, a.stage + 1, self._tag(_ACT, a.stage + 1, a.microbatch))
        self._stats.messages.append((a, t.numel() * t.element_size(), time.perf_counter()))

    def _send(self, t: torch.Tensor, to_stage: int, tag: int) -> None:
        t = t.contiguous()
        self._sends.append(self._pg.send([t], stage_to_rank(to_stage, self.pp), tag))

    def _post_recv(self, a: Action, early: bool) -> None:
        key = (a.kind, a.stage, a.microbatch)
        if key in self._recv:
            return  # posted already
        s, mb = a.stage, a.microbatch
        if a.kind == RECV_F:
            src, tag_stage, kind = s - 1, s, _ACT
            meta = self._in_meta.get(s)
            if meta is None:  # the stage's first activation: its header comes first
                if s not in self._head_recv:
                    head = torch.zeros(_HEADER, dtype=torch.int64)
                    tag = self._tag(_HEAD, s, 0)
                    work = self._pg.recv([head], stage_to_rank(src, self.pp), tag)
                    self._head_recv[s] = (work, head)
                return
        else:
            src, tag_stage, kind = s + 1, s + 1, _GRAD
            out = self._out.get((s, mb))
            if out is None:  # its forward has not run yet: post it later
                if not early:
                    raise RuntimeError(f"pipeline: {a} posted before the forward it belongs to")
                return
            meta = (out.dtype, tuple(out.shape))
        buf = torch.empty(meta[1], dtype=meta[0], device=self.device)
        tag = self._tag(kind, tag_stage, mb)
        self._recv[key] = (self._pg.recv([buf], stage_to_rank(src, self.pp), tag), buf)

    def _wait_recv(self, kind: str, s: int, mb: int) -> torch.Tensor:
        key = (kind, s, mb)
        t0 = time.perf_counter()
        if key not in self._recv:
            if kind == RECV_F and s not in self._in_meta:
                work, head = self._head_recv.pop(s)
                work.wait()
                ndim = int(head[1])
                self._in_meta[s] = (_DTYPES[int(head[0])], tuple(head[2 : 2 + ndim].tolist()))
            self._post_recv(Action(s, kind, mb), early=False)
        work, buf = self._recv.pop(key)
        work.wait()
        t1 = time.perf_counter()
        self._stats.recv_wait += t1 - t0
        what = "activation" if kind == RECV_F else "gradient"
        self._stats.waits.append((f"recv {what} s{s} mb{mb}", t0, t1))
        self._stats.messages.append((Action(s, kind, mb), buf.numel() * buf.element_size(), t1))
        return buf
