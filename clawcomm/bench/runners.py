"""Runners: one per way of calling a collective, all with the same interface.

A runner turns (collective, count, dtype, redop, root) into two closures:
``step()`` runs the collective once on pre-filled buffers (what is timed),
and ``check()`` refills the inputs, runs it once more and returns
``(wrong elements, out-of-bounds writes)`` on this rank.

* ``TorchRunner``: torch.distributed on a process group (clawcomm with a given
  all-reduce algorithm, or gloo), exactly as user code calls it.
* ``EngineRunner``: clawcomm's engine on numpy arrays, below torch's dispatch
  (``clawcomm.engine_of(group)``).
* ``MpiRunner`` (in mpi_worker.py) does the same through mpi4py.
"""

from __future__ import annotations

import mmap

import numpy as np

from clawcomm.bench.collectives import (
    COLLECTIVES,
    GUARD,
    Collective,
    count_wrong,
    expected,
    inputs,
    uneven_splits,
)

SENTINEL = 77  # what guard elements hold; no pattern produces it


_HUGE_PAGE = 2 << 20
_pages = "huge"


def set_pages(kind: str) -> None:
    """`clawcomm bench --pages`: "huge" or "small", for every buffer after."""
    global _pages
    _pages = kind


def host_array(count: int, dtype) -> np.ndarray:
    """`count` elements of `dtype` for a benchmark buffer. Every system in a
    run (torch backends, the raw engine, MPI) gets its buffers here, so all
    move the same kind of memory. From 2 MiB up a buffer is an anonymous
    mapping aligned to 2 MiB, all of it on transparent huge pages (--pages
    huge, the default) or none of it (small). Left to malloc, a buffer's
    page size depends on where it happens to start (numpy asks for huge
    pages only on the aligned part of arrays from 4 MiB up, torch not at
    all), and a copy between processes out of small pages is about a third
    as fast on the reference machine: runs would measure the allocator."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if nbytes < _HUGE_PAGE:
        return np.empty(count, dtype=dtype)
    mm = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # shared would be shmem
    offset = -np.frombuffer(mm, np.uint8, count=1).ctypes.data % _HUGE_PAGE
    advice = mmap.MADV_HUGEPAGE if _pages == "huge" else mmap.MADV_NOHUGEPAGE
    mm.madvise(advice, offset, len(mm) - offset)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def _buffer(count: int, tdtype, device: str):
    """A tensor of `count` elements; on the CPU in host_array's memory."""
    import torch

    if device != "cpu" or count == 0:  # an empty byte tensor cannot be viewed as another type
        return torch.empty(count, dtype=tdtype, device=device)
    itemsize = torch.empty(0, dtype=tdtype).element_size()
    return torch.from_numpy(host_array(count * itemsize, np.uint8)).view(tdtype)


class Unsupported(Exception):
    """The runner cannot do this combination; the table shows n/a."""


class Prepared:
    def __init__(self, step, check):
        self.step = step
        self.check = check


def prepared(step, fill, want, dtype: str, output, guard_changes) -> Prepared:
    """Fills the inputs and returns the runner's closures. check() refills,
    runs once, and counts the elements of `output()` that differ from
    `want()` and the guard elements that changed (`guard_changes()`)."""

    def check():
        fill()
        step()
        return count_wrong(output(), want(), dtype), guard_changes()

    fill()
    return Prepared(step, check)


class TorchRunner:
    """torch.distributed on `group`, with tensors on `device` (cpu or cuda:
    the current CUDA device)."""

    def __init__(self, name: str, group, backend: str, device: str = "cpu"):
        self.name = name
        self.group = group
        self.backend = backend
        self.device = device

    def prepare(self, coll: Collective, count: int, dtype: str, redop: str, root: int):
        import torch
        import torch.distributed as dist

        from clawcomm._torch_names import all_gather_single, reduce_scatter_single

        if self.backend == "gloo" and redop == "avg":
            raise Unsupported("gloo has no AVG")
        if redop == "avg" and dtype not in ("float32", "float64", "float16", "bfloat16"):
            raise Unsupported("avg needs a floating point type")
        rank = dist.get_rank(self.group)
        n = dist.get_world_size(self.group)
        tdtype = getattr(torch, dtype)
        in_count, out_count = coll.counts(count, n, rank)
        op = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
            "avg": dist.ReduceOp.AVG,
        }[redop]
        g = self.group
        groot = dist.get_global_rank(g, max(root, 0)) if g is not None else root
        nxt = dist.get_global_rank(g, (rank + 1) % n) if g is not None else (rank + 1) % n
        prv = dist.get_global_rank(g, (rank - 1) % n) if g is not None else (rank - 1) % n

        dev = self.device
        full = _buffer(out_count + GUARD, tdtype, dev)
        full.fill_(SENTINEL)
        out = full[:out_count]
        inplace = coll.shape == "inplace"
        inp = out if inplace else _buffer(in_count, tdtype, dev)

        def fill():
            full.fill_(SENTINEL)
            src = torch.from_numpy(inputs(coll, rank, count, redop, n)).to(tdtype)
            inp.copy_(src)

        name = coll.name
        if name == "all_reduce":
            step = lambda: dist.all_reduce(out, op=op, group=g)
        elif name == "reduce_scatter":
            step = lambda: reduce_scatter_single(out, inp, op=op, group=g)
        elif name == "all_gather":
            step = lambda: all_gather_single(out, inp, group=g)
        elif name == "broadcast":
            step = lambda: dist.broadcast(out, src=groot, group=g)
        elif name == "reduce":
            step = lambda: dist.reduce(out, dst=groot, op=op, group=g)
        elif name == "all_to_all":
            step = lambda: dist.all_to_all_single(out, inp, group=g)
        elif name == "all_to_allv":
            splits = uneven_splits(count, n, coll.skew)
            send, recv = splits[rank].tolist(), splits[:, rank].tolist()
            step = lambda: dist.all_to_all_single(out, inp, recv, send, group=g)
        elif name == "sendrecv":

            def step():
                if n == 1:
                    out.copy_(inp)
                    return
                received = dist.irecv(out, src=prv, group=g)
                sent = dist.isend(inp, dst=nxt, group=g)
                sent.wait()
                received.wait()

        else:
            raise Unsupported(name)

        return prepared(
            step,
            fill,
            lambda: expected(coll, rank, count, redop, root, n),
            dtype,
            lambda: out.to(torch.float64).cpu().numpy(),
            lambda: int(
                np.count_nonzero(full[out_count:].to(torch.float64).cpu().numpy() != SENTINEL)
            ),
        )


class EngineRunner:
    """clawcomm's engine on numpy arrays: one Python call into C++, no torch."""

    def __init__(self, name: str, engine):
        self.name = name
        self.engine = engine

    def prepare(self, coll: Collective, count: int, dtype: str, redop: str, root: int):
        eng = self.engine
        rank, n = eng.rank, eng.size
        if redop == "avg" and dtype not in ("float32", "float64", "float16", "bfloat16"):
            raise Unsupported("avg needs a floating point type")
        # numpy has no bfloat16: hold it as uint16 and tell the engine.
        np_dtype = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
        engine_dtype = "bfloat16" if dtype == "bfloat16" else None
        if coll.shape == "uneven":
            raise Unsupported("the engine's binding takes even all-to-all splits")
        in_count, out_count = coll.counts(count, n, rank)
        op = "product" if redop == "prod" else redop

        full = host_array(out_count + GUARD, np_dtype)
        full.fill(SENTINEL)
        if dtype == "bfloat16":
            full[:] = _to_bf16_bits(np.full(full.size, SENTINEL, np.float64))
        out = full[:out_count]
        guard_fill = full[out_count:].copy()
        inplace = coll.shape == "inplace"
        inp = out if inplace else host_array(in_count, np_dtype)

        def fill():
            full[out_count:] = guard_fill
            src = inputs(coll, rank, count, redop, n)
            inp[:] = _to_bf16_bits(src) if dtype == "bfloat16" else src.astype(np_dtype)

        # Positional arguments: pybind11's keyword matching would cost more
        # than the engine's own work at 8 bytes.
        dt = engine_dtype
        name = coll.name
        if name == "all_reduce":
            step = lambda: eng.all_reduce(out, op, dt)
        elif name == "reduce_scatter":
            step = lambda: eng.reduce_scatter(inp, out, op, dt)
        elif name == "all_gather":
            step = lambda: eng.all_gather(inp, out, dt)
        elif name == "broadcast":
            step = lambda: eng.broadcast(out, root, dt)
        elif name == "reduce":
            step = lambda: eng.reduce(out, root, op, dt)
        elif name == "all_to_all":
            step = lambda: eng.all_to_all(inp, out, dt)
        elif name == "sendrecv":

            def step():
                if n == 1:
                    out[:] = inp
                    return
                eng.sendrecv(inp, (rank + 1) % n, out, (rank - 1) % n)

        else:
            raise Unsupported(name)

        return prepared(
            step,
            fill,
            lambda: expected(coll, rank, count, redop, root, n),
            dtype,
            lambda: _from_bf16_bits(out) if dtype == "bfloat16" else out,
            lambda: int(np.count_nonzero(full[out_count:] != guard_fill)),
        )


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    # Inputs are small integers, exact in bfloat16: truncation is exact too.
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _from_bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


__all__ = ["COLLECTIVES", "EngineRunner", "Prepared", "TorchRunner", "Unsupported", "prepared"]
