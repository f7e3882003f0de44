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
    cut_parameter(q, 2, ((0, 8),))  # cut again, in place, along another dimension

A parameter may be cut along several dimensions: tensor-parallel experts
are split along their hidden dimension over the TP group, then along the
expert dimension over the expert-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Slices = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Split:
    """How a parameter is split: this rank's tensor is the concatenation,
    along ``dim``, of the slices ``pieces`` = ((start, length), ...) of the
    whole tensor, whose shape is ``whole``; ``also``: further cuts
    ((dim, pieces), ...) along other dimensions, each taken the same way."""

    whole: tuple[int, ...]
    dim: int
    pieces: Slices
    also: tuple[tuple[int, Slices], ...] = ()

    def cuts(self) -> tuple[tuple[int, Slices], ...]:
        return ((self.dim, self.pieces), *self.also)

    def cut(self, dim: int, pieces: Slices) -> Split:
        """This split cut again along ``dim`` (not cut yet)."""
        if any(d == dim for d, _ in self.cuts()):
            raise ValueError(f"Split: dimension {dim} of {list(self.whole)} is cut already")
        return Split(self.whole, self.dim, self.pieces, (*self.also, (dim, pieces)))

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``whole``."""
        for d, pieces in self.cuts():
            whole = _take(whole, d, pieces)
        return whole

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.whole)
        for d, pieces in self.cuts():
            shape[d] = sum(n for _, n in pieces)
        return tuple(shape)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(offsets in the whole, sizes, offsets in the local tensor) of
        each piece (one per combination of every cut's pieces): what a
        checkpoint writes and reads."""
        out = [((0,) * len(self.whole), tuple(self.whole), (0,) * len(self.whole))]
        for d, pieces in self.cuts():
            cut, at = [], 0
            for s, n in pieces:
                for off, sizes, local in out:
                    cut.append((_put(off, d, s), _put(sizes, d, n), _put(local, d, at)))
                at += n
            out = cut
        return out


def _take(t: torch.Tensor, dim: int, pieces: Slices) -> torch.Tensor:
    return torch.cat([t.narrow(dim, s, n) for s, n in pieces], dim)


def _put(t: tuple[int, ...], i: int, v: int) -> tuple[int, ...]:
    return (*t[:i], v, *t[i + 1 :])


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


def cut_parameter(p: nn.Parameter, dim: int, pieces: Slices) -> nn.Parameter:
    """``p`` (whole, or split along other dimensions) cut along ``dim``, in
    place: the same parameter, holding less (so that what already lists it,
    the tensor-parallel layers' records, still does)."""
    split = split_of(p)
    split = split.cut(dim, pieces) if split is not None else Split(tuple(p.shape), dim, pieces)
    p.data = _take(p.detach(), dim, pieces).clone()
    p.clawcomm_split = split
    return p


def split_of(p: torch.Tensor) -> Split | None:
    """How ``p`` is split (None: it is whole)."""
    return getattr(p, "clawcomm_split", None)
