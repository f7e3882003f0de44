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
    """The weight-gradient jobs of one (stage, micro-batch) I pass.
    ``on_grad(param)`` is called after each job has accumulated into a
    parameter's ``.grad`` (the trainer counts final gradients with it)."""

    def __init__(self, on_grad: Callable[[torch.Tensor], None] | None = None):
        self.jobs: list[Callable[[], None]] = []
        self.on_grad = on_grad

    def run(self) -> None:
        jobs, self.jobs = self.jobs, []
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


def defer_weight_grad(job: Callable[[WeightGradStore | None], None]) -> None:
    """Runs ``job(store)`` in the W pass when inside ``deferring``, at once
    (with ``store=None``) otherwise."""
    store = current_store()
    if store is None:
        job(None)
    else:
        store.jobs.append(lambda: job(store))


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, store) -> None:
    """``param.grad += grad`` (in place, as autograd would), then tells the
    store."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
    if store is not None and store.on_grad is not None:
        store.on_grad(param)


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
        x2 = x.reshape(-1, x.shape[-1])
        if current_store() is None:  # a full backward: everything now
            return grad_x, g2.t().mm(x2) if need_w else None, g2.sum(0) if need_b else None

        def weight_pass(store):
            if need_w:
                if weight.grad is None:
                    weight.grad = g2.t().mm(x2)
                else:
                    weight.grad.addmm_(g2.t(), x2)  # straight into the bucket view
                if store.on_grad is not None:
                    store.on_grad(weight)
            if need_b:
                accumulate_grad(bias, g2.sum(0), store)

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
