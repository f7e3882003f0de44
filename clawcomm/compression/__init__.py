"""Gradient compression on top of clawcomm's engine.

    from clawcomm.compression import compressed_all_reduce, CompressorState

    state = CompressorState()                 # error-feedback residuals, checkpointable
    compressed_all_reduce(grad, "topk:0.01", state, key="layer1")
    compressed_all_reduce(grad, "fp16")       # 16-bit wire, float32 accumulation

Specs: "none", "fp16", "bf16", "topk:0.01", "topk:1000:exact", "randomk:0.01",
"topk:0.01+fp16" (see registry.py). ``clawcomm.hooks`` wraps these as DDP
comm hooks; ``register_compressor`` adds your own (docs/compression.md).
"""

from __future__ import annotations

import torch

from clawcomm.compression import compressors as _builtin  # noqa: F401  (registers them)
from clawcomm.compression.base import Compressor, CompressorState
from clawcomm.compression.registry import available, get_compressor, register_compressor
from clawcomm.compression.sparse import sparse_all_reduce

__all__ = [
    "Compressor",
    "CompressorState",
    "available",
    "compressed_all_reduce",
    "get_compressor",
    "register_compressor",
    "sparse_all_reduce",
]


def compressed_all_reduce(
    tensor: torch.Tensor,
    compressor: str | Compressor,
    state: CompressorState | None = None,
    group=None,
    key=0,
    average: bool = False,
) -> torch.Tensor:
    """Sums ``tensor`` (float32, contiguous, CPU) over ``group`` in place,
    compressing what goes on the wire, and returns it. ``state`` keeps
    error-feedback residuals under ``key`` (pass one per tensor you reduce
    every step); ``average`` divides by the group size."""
    c = get_compressor(compressor)
    if average:
        c.all_reduce_mean(tensor, state, key, group)
    else:
        c.all_reduce(tensor, state, key, group)
    return tensor
