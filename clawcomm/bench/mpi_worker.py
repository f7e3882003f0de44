"""The MPI side of ``clawcomm bench --compare mpi``: the same sweep through
mpi4py, started by the bench under mpirun.

    mpirun -n 2 python -m clawcomm.bench.mpi_worker CONFIG.json OUT.json

CONFIG.json holds the sweep's Config; rank 0 writes the records to OUT.json.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from clawcomm.bench.collectives import (
    GUARD,
    Collective,
    expected,
    inputs,
    offsets,
    uneven_splits,
)
from clawcomm.bench.runners import SENTINEL, Unsupported, host_array, prepared, set_pages
from clawcomm.bench.sweep import Config, Sync, points, run_sweep


class MpiRunner:
    name = "mpi"

    def __init__(self, comm):
        self.comm = comm

    def prepare(self, coll: Collective, count: int, dtype: str, redop: str, root: int):
        from mpi4py import MPI

        if dtype in ("float16", "bfloat16"):
            raise Unsupported(f"MPI has no {dtype} reductions")
        if redop == "avg":
            raise Unsupported("MPI has no AVG")
        comm = self.comm
        rank, n = comm.Get_rank(), comm.Get_size()
        op = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[redop]
        in_count, out_count = coll.counts(count, n, rank)
        full = host_array(out_count + GUARD, dtype)
        full.fill(SENTINEL)
        out = full[:out_count]
        inplace = coll.shape == "inplace"
        inp = host_array(in_count, dtype)

        def fill():
            full[out_count:] = SENTINEL
            inp[:] = inputs(coll, rank, count, redop, n)
            if inplace:
                out[:] = inp

        name = coll.name
        # MPI's collectives are out of place; the in-place ones reduce from
        # `inp` into `out`, which moves the same bytes.
        if name == "all_reduce":
            step = lambda: comm.Allreduce(inp, out, op=op)
        elif name == "reduce_scatter":
            step = lambda: comm.Reduce_scatter_block(inp, out, op=op)
        elif name == "all_gather":
            step = lambda: comm.Allgather(inp, out)
        elif name == "broadcast":
            step = lambda: comm.Bcast(out, root=root)
        elif name == "reduce":
            step = lambda: comm.Reduce(inp, out if rank == root else None, op=op, root=root)
        elif name == "all_to_all":
            step = lambda: comm.Alltoall(inp, out)
        elif name == "all_to_allv":
            splits = uneven_splits(count, n, coll.skew)
            send = [inp, (splits[rank].tolist(), offsets(splits[rank]))]
            recv = [out, (splits[:, rank].tolist(), offsets(splits[:, rank]))]
            step = lambda: comm.Alltoallv(send, recv)
        elif name == "sendrecv":
            step = lambda: comm.Sendrecv(inp, (rank + 1) % n, 0, out, (rank - 1) % n, 0)
        else:
            raise Unsupported(name)

        return prepared(
            step,
            fill,
            lambda: expected(coll, rank, count, redop, root, n),
            dtype,
            lambda: out,
            lambda: int(np.count_nonzero(full[out_count:] != SENTINEL)),
        )


def main(argv: list[str]) -> None:
    from mpi4py import MPI

    config_path, out_path = argv
    with open(config_path) as f:
        options = json.load(f)
    cfg = Config(**options["config"])
    set_pages(cfg.pages)
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    runner = MpiRunner(comm)
    sync = Sync(
        barrier=comm.Barrier,
        max=lambda v: comm.allreduce(v, op=MPI.MAX),
        sum=lambda v: comm.allreduce(v, op=MPI.SUM),
    )
    names = lambda _collective: ["mpi"]
    progress = None
    if comm.Get_rank() == 0 and options.get("progress", True):
        from tqdm import tqdm

        total = sum(1 for _ in points(cfg))
        progress = tqdm(total=total, file=sys.stderr, unit="pt", leave=False, dynamic_ncols=True)
    records = run_sweep({"mpi": runner}, cfg, n, sync, names, progress)
    if progress is not None:
        progress.close()
    if comm.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1:])
