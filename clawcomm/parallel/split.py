"""A parameter that is part of a whole one: how tensor parallelism splits a
layer's weight over its TP group (Q, K and V's rows for this rank's heads:
three pieces of the attention's ``qkv`` weight), and how expert parallelism
gives each rank a block of the experts (the leading dimension of the
experts' stacked weights). Checkpoints key every parameter by its whole
tensor and save and load these pieces of it (train/checkpoint_pieces.py),
so either split reshards on load; the gradient norm and the memory figures
read the whole shape.

    q = split_parameter(p, Split(tuple(p.shape), 0, ((start, length),)))
    split_of(q).take(whole)      # q's part of a whole tensor
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Split:
    """How a parameter is split: this rank's tensor is the concatenation,
    along ``dim``, of the slices ``pieces`` = ((start, length), ...) of the
    whole tensor, whose shape is ``whole``."""

    whole: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, int], ...]

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``whole``."""
        return torch.cat([whole.narrow(self.dim, s, n) for s, n in self.pieces], self.dim)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """(offsets in the whole, sizes, offset along dim in the local
        tensor) of each piece: what a checkpoint writes and reads."""
        out, at = [], 0
        for s, n in self.pieces:
            offsets = tuple(s if d == self.dim else 0 for d in range(len(self.whole)))
            sizes = tuple(n if d == self.dim else w for d, w in enumerate(self.whole))
            out.append((offsets, sizes, at))
            at += n
        return out


def whole_shape(p: torch.Tensor) -> list[int]:
    """The shape of the whole tensor ``p`` is a slice of (its own if whole)."""
    split = split_of(p)
    return list(split.whole if split is not None else p.shape)


def block_of(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's block when n things split over size ranks
    as evenly as they go (the first n % size ranks one more)."""
    start = rank * (n // size) + min(rank, n % size)
    return start, n // size + (1 if rank < n % size else 0)


def split_parameter(p: torch.Tensor, split: Split) -> nn.Parameter:
    q = nn.Parameter(split.take(p.detach()).clone(), requires_grad=p.requires_grad)
    q.clawcomm_split = split  # what checkpoints and the memory figures read (split_of)
    return q


def split_of(p: torch.Tensor) -> Split | None:
    """How ``p`` is split (None: it is whole)."""
    return getattr(p, "clawcomm_split", None)
