"""Block-quantised gradients: ``int8`` and ``int4`` (ZeRO++'s qgZ).

Each block of ``block`` values (256 by default) travels as 8- or 4-bit
integers and one float32 scale (its largest magnitude over 127 or 7),
rounded stochastically, so the rounding is unbiased: no error feedback is
needed. The reduce-scatter goes through one all-to-all and a local
reduction: rank j receives every rank's j-th part, quantised once, and sums
them in float32, so nothing is re-quantised per hop as it would be in a
ring. Bytes sent per rank, for N float32 values: (n-1)/n N/4 (int8) or
N/8 (int4), plus 4 bytes of scale per block, against (n-1)/n N for a
float32 reduce-scatter.

The all-reduce (for a data-parallel step without ZeRO, and ZeRO's first
step) is that reduce-scatter and a float32 all-gather of the parts.

The random draws come from a generator seeded from the compressor state's
call count for the key and this rank: every run of the same job rounds the
same way, a resumed one included (the counts are checkpointed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single
from clawcomm.compression.base import Compressor, CompressorState, shared_seed


def quantize(x: torch.Tensor, bits: int, block: int, gen: torch.Generator | None = None):
    """``x`` (float32, a multiple of ``block`` long) as (integers, scales):
    int8 values in [-q, q] (q = 127 or 7; int4 packed two to a byte) and one
    float32 scale per block. Rounding is stochastic with ``gen``, else to
    nearest."""
    q = (1 << (bits - 1)) - 1
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1) / q
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = blocks / safe[:, None]
    if gen is not None:
        noise = torch.rand(y.shape, generator=gen, device="cpu").to(y.device)
        y = torch.floor(y + noise)
    else:
        y = torch.round(y)
    ints = y.clamp_(-q, q).to(torch.int8).view(-1)
    if bits == 4:
        pairs = (ints + 8).to(torch.uint8).view(-1, 2)
        ints = (pairs[:, 0] | (pairs[:, 1] << 4)).view(torch.int8)
    return ints, scales


def dequantize(ints: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The float32 values ``quantize`` encoded."""
    if bits == 4:
        packed = ints.view(torch.uint8)
        lo, hi = (packed & 0xF).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
        ints = torch.stack([lo, hi], dim=1).view(-1)
    return (ints.to(torch.float32).view(-1, block) * scales[:, None]).view(-1)


class BlockQuantized(Compressor):
    """int8/int4 block quantisation with stochastic rounding (see the
    module docstring)."""

    reduces_scatter = True

    def __init__(self, bits: int, block: int = 256):
        if bits not in (4, 8):
            raise ValueError(f"BlockQuantized: bits must be 4 or 8, got {bits}")
        if block < 2 or block % 2:
            raise ValueError(f"BlockQuantized: block must be an even size >= 2, got {block}")
        self.bits, self.block = bits, block
        self.spec = f"int{bits}" + ("" if block == 256 else f":{block}")

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        n = dist.get_world_size(group)
        if tensor.numel() != n * out.numel():
            raise ValueError(
                f"clawcomm.compression.{self.spec}: reduce_scatter_mean of {tensor.numel()} "
                f"values over {n} ranks gives parts of {tensor.numel() / n}, not {out.numel()}"
            )
        part = out.numel()
        padded = -(-part // self.block) * self.block
        rows = tensor.new_zeros(n, padded)
        rows[:, :part] = tensor.view(n, part)
        gen = self._generator(state, key, dist.get_rank(group))
        ints, scales = quantize(rows.view(-1), self.bits, self.block, gen)
        got_ints, got_scales = torch.empty_like(ints), torch.empty_like(scales)
        dist.all_to_all_single(got_ints, ints, group=group)
        dist.all_to_all_single(got_scales, scales, group=group)
        values = dequantize(got_ints, got_scales, self.bits, self.block).view(n, padded)
        torch.sum(values[:, :part], dim=0, out=out)
        out.div_(n)

    def all_reduce_mean(self, tensor, state, key, group):
        n = dist.get_world_size(group)
        numel = tensor.numel()
        part = -(-numel // n)
        flat = tensor.new_zeros(n * part)
        flat[:numel] = tensor.view(-1)
        mine = tensor.new_empty(part)
        self.reduce_scatter_mean(flat, mine, state, key, group)
        all_gather_single(flat, mine, group=group)
        tensor.view(-1).copy_(flat[:numel])

    def all_reduce(self, tensor, state, key, group):
        self.all_reduce_mean(tensor, state, key, group)
        tensor.mul_(dist.get_world_size(group))

    @staticmethod
    def _generator(state: CompressorState | None, key, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed(shared_seed(state, key) * 65_537 + rank)


def _factory(bits: int):
    def factory(*args, spec):
        if len(args) > 1:
            raise ValueError(f"compressor spec {spec!r}: write int{bits} or int{bits}:BLOCK")
        block = 256
        if args:
            try:
                block = int(args[0])
            except ValueError:
                raise ValueError(
                    f"compressor spec {spec!r}: block {args[0]!r} is not an integer"
                ) from None
            if block < 2 or block % 2:
                raise ValueError(
                    f"compressor spec {spec!r}: block {block} is not an even size >= 2"
                )
        return BlockQuantized(bits, block)

    return factory
