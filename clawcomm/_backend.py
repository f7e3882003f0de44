"""Registration of the ``"clawcomm"`` backend with torch.distributed."""

from __future__ import annotations

import atexit
import os

import torch.distributed as dist

from clawcomm import _C, _C_torch

BACKEND_NAME = "clawcomm"


def _create_backend(opts, backend_options=None):
    """torch's extended creator: ``opts`` (c10d's DistributedBackendOptions)
    carries the group's global ranks, which errors and flight records name."""
    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    # torchrun's agent keeps one store for every restart of a job, and the
    # keys of the previous attempt are still there (checked with torch
    # 2.13): a restarted rank could read its predecessors' token and
    # addresses. Each attempt's keys get their own prefix.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None:
        store = dist.PrefixStore(f"clawcomm-attempt-{attempt}/", store)
    nice = -1
    if backend_options is not None:
        if not isinstance(backend_options, _C_torch.ClawcommOptions):
            raise TypeError(
                f"clawcomm: pg_options {type(backend_options).__name__} is not "
                "clawcomm.group_options(...)"
            )
        nice = backend_options.progress_nice
    backend = _C_torch.ClawcommBackend(store, rank, size, timeout, nice)
    ranks = list(opts.global_ranks_in_group or [])
    if len(ranks) == size:  # (the world's is empty: its ranks are the global ones)
        backend._set_global_ranks(ranks)
    return backend


def group_options(progress_nice: int) -> _C_torch.ClawcommOptions:
    """Options for one group, as ``dist.new_group``'s ``pg_options``::

        pp = dist.new_group(ranks, pg_options=clawcomm.group_options(progress_nice=0))

    ``progress_nice`` (0-19): the nice value of the group's progress thread,
    in place of ``CLAWCOMM_PROGRESS_NICE`` (10 unless set). 10 lets a rank's
    compute keep its core while a data-parallel reduction moves in the
    background; 0 suits a pipeline's sends, which the next stage waits for
    while the sender has already gone on computing (docs/settings.md)."""
    import datetime

    if isinstance(progress_nice, bool) or not isinstance(progress_nice, int):
        raise TypeError(f"clawcomm.group_options: progress_nice {progress_nice!r} is not an int")
    if not 0 <= progress_nice <= 19:
        raise ValueError(
            f"clawcomm.group_options: progress_nice {progress_nice} is not a nice value in [0, 19]"
        )
    return _C_torch.ClawcommOptions(datetime.timedelta(minutes=30), progress_nice)


def register() -> None:
    """Registers the backend once; later calls do nothing."""
    if (
        BACKEND_NAME.upper() in dist.Backend.backend_list
        or BACKEND_NAME in dist.Backend.backend_list
    ):
        return
    import torch

    # CUDA tensors are staged through pinned host memory (csrc/torch/
    # backend.h). torch calls the creator once per device type, so a
    # CUDA machine gets a second communicator for its CUDA tensors; a CPU
    # machine registers for cpu only and keeps one.
    # device_count() asks NVML, so the CUDA driver stays uninitialised here
    # and ranks forked from this process can still use the GPU.
    cuda = torch.backends.cuda.is_built() and torch.cuda.device_count() > 0
    devices = ["cpu", "cuda"] if cuda else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=devices)
    # Stop every progress thread before Python finalizes: a thread that runs a
    # completion callback during finalization would be killed mid-way.
    atexit.register(_C._shutdown_all)


def backend_of(group=None, device: str = "cpu") -> _C_torch.ClawcommBackend:
    """The clawcomm backend object behind ``group`` (default: the world) for
    ``device``'s tensors ("cpu", or "cuda", which has its own communicator)."""
    import torch

    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device(device))
    if not isinstance(backend, _C_torch.ClawcommBackend):
        raise ValueError(f"group {pg} does not use the clawcomm backend for {device}")
    return backend


def engine_of(group=None, device: str = "cpu") -> _C.Engine:
    """The engine behind ``group``: its collectives on numpy arrays (or any
    buffer-protocol object), called without torch's dispatch::

        eng = clawcomm.engine_of()
        eng.all_reduce(np_array)          # in place, blocks until done

    It shares the group's connections and issue order, so calls on the group
    and on its engine must be made in the same order on every rank.
    """
    return _C._engine_from_handle(backend_of(group, device)._engine_handle())


def comm_stats(group=None, device: str = "cpu") -> dict[str, dict[str, int]]:
    """Traffic of ``group``'s communicator so far, per collective: calls, and
    bytes sent and received as measured on the wire (``bytes_*``: whole
    frames with their 64-byte headers; ``payload_bytes_*``: payload only)::

        before = clawcomm.comm_stats()
        ...  # a training step
        after = clawcomm.comm_stats()
        sent = after["all_gather"]["bytes_sent"] - before["all_gather"]["bytes_sent"]

    ``device="cuda"``: the CUDA tensors' communicator. Collectives it runs
    through CUDA IPC kernels count the payload peers read from this rank's
    buffers as sent and what it read from theirs as received.
    """
    return engine_of(group, device).comm_stats()
