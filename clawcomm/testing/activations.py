"""Activation memory counted exactly (for tests and bench/): the bytes of
tensors created while autograd records, alive at once.

    with LiveActivations() as counter:
        loss = model(x).sum()     # forward: what it keeps for backward stays alive
    counter.live, counter.peak    # bytes now, and at most

A ``TorchDispatchMode`` notes each op's outputs made with grad enabled (the
forward, and a recomputation's forward inside backward), and a finalizer on
each storage notes when it is freed. Gradients and optimizer state, made
with autograd off, are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveActivations(TorchDispatchMode):
    """Bytes of tensors created while autograd records, alive now and at peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    key = s.data_ptr()
                    if key and key not in self._seen:
                        self._seen.add(key)
                        self.live += s.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(s, self._freed, key, s.nbytes())
        return out
