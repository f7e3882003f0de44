"""Where the trainer computes: ``--device cpu|cuda|auto``, one rule for every
rank and for the command line.

- ``cpu``: every rank on the CPU.
- ``cuda``: rank r on ``cuda:{LOCAL_RANK % device_count}`` (torchrun's local
  rank; the ranks ``clawcomm train`` spawns get one too), the layout torchrun
  users have: one GPU per rank where there are enough, ranks sharing a GPU
  (under MPS, for speed) where there are not.
- ``auto``: ``cuda`` where torch sees a GPU, else ``cpu``.

``check`` runs before any rank starts, so ``--device cuda`` on a machine
without a GPU is one clear error, not one per rank.
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")


def _why_no_gpu() -> str:
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def _gpus() -> int:
    # device_count() asks NVML and leaves the driver uninitialised, so ranks
    # forked afterwards can still use the GPU.
    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def check(spec: str) -> str:
    """The device kind ``spec`` resolves to here ("cpu" or "cuda"); a
    ValueError naming the problem when ``spec`` cannot be honoured."""
    if spec not in DEVICES:
        raise ValueError(f"device {spec!r} is not one of {', '.join(DEVICES)}")
    if spec == "cpu":
        return "cpu"
    if _gpus() == 0:
        if spec == "cuda":
            raise ValueError(f"device 'cuda': {_why_no_gpu()}; use --device cpu or auto")
        return "cpu"
    return "cuda"


# The rings that carry pipeline sends and receives of CUDA tensors between
# ranks of one host through CUDA IPC (CLAWCOMM_CUDA_P2P_BYTES, docs/gpu.md):
# per rank and group, split among its peers; larger messages are staged.
P2P_BYTES = 64 << 20


def for_rank(spec: str, rank: int = 0) -> torch.device:
    """This rank's device for ``spec``, made current when it is a GPU. On a
    GPU, the groups made after this call send and receive through CUDA IPC
    unless CLAWCOMM_CUDA_P2P_BYTES says otherwise (every rank calls this
    alike, so the setting matches across ranks)."""
    if check(spec) == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local % _gpus())
    torch.cuda.set_device(dev)
    os.environ.setdefault("CLAWCOMM_CUDA_P2P_BYTES", str(P2P_BYTES))
    return dev


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it
# takes on a 64-bit machine (4 MiB x sizeof(long))
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 2**31 - 1
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_heap(libc=None) -> str | None:
    """Keeps the memory a CPU rank frees for its next allocations (``--keep-heap``).

    By default glibc's malloc gives a freed block of more than its (moving)
    threshold back to the OS, and serves blocks above 128 KiB-32 MiB with
    fresh mappings: a step whose activations are freed in backward faults
    them in again, zero-filled, in the next forward. The GPT's pipelines
    lost up to 5% of their step to it (``docs/trainer.md``). With both
    thresholds fixed, blocks up to 32 MiB come from the heap and the heap
    keeps its high-water mark, as a GPU's caching allocator does. Returns
    None once set, or why it was left alone: not glibc, or the environment
    already sets malloc's thresholds (``MALLOC_*_``, ``GLIBC_TUNABLES``).
    ``libc``: an object with ``mallopt`` (tests)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables or any(k in os.environ for k in _MALLOC_ENV):
        return "the environment sets malloc's thresholds"
    if libc is None:
        import ctypes
        import platform

        if platform.libc_ver()[0] != "glibc":
            return "the C library is not glibc"
        libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(
        _M_TRIM_THRESHOLD, _TRIM_THRESHOLD
    )
    return None if ok else "glibc refused the thresholds"


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def peak_mb(dev: torch.device) -> float:
    """The most memory torch's allocator held on ``dev`` since the last
    ``reset_peak`` (0 on the CPU)."""
    if dev.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(dev) / 2**20
