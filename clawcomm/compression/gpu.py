"""The compressors on CUDA tensors, with clawcomm's CUDA kernels
(``clawcomm._C.cuda``, csrc/cuda/) and no host round trip: every step is
queued on the current stream, and the collectives are the backend's CUDA
path (CUDA IPC on one host, else staged).

* 16 bits: encode (x * prescale rounded to float16/bfloat16), an all-reduce
  of the 16-bit tensor (the CUDA IPC kernels add in float32 and round once),
  decode (times postscale).
* top-k: the fused fold + selection kernel (sampled threshold or exact radix
  select, the CPU's choice of entries), an all-gather of exactly k (index,
  value) pairs per rank (slots past what was selected hold index 0 and value
  0, which add nothing), and a scatter-add into the zeroed gradient, in
  index order (deterministic) by default.
* block quantisation (int8/int4, qsgd, terngrad, sign): the CPU kernel's
  codes, scales and residuals for the same seed (cuda/quantize_kernels.cu).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single


def _kernels():
    from clawcomm import _C

    if not getattr(_C, "cuda_built", False):
        raise RuntimeError(
            "clawcomm.compression: CUDA tensors need clawcomm's CUDA kernels, but this build has "
            "none (rebuild with nvcc and a CUDA build of torch, or CLAWCOMM_CUDA=1)"
        )
    return _C.cuda


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def half_all_reduce(tensor, wire: str, prescale: float, postscale: float, group) -> None:
    """Sum of float32 CUDA `tensor` over `group` in place, 16 bits on the wire."""
    k = _kernels()
    n = tensor.numel()
    half = torch.empty(n, dtype=getattr(torch, wire), device=tensor.device)
    k.from_float32(tensor.data_ptr(), half.data_ptr(), n, wire, prescale, _stream())
    dist.all_reduce(half, group=group)
    k.to_float32(half.data_ptr(), tensor.data_ptr(), n, wire, postscale, _stream())


def topk_all_reduce(
    tensor, residual, k: int, selection: str, seed: int, values: str, scale: float, group
) -> None:
    """Top-k with error feedback (``residual`` may be None: no feedback) and
    the sparse sum, all on `tensor`'s GPU."""
    kern = _kernels()
    n, dev = tensor.numel(), tensor.device
    world = dist.get_world_size(group)
    if residual is None:  # select from the gradient alone, keep nothing
        residual, grad = tensor.clone(), 0
    else:
        grad = tensor.data_ptr()
    idx = torch.zeros(k, dtype=torch.int32, device=dev)
    val = torch.zeros(k, dtype=torch.float32, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    ws = torch.empty(kern.topk_workspace_bytes(n), dtype=torch.uint8, device=dev)
    kern.topk_feedback(
        grad, residual.data_ptr(), n, k,
        idx.data_ptr(), val.data_ptr(), count.data_ptr(), ws.data_ptr(), selection, seed, _stream(),
    )  # fmt: skip
    if grad == 0:
        tensor.zero_()
    if values != "fp32":
        val = val.to({"fp16": torch.float16, "bf16": torch.bfloat16}[values])
    all_idx = torch.empty(k * world, dtype=torch.int32, device=dev)
    all_val = torch.empty(k * world, dtype=val.dtype, device=dev)
    all_gather_single(all_idx, idx, group=group)
    all_gather_single(all_val, val, group=group)
    all_val = all_val.float()
    m = k * world
    ws = torch.empty(max(1, kern.scatter_add_workspace_bytes(m)), dtype=torch.uint8, device=dev)
    kern.scatter_add(
        tensor.data_ptr(), n, all_idx.data_ptr(), all_val.data_ptr(), m, scale, True,
        ws.data_ptr(), _stream(),
    )  # fmt: skip


def topk_take(v, k: int, seed: int):
    """At most ``k`` entries of largest magnitude of the float32 CUDA tensor
    ``v``, with the CPU's sampled threshold for ``seed`` (the same entries):
    (indices ascending as int32, values), zeroed in ``v``."""
    kern = _kernels()
    n, dev = v.numel(), v.device
    idx = torch.zeros(k, dtype=torch.int32, device=dev)
    val = torch.zeros(k, dtype=torch.float32, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    ws = torch.empty(kern.topk_workspace_bytes(n), dtype=torch.uint8, device=dev)
    kern.topk_feedback(
        0, v.data_ptr(), n, k, idx.data_ptr(), val.data_ptr(), count.data_ptr(), ws.data_ptr(),
        "sampled", seed, _stream(),
    )  # fmt: skip
    m = int(count.item())  # (a wait: the pairs' count is known on the host only now)
    return idx[:m], val[:m]


def quantize(x, codes, scales, bits: int, block: int, scale: str, seed, residual) -> None:
    """compression.quantized.quantize on CUDA tensors (contiguous float32)."""
    _kernels().quantize(
        x.data_ptr(), codes.data_ptr(), scales.data_ptr(), x.numel(), bits, block, scale,
        seed is not None, (seed or 0) & (2**64 - 1),
        0 if residual is None else residual.data_ptr(), _stream(),
    )  # fmt: skip


def dequantize(codes, scales, out, bits: int, block: int, scale: str, alpha, accumulate) -> None:
    n = scales.numel() * block
    _kernels().dequantize(
        codes.data_ptr(), scales.data_ptr(), out.data_ptr(), n, bits, block, scale, alpha,
        accumulate, _stream(),
    )  # fmt: skip
