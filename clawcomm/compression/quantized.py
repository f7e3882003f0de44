"""Block-quantised gradients: ``int8``/``int4`` (ZeRO++'s qgZ), ``qsgd``,
``terngrad`` and ``sign`` (EF-SignSGD), one kernel behind all of them
(csrc/compress/quantize.h).

Each block of ``block`` values travels as ``bits``-bit codes and one float32
scale:

==================  ====  ==========================  ===========================
spec                bits  scale per block              rounding
==================  ====  ==========================  ===========================
``int8[:B]``        8     largest magnitude / 127      stochastic (unbiased)
``int4[:B]``        4     largest magnitude / 7        stochastic (unbiased)
``qsgd:BITS[:B]``   2,4,8 L2 norm / (2^(BITS-1) - 1)   stochastic (unbiased), QSGD
``terngrad[:B]``    2     largest magnitude            stochastic to {-1, 0, 1},
                                                        after clipping to 2.5 sigma
``sign[:B]``        1     mean magnitude (|x|_1 / d)   the sign, error feedback
==================  ====  ==========================  ===========================

The reduce-scatter is one all-to-all of codes and scales and a float32 sum:
rank j receives every rank's j-th part, quantised once, so nothing is
re-quantised per hop as it would be in a ring. The all-reduce adds a second
stage: each rank quantises its summed part again (the same codes; ``sign``
keeps a second error-feedback residual for it, as dist-EF-SGD's server
does) and the parts are all-gathered as codes. Bytes sent per rank for N
float32 values: 2 (n-1)/n N bits/8 plus the scales, against 8 (n-1)/n N for
a float32 ring all-reduce.

The random draws come from a seed made of the compressor state's call count
for the key and this rank: a run repeats bit for bit, a resumed one
included (the counts are checkpointed). CUDA tensors go through the same
kernel compiled for the GPU (csrc/cuda/quantize_kernels.cu): the same codes,
scales and residuals for the same seed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single
from clawcomm.compression import gpu
from clawcomm.compression.base import (
    Compressor,
    CompressorState,
    Wire,
    median_seconds,
    shared_seed,
    zeros_like_in,
)
from clawcomm.compression.coding import exchange_codes, gather_codes

SCALES = ("max", "l2", "mean_abs")


def quantize(
    x: torch.Tensor,
    bits: int,
    block: int,
    seed: int | None = None,
    scale: str = "max",
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, a multiple of ``block`` long) as (codes, scales):
    ``bits``-bit codes packed into uint8 and one float32 scale per block.
    ``seed`` rounds stochastically (None: to nearest); with ``residual``,
    x + residual is quantised and the residual keeps what the codes miss."""
    codes = torch.empty(x.numel() * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.numel() // block, dtype=torch.float32, device=x.device)
    if x.is_cuda:
        gpu.quantize(x, codes, scales, bits, block, scale, seed, residual)
    else:
        from clawcomm import _C

        _C.compress.quantize(
            x.numpy(), codes.numpy(), scales.numpy(), bits, block, scale, seed is not None,
            (seed or 0) & (2**64 - 1), None if residual is None else residual.numpy(),
        )  # fmt: skip
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    scale: str = "max",
    out: torch.Tensor | None = None,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """The float32 values ``quantize`` encoded, times ``alpha``: written to
    ``out`` (made if None), or added to it (``accumulate``)."""
    if out is None:
        out = torch.empty(scales.numel() * block, dtype=torch.float32, device=codes.device)
    if codes.is_cuda:
        gpu.dequantize(codes, scales, out, bits, block, scale, alpha, accumulate)
    else:
        from clawcomm import _C

        _C.compress.dequantize(
            codes.numpy(), scales.numpy(), out.numpy(), bits, block, scale, alpha, accumulate
        )
    return out


class Codec:
    """How a block quantiser writes its values: bits, block, scale and
    rounding (the table in the module docstring)."""

    def __init__(self, bits: int, block: int, scale: str = "max", stochastic: bool = True):
        self.bits, self.block, self.scale, self.stochastic = bits, block, scale, stochastic

    def encode(self, x, seed: int, residual=None):
        return quantize(x, self.bits, self.block, seed if self.stochastic else None,
                        self.scale, residual)  # fmt: skip

    def decode(self, codes, scales, out, alpha: float = 1.0, accumulate: bool = False):
        dequantize(codes, scales, self.bits, self.block, self.scale, out, alpha, accumulate)

    def row_bytes(self, values: int) -> int:
        return values * self.bits // 8


class BlockQuantized(Compressor):
    """A block quantiser as a compressor (see the module docstring).
    ``feedback``: error feedback (sign); ``clip_sigma``: clip the input to
    that many standard deviations first (TernGrad)."""

    reduces_scatter = True
    codable = True  # +ec: the codes of both stages rANS-coded (entropy.py)

    def __init__(self, spec: str, codec: Codec, feedback: bool = False, clip_sigma=None):
        self.spec, self.codec = spec, codec
        self.feedback = self.uses_error_feedback = feedback
        self.clip_sigma = clip_sigma

    def reduce_scatter_mean(self, tensor, out, state, key, group):
        self.check_coded_device(tensor)
        n = dist.get_world_size(group)
        if tensor.numel() != n * out.numel():
            raise ValueError(
                f"clawcomm.compression.{self.spec}: reduce_scatter_mean of {tensor.numel()} "
                f"values over {n} ranks gives parts of {tensor.numel() / n}, not {out.numel()}"
            )
        self._clip(tensor)
        self._reduce_scatter(tensor, out, state, key, group, self._seed(state, key, group))

    def all_reduce_mean(self, tensor, state, key, group):
        self.check_coded_device(tensor)
        n = dist.get_world_size(group)
        block, numel = self.codec.block, tensor.numel()
        part = -(-numel // (n * block)) * block  # every rank's part a whole number of blocks
        self._clip(tensor)  # before padding: sigma is the gradient's
        padded = numel != n * part

        def pad(t):  # (the tensor and its residual, laid out alike)
            if not padded:
                return t.view(-1)
            out = t.new_zeros(n * part)
            out[:numel] = t.view(-1)
            return out

        flat = pad(tensor)
        residual = self._residual(state, key, tensor)
        if residual is not None:
            residual = pad(residual)
        seed = self._seed(state, key, group)
        mine = tensor.new_empty(part)
        self._reduce_scatter(flat, mine, state, key, group, seed, residual)
        if residual is not None and padded:
            state.residuals[key].copy_(residual[:numel])
        # Stage two: this rank's summed part, quantised again, all-gathered as codes.
        second = None
        if self.feedback and state is not None:
            second = zeros_like_in(state.memory, (key, "part"), mine)
        codes, scales = self.codec.encode(mine, seed ^ 0x5EC0D, second)
        all_scales = scales.new_empty(n * scales.numel())
        if self.coded:
            all_codes = torch.from_numpy(gather_codes(codes.numpy(), part, group, self.coded))
        else:
            all_codes = codes.new_empty(n * codes.numel())
            all_gather_single(all_codes, codes, group=group)
        all_gather_single(all_scales, scales, group=group)
        self.codec.decode(all_codes, all_scales, flat)
        if padded:
            tensor.view(-1).copy_(flat[:numel])

    def all_reduce(self, tensor, state, key, group):
        self.all_reduce_mean(tensor, state, key, group)
        tensor.mul_(dist.get_world_size(group))

    def wire(self, elems, world, sharded=False, shapes=None):
        """The reduce-scatter's codes and scales (two all-to-alls), and for
        an all-reduce the summed parts' again (two all-gathers); every part
        padded to whole blocks. One encode and decode a stage."""
        if self.coded:
            return None
        block = self.codec.block
        part = -(-elems // (world * block)) * block
        codes = float(world * self.codec.row_bytes(part))
        scales = 4.0 * world * part / block
        scatter = (("all_to_all", codes), ("all_to_all", scales))
        if sharded:
            return Wire(scatter, codec_passes=1)
        return Wire(scatter + (("all_gather", codes), ("all_gather", scales)), codec_passes=2)

    def codec_seconds(self, elems, world, shapes=None, repeats=5):
        """One encode and one decode of ``elems`` values (whole blocks)."""
        if elems <= 0:
            return 0.0
        elems = -(-elems // self.codec.block) * self.codec.block
        x = torch.randn(elems, generator=torch.Generator().manual_seed(0))
        out = torch.zeros(elems)

        def run(step: int) -> None:
            codes, scales = self.codec.encode(x, step)
            self.codec.decode(codes, scales, out, accumulate=True)

        return median_seconds(run, repeats)

    def _seed(self, state: CompressorState | None, key, group) -> int:
        return shared_seed(state, key) * 65_537 + dist.get_rank(group)

    def _residual(self, state, key, tensor):
        if not self.feedback or state is None:
            return None
        return state.residual(key, tensor.view(-1))

    def _clip(self, tensor):
        if self.clip_sigma is not None and tensor.numel() > 1:
            bound = float(self.clip_sigma * tensor.std())
            tensor.clamp_(-bound, bound)

    def _reduce_scatter(self, tensor, out, state, key, group, seed, residual=None):
        """``out`` becomes this rank's part of the mean; ``tensor``: n parts
        of out's length. ``residual``: the error
        feedback, as long as ``tensor`` (else the state's, for the key)."""
        n, part, block = dist.get_world_size(group), out.numel(), self.codec.block
        padded = -(-part // block) * block
        if residual is None:
            residual = self._residual(state, key, tensor)
        rows, res = tensor.view(-1), residual
        if padded != part:  # each part padded to whole blocks
            rows = tensor.new_zeros(n, padded)
            rows[:, :part] = tensor.view(n, part)
            rows = rows.view(-1)
            if residual is not None:
                res = tensor.new_zeros(n, padded)
                res[:, :part] = residual.view(n, part)
                res = res.view(-1)
        codes, scales = self.codec.encode(rows, seed, res)
        if res is not None and res is not residual:
            residual.view(n, part).copy_(res.view(n, padded)[:, :part])
        row, nb = self.codec.row_bytes(padded), padded // block
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        if self.coded:
            rows = codes.numpy().reshape(n, row)
            got_codes = torch.from_numpy(exchange_codes(rows, n * padded, group, self.coded))
        else:
            dist.all_to_all_single(got_codes, codes, group=group)
        dist.all_to_all_single(got_scales, scales, group=group)
        target = out if padded == part else out.new_empty(padded)
        for j in range(n):
            self.codec.decode(got_codes[j * row : (j + 1) * row], got_scales[j * nb : (j + 1) * nb],
                              target, alpha=1.0 / n, accumulate=j > 0)  # fmt: skip
        if target is not out:
            out.copy_(target[:part])


def _block_arg(args, default: int, spec: str) -> int:
    if not args:
        return default
    try:
        block = int(args[0])
    except ValueError:
        raise ValueError(f"compressor spec {spec!r}: block {args[0]!r} is not an integer") from None
    if block < 8 or block % 8:
        raise ValueError(f"compressor spec {spec!r}: block {block} is not a positive multiple of 8")
    return block


def _int_factory(bits: int):
    def factory(*args, spec):
        if len(args) > 1:
            raise ValueError(f"compressor spec {spec!r}: write int{bits} or int{bits}:BLOCK")
        block = _block_arg(args, 256, spec)
        return BlockQuantized(f"int{bits}" + ("" if block == 256 else f":{block}"),
                              Codec(bits, block))  # fmt: skip

    return factory


def _qsgd(*args, spec):
    if not args or len(args) > 2 or args[0] not in ("2", "4", "8"):
        raise ValueError(f"compressor spec {spec!r}: write qsgd:BITS[:BLOCK], BITS 2, 4 or 8")
    default = 128 if args[0] == "2" else 512  # QSGD's buckets: finer for fewer levels
    block = _block_arg(args[1:], default, spec)
    name = f"qsgd:{args[0]}" + ("" if block == default else f":{block}")
    return BlockQuantized(name, Codec(int(args[0]), block, "l2"))


def _terngrad(*args, spec):
    if len(args) > 1:
        raise ValueError(f"compressor spec {spec!r}: write terngrad or terngrad:BLOCK")
    block = _block_arg(args, 256, spec)
    name = "terngrad" + ("" if block == 256 else f":{block}")
    return BlockQuantized(name, Codec(2, block, "max"), clip_sigma=2.5)


def _sign(*args, spec):
    if len(args) > 1:
        raise ValueError(f"compressor spec {spec!r}: write sign or sign:BLOCK")
    block = _block_arg(args, 1024, spec)
    name = "sign" + ("" if block == 1024 else f":{block}")
    return BlockQuantized(name, Codec(1, block, "mean_abs", stochastic=False), feedback=True)


FACTORIES = {
    "int8": _int_factory(8),
    "int4": _int_factory(4),
    "qsgd": _qsgd,
    "terngrad": _terngrad,
    "sign": _sign,
}
