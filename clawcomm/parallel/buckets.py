"""Gradient buckets: parameters grouped into flat buffers, each parameter's
gradient a view of its bucket, so one collective reduces a whole bucket in
place and the optimizer reads the result without a copy."""

from __future__ import annotations

import torch


class GradBucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    ``params`` are indices into the wrapper's parameter list, in the order the
    bucket lays them out; ``views[i]`` is params[i]'s gradient, a view of
    ``flat`` shaped like the parameter.
    """

    def __init__(self, index: int, params: list[int], tensors: list[torch.Tensor], shards: int = 0):
        self.index = index
        self.params = params
        dtype, device = tensors[0].dtype, tensors[0].device
        self.numel = sum(t.numel() for t in tensors)
        self.element_size = tensors[0].element_size()
        # Sharded over `shards` ranks (ZeRO): `flat` is padded with zeros to
        # a multiple of it, and rank k owns flat[k * shard : (k + 1) * shard].
        self.shards = shards
        self.padded = -(-self.numel // shards) * shards if shards else self.numel
        self.shard = self.padded // shards if shards else 0
        self.shard_grad: torch.Tensor | None = None  # this rank's averaged shard
        self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
        self.offsets: list[int] = []  # where each parameter starts in `flat`
        self.views: list[torch.Tensor] = []
        offset = 0
        for t in tensors:
            self.offsets.append(offset)
            self.views.append(self.flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        self.pending = len(params)  # gradients not yet ready this step

    def segment(self, flat: torch.Tensor, slot: int) -> torch.Tensor:
        """Parameter ``slot``'s part of ``flat``, any flat tensor laid out
        like this bucket (its error-feedback residual, for one)."""
        start = self.offsets[slot]
        return flat[start : start + self.views[slot].numel()]

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def __repr__(self) -> str:
        return f"<GradBucket {self.index}: {len(self.params)} params, {self.nbytes} bytes>"


def assign_buckets(
    order: list[int],
    tensors: list[torch.Tensor],
    cap_bytes: int,
    first_cap_bytes: int,
    kind=lambda i: None,
) -> list[list[int]]:
    """Groups parameter indices, taken in ``order``, into buckets of at most
    ``cap_bytes`` (the first at most ``first_cap_bytes``, so the first
    all-reduce starts early in backward). A parameter of at least half the
    cap gets a bucket of its own (so a replaced gradient can become the
    bucket's buffer without a copy: GradReducer.take_grad); a bucket holds
    one dtype and device, and one ``kind(i)`` (sharded or not)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    cap = first_cap_bytes
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        same_kind = not current or (
            tensors[current[0]].dtype == t.dtype
            and tensors[current[0]].device == t.device
            and kind(current[0]) == kind(i)
        )
        alone = 2 * nbytes >= cap
        if current and (size + nbytes > cap or not same_kind or alone):
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(i)
        size += nbytes
        if alone:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets
