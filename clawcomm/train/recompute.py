"""Activation checkpointing (``--activation-checkpoint``): layers that keep
less of their forward for backward and compute it again there.

- ``full``: each layer of the model (each GPT block; each layer of the mlp
  and the waiting model) keeps only its input; backward runs its forward
  again first (torch.utils.checkpoint, non-reentrant). About one more
  forward of the whole model per step.
- ``selective`` (gpt): each block recomputes only the parts whose saved
  tensors are large and cheap to make again, as Megatron's selective
  recomputation does: attention's core (the scaled dot product and its
  softmax statistics) and the MLP's up-projection with its activation
  (whose 4 x width output the activation would otherwise keep). The
  projections that carry most of the FLOPs are not recomputed.

Both run inside the executor's I pass under zero-bubble schedules: the
recomputed forward runs once, in the I pass, and the W pass's jobs keep
the tensors they need (no second recomputation). Under ZeRO-3 a layer's
parameters are gathered for its backward action, which the recomputation
runs in. Under tensor parallelism the recomputed forward makes its
collectives again (every TP rank recomputes the same layers in the same
order).

    apply(model, "full")   # in place; parameter names are unchanged

``LiveActivations`` counts what a mode keeps, exactly (the planner's
profile, bench/activation_memory.py and the tests read it).
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def check(mode: str, model_name: str) -> None:
    if mode == "selective" and model_name not in ("gpt", "moe"):
        raise ValueError(
            f"activation_checkpoint selective recomputes attention and the MLP's activation of "
            f"the gpt's blocks; the {model_name} model has neither (use full or none)"
        )


def _recomputed(self, *args):
    return checkpoint(self._forward_kept, *args, use_reentrant=False)


def apply(model: nn.Sequential, mode: str) -> int:
    """Makes ``model``'s layers recompute as ``mode`` says; returns how many."""
    from clawcomm.train.models import Block

    if mode == "none":
        return 0
    n = 0
    for layer in model:
        if mode == "selective":
            if isinstance(layer, Block):
                layer.recompute = True
                n += 1
            continue
        gpt_edge = not isinstance(layer, Block) and any(isinstance(m, Block) for m in model)
        if gpt_edge:  # the GPT's embedding and head: as Megatron, only the blocks
            continue
        layer._forward_kept = layer.forward
        layer.forward = types.MethodType(_recomputed, layer)
        n += 1
    return n


class LiveActivations(TorchDispatchMode):
    """Bytes of tensors created while autograd records, alive now and at peak:

        with LiveActivations() as counter:
            loss = model(x).sum()     # what the forward keeps for backward stays alive
        counter.live, counter.peak

    Each op's outputs made with grad enabled (a forward, and a
    recomputation's forward inside backward) are noted, with a finalizer on
    each storage for when it is freed; gradients and optimizer state, made
    with autograd off, are not counted. Exact, where the resident set is
    not."""

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
