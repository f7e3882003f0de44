"""Communicating less often: ``--sync local-sgd:H`` and ``--sync diloco:H``.

With either, data-parallel replicas do not average gradients: each steps
its own inner optimizer on its own part of the batch, and every H steps the
replicas meet:

* ``diloco:H`` (Douillard et al., DiLoCo): the pseudo-gradient
  delta = anchor - theta (the parameters at the last meeting minus this
  replica's now) is averaged over the replicas, an outer SGD step with
  Nesterov momentum (``--outer-lr`` 0.7, ``--outer-momentum`` 0.9) moves the
  anchor by it, and every replica continues from the new anchor. Inner
  optimizer states stay each replica's own.
* ``local-sgd:H``: the same with outer learning rate 1 and no momentum,
  which is plain parameter averaging every H steps.

The average goes through ``--compression`` when one is given (``int8`` is
INTELLECT-1's recipe; any spec works), with its error feedback kept per
fragment. ``--fragments F`` (Streaming DiLoCo) cuts this rank's
parameters into F fragments of about equal size, in order; fragment f meets
every H steps, F staggered: one fragment every H/F steps, so each meeting
sends 1/F of the parameters.

``--sync-delay TAU`` overlaps each meeting with the next TAU inner steps
(Streaming DiLoCo): the pseudo-gradient is taken when the fragment is due,
its exchange runs on a thread of its own over a data-parallel group of its
own (so it never interleaves with the step's collectives), and TAU steps
later the outer step lands: the anchor moves by the averaged
pseudo-gradient, and the replica's fragment becomes
``mix * its own + (1 - mix) * the new anchor`` (``--sync-mix``, Streaming
DiLoCo's alpha; 0 takes the anchor, as torchft does). Exchanges still in
flight at the run's last step land then. A checkpoint waits for them and
keeps their averaged result, which a resumed run applies at the same step.

Each pipeline stage meets over its own data-parallel group with its own
parameters, so this works at any pp (torchft's DiLoCo allows one
data-parallel group per worker). ``state`` tensors (anchor, outer momentum,
the compressor's residuals) go into checkpoints, and a resumed run repeats
the uninterrupted one bit for bit.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from clawcomm.compression import CompressorState, get_compressor

_SYNC = re.compile(r"^(every-step|(local-sgd|diloco):([0-9]+))$")


def parse_sync(text: str) -> tuple[str, int]:
    """'every-step' -> ('every-step', 1); 'diloco:32' -> ('diloco', 32)."""
    m = _SYNC.match(text)
    if not m:
        raise ValueError(f"sync {text!r} is not every-step, local-sgd:H or diloco:H")
    if m.group(1) == "every-step":
        return "every-step", 1
    period = int(m.group(3))
    if period < 1:
        raise ValueError(f"sync {text!r}: H must be >= 1")
    return m.group(2), period


def check(cfg) -> None:
    """The settings that go with --sync (raises ValueError)."""
    mode, period = parse_sync(cfg.sync)
    if mode == "every-step":
        return
    if cfg.zero:
        raise ValueError(
            f"sync {cfg.sync!r} keeps a whole replica per data-parallel rank: it needs zero 0, "
            f"not zero {cfg.zero}"
        )
    if cfg.fragments < 1 or period % cfg.fragments:
        raise ValueError(
            f"fragments {cfg.fragments} must be >= 1 and divide sync {cfg.sync!r}'s H ({period})"
        )
    if not 0 <= cfg.sync_delay < period or not 0 <= cfg.sync_mix <= 1:
        raise ValueError(
            f"sync_delay must be in [0, H) (H {period}) and sync_mix in [0, 1], got "
            f"{cfg.sync_delay} and {cfg.sync_mix}"
        )
    if not cfg.outer_lr > 0 or not 0 <= cfg.outer_momentum < 1:
        raise ValueError(
            f"outer_lr must be > 0 and outer_momentum in [0, 1), got {cfg.outer_lr} and "
            f"{cfg.outer_momentum}"
        )


def _split(params: list[torch.Tensor], parts: int) -> list[list[int]]:
    """Indices of ``params`` in order, cut into ``parts`` runs of about
    equal numel (a parameter is never cut; trailing runs may be empty)."""
    total = sum(p.numel() for p in params)
    runs: list[list[int]] = [[] for _ in range(parts)]
    seen = 0
    for i, p in enumerate(params):
        runs[min(parts - 1, seen * parts // max(1, total))].append(i)
        seen += p.numel()
    return runs


def _result(entry):
    """A pending exchange's averaged delta, waiting for it if in flight."""
    return entry if isinstance(entry, torch.Tensor) else entry.result()


class OuterSync:
    """The meetings of one rank's parameters with their data-parallel
    replicas (module docstring). ``exchange_group``: the data-parallel group
    the delayed exchanges use (the same ranks as ``group``, made for this:
    required with ``cfg.sync_delay``)."""

    def __init__(self, params: list[torch.Tensor], group, cfg, exchange_group=None):
        self.mode, self.period = parse_sync(cfg.sync)
        local = self.mode == "local-sgd"
        self.lr = 1.0 if local else cfg.outer_lr
        self.mu = 0.0 if local else cfg.outer_momentum
        self.params, self.group = params, group
        self.fragments = _split(params, cfg.fragments)
        self.anchor = [p.detach().clone() for p in params]
        self.momentum = [torch.zeros_like(p) for p in params] if self.mu else None
        self.compressor = get_compressor(cfg.compression) if cfg.compression else None
        self.state = CompressorState()
        for f, run in enumerate(self.fragments):
            self.state.shapes[f] = [params[i].shape for i in run]
        self.meetings = 0
        self.delay, self.mix, self.last_step = cfg.sync_delay, cfg.sync_mix, cfg.steps
        self.pending: dict[int, list] = {}  # fragment -> [step it lands, Future or averaged delta]
        self._executor = None
        self._loading: dict[int, torch.Tensor] = {}
        if self.delay:
            if exchange_group is None:
                raise ValueError("OuterSync: sync_delay needs an exchange group of its own")
            self.group = exchange_group
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="clawcomm-outer")

    def due(self, step: int) -> list[int]:
        """Fragments that meet once ``step`` inner steps are done."""
        every = self.period // len(self.fragments)
        if step % every:
            return []
        f = (step // every - 1) % len(self.fragments)
        return [f] if self.fragments[f] else []

    def after_step(self, step: int) -> None:
        """The meetings due once ``step`` inner steps are done, and the
        delayed ones that land then (all of them at the run's last step)."""
        for f in self.due(step):
            if not self.delay:
                self.meet(f)
                continue
            lands = step if step >= self.last_step else step + self.delay
            self.pending[f] = [lands, self._executor.submit(self._average, f, self._delta(f))]
        for f, (at, _) in sorted(self.pending.items()):
            if at <= step or step >= self.last_step:  # waits for this exchange only
                self._apply(f, _result(self.pending.pop(f)[1]), self.mix)

    def close(self) -> None:
        if self._executor is not None:
            self.settle()
            self._executor.shutdown()

    def settle(self) -> None:
        """Waits for the exchanges in flight (their results stay pending)."""
        for entry in self.pending.values():
            entry[1] = _result(entry[1])

    @torch.no_grad()
    def meet(self, f: int) -> None:
        """Fragment ``f``'s meeting, now and synchronously."""
        self._apply(f, self._average(f, self._delta(f)), 0.0)

    def _delta(self, f: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat(
                [(self.anchor[i] - self.params[i]).reshape(-1) for i in self.fragments[f]]
            )

    def _average(self, f: int, delta: torch.Tensor) -> torch.Tensor:
        if self.compressor is not None:
            self.compressor.all_reduce_mean(delta, self.state, f, self.group)
        else:
            dist.all_reduce(delta, group=self.group)
            delta.div_(dist.get_world_size(self.group))
        return delta

    @torch.no_grad()
    def _apply(self, f: int, delta: torch.Tensor, mix: float) -> None:
        """The outer step on fragment ``f``'s anchor; its parameters become
        ``mix`` of their own plus the rest of the new anchor."""
        at = 0
        for i in self.fragments[f]:
            d = delta[at : at + self.params[i].numel()].view_as(self.params[i])
            at += self.params[i].numel()
            if self.momentum is not None:  # Nesterov, as torch's SGD(nesterov=True)
                self.momentum[i].mul_(self.mu).add_(d)
                d = d.add(self.momentum[i], alpha=self.mu)
            self.anchor[i].sub_(d, alpha=self.lr)
            if mix:
                self.params[i].mul_(mix).add_(self.anchor[i], alpha=1.0 - mix)
            else:
                self.params[i].copy_(self.anchor[i])
        self.meetings += 1

    # ---- checkpoints ---------------------------------------------------------------------

    def tensors(self, names: list[str], dp_rank: int) -> dict[str, torch.Tensor]:
        """Every tensor of the state under its checkpoint key: the anchor and
        outer momentum by parameter name (the same on every replica), the
        compressor's per-element buffers by fragment and replica, and with
        --sync-delay the averaged results of the exchanges in flight by
        fragment (the same on every replica). A fragment goes by the name of
        its first parameter, unique across pipeline stages. Loading writes
        into these tensors in place."""
        out = {f"outer/anchor/{names[i]}": a for i, a in enumerate(self.anchor)}
        if self.delay:  # exchanges in flight: their averaged result (the same on every replica)
            self.settle()
            self._loading = {}
            for f, run in enumerate(self.fragments):
                if not run:
                    continue
                if f in self.pending:
                    out[f"outer/pending/{names[run[0]]}"] = self.pending[f][1]
                else:  # nothing in flight: a buffer that a load may fill
                    like = self.params[run[0]]
                    numel = sum(self.params[i].numel() for i in run)
                    buf = torch.zeros(numel, dtype=like.dtype, device=like.device)
                    out[f"outer/pending/{names[run[0]]}"] = self._loading[f] = buf
        if self.momentum is not None:
            out.update({f"outer/momentum/{names[i]}": m for i, m in enumerate(self.momentum)})
        if self.compressor is not None and self.compressor.uses_error_feedback:
            for f, run in enumerate(self.fragments):
                if not run:
                    continue
                numel = sum(self.params[i].numel() for i in run)
                for kind, buffers in self.state.per_element().items():
                    if kind == "momentum" and not self.compressor.keeps_momentum:
                        continue
                    if f not in buffers:
                        buffers[f] = torch.zeros(numel)
                    out[f"outer/{kind}/dp{dp_rank}/{names[run[0]]}"] = buffers[f]
        return out

    def small_state(self) -> dict:
        lands = {f: at for f, (at, _) in self.pending.items()}
        return {"calls": dict(self.state.calls), "memory": dict(self.state.memory), "lands": lands}

    def load_small_state(self, state: dict) -> None:
        self.state.calls = dict(state["calls"])
        self.state.memory = dict(state["memory"])
        lands = state.get("lands", {})
        buffers = {f: entry[1] for f, entry in self.pending.items()} | self._loading
        self.pending = {f: [at, buffers[f]] for f, at in lands.items()}
        self._loading = {}
