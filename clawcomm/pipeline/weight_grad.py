"""Splitting a backward pass into I (input gradient) and W (weight gradient),
as zero-bubble schedules need.

The previous stage waits for I; nobody waits for W, so W can fill the
pipeline's idle time. As in Zero Bubble's own implementation, the split is
made where the weight gradient is a separate product: a linear layer's
backward computes ``grad_input = g @ W`` at once and, inside ``deferring``,
stores ``grad_W = g^T x`` (and ``grad_b = sum g``) as a job; the W pass runs
the jobs. Other parameters (norms, embeddings) get their gradients during I.

    split_linear_backward(stage)            # its nn.Linear layers split
    store = WeightGradStore()
    with deferring(store):
        torch.autograd.backward(out, grad)  # I: grad of the input, no grad_W
    store.run()                             # W: the weight gradients

Outside ``deferring`` a split layer computes everything at once, so the
same module also runs full backward passes (B). A custom layer splits its
own backward by handing its weight-gradient work to ``defer_weight_grad``.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_current = threading.local()


class WeightGradStore:
    """The weight-gradient jobs of one (stage, micro-batch) I pass."""

    def __init__(self):
        self.jobs: list[Callable[[], None]] = []

    def run(self) -> None:
        """Runs the jobs, outside autograd (as backward itself runs)."""
        jobs, self.jobs = self.jobs, []
        with torch.no_grad():
            for job in jobs:
                job()

    def __len__(self) -> int:
        return len(self.jobs)


@contextlib.contextmanager
def deferring(store: WeightGradStore):
    """Weight-gradient work inside goes to ``store`` instead of running."""
    old = getattr(_current, "store", None)
    _current.store = store
    try:
        yield store
    finally:
        _current.store = old


def current_store() -> WeightGradStore | None:
    return getattr(_current, "store", None)


# Who hears of gradient contributions: one per process, not per thread,
# because autograd runs the post-accumulate hooks of CUDA tensors on its own
# device thread, not on the thread that called backward.
_listener: Callable[[torch.Tensor], None] | None = None


def set_listener(on_grad: Callable[[torch.Tensor], None] | None) -> None:
    """From now on, ``notify_grad(param)`` calls ``on_grad(param)``; None
    stops it. The GradReducer listens while an action that makes gradients
    final runs (one pipeline executor per process)."""
    global _listener
    _listener = on_grad


def notify_grad(param: torch.Tensor) -> None:
    """Says that ``param.grad`` just received a contribution: from
    autograd's post-accumulate hook, from a W job, or without touching
    memory (a layer whose gradient another device computed)."""
    listener = _listener
    if listener is not None:
        listener(param)


def defer_weight_grad(job: Callable[[], None]) -> None:
    """Runs ``job()`` in the W pass when inside ``deferring``, at once
    otherwise."""
    store = current_store()
    if store is None:
        job()
    else:
        store.jobs.append(job)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (in place, as autograd would), then
    ``notify_grad``."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
    notify_grad(param)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        grad_x = g.matmul(w) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        g2 = g.reshape(-1, g.shape[-1])
        x2 = x.detach().reshape(-1, x.shape[-1])  # kept by the W job: no graph with it
        if current_store() is None:  # a full backward: everything now
            return grad_x, g2.t().mm(x2) if need_w else None, g2.sum(0) if need_b else None

        def weight_pass():
            if need_w:
                if weight.grad is None:
                    weight.grad = g2.t().mm(x2)
                else:
                    weight.grad.addmm_(g2.t(), x2)  # straight into the bucket view
                notify_grad(weight)
            if need_b:
                accumulate_grad(bias, g2.sum(0))

        defer_weight_grad(weight_pass)
        return grad_x, None, None


def _split_forward(self, x):
    return _SplitLinear.apply(x, self.weight, self.bias)


def split_linear_backward(module: nn.Module) -> int:
    """Makes every ``nn.Linear`` in ``module`` (that keeps nn.Linear's own
    forward) defer its weight gradient inside ``deferring``. Returns how
    many layers were split."""
    n = 0
    for m in module.modules():
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            m.forward = types.MethodType(_split_forward, m)
            n += 1
    return n
