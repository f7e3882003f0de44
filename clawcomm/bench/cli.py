"""``clawcomm bench``: nccl-tests-style bandwidth tables for clawcomm, with
gloo, MPI and clawcomm's raw engine side by side in the same run.

    clawcomm bench                                  # all_reduce, 2 local ranks, 8 B .. 64 MiB
    clawcomm bench --nproc 4 -o all_reduce,all_gather -b 1K -e 16M --compare gloo,mpi
    clawcomm bench --algo ring,tree,auto --json runs/out.json --plot runs/out.png
    torchrun --nnodes 2 --nproc-per-node 2 ... -m clawcomm.bench --compare gloo

Flags follow nccl-tests: -b/-e/-f (sizes), -n (iterations per timed block;
0 = as many as fit in about 40 ms), -w (warm-up), -o (operations:
collectives and/or reduction ops), -d (type), -r (root), -c (check
results). Each point times --repeats blocks, interleaved across backends,
and keeps the best.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from clawcomm import outputs
from clawcomm.bench.collectives import COLLECTIVES, DETERMINISTIC, DTYPE_ALIASES, REDOPS
from clawcomm.launch import check_settings, under_torchrun

COMPARE_CHOICES = ("gloo", "mpi", "raw", "nccl")
ALGO_CHOICES = (
    "ring",
    "tree",
    "hierarchical",
    "oneshot",
    "twoshot",
    "direct",
    "scatter_allgather",
    "reducescatter_gather",
    "auto",
    "deterministic",
)


def _algorithms(text: str) -> list[str]:
    """--algo: CLAWCOMM_ALGO values, one per variant (a name, which applies
    to every op that has it, or op:name), checked by the engine's own rule;
    or "deterministic", a group with CLAWCOMM_DETERMINISTIC=1."""
    from dataclasses import asdict

    from clawcomm import _C
    from clawcomm.cost_model import CostModel

    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"algorithm {text!r} not one of {', '.join(ALGO_CHOICES)}")
    for item in items:
        if item == DETERMINISTIC:  # CLAWCOMM_DETERMINISTIC=1, not a CLAWCOMM_ALGO value
            continue
        try:
            _C._choose_algorithm("all_reduce", 8, [0], asdict(CostModel()), item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("clawcomm: ")) from None
    return items


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '2G' -> bytes (binary multiples, as nccl-tests)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    try:
        value = int(float(digits) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 8, 64K, 1M") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size {text!r} is negative")
    return value


def _csv(choices, what):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{what} {', '.join(bad) or repr(text)} not one of {', '.join(choices)}"
            )
        return items

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20, help="largest (64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (2)")
    p.add_argument(
        "-i", "--stepbytes", type=parse_size, default=0, help="fixed size step (instead of -f)"
    )
    p.add_argument(
        "-n", "--iters", type=int, default=0, help="timed iterations per block (0: auto, ~40 ms)"
    )
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations (5)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed blocks per point, interleaved across backends; the best counts (3)",
    )
    p.add_argument(
        "--pages",
        choices=("huge", "small"),
        default="huge",
        help="CPU buffers of 2 MiB or more, for every system alike: 2 MiB-aligned on "
        "transparent huge pages (huge, the default) or on 4 KiB pages (small, as torch's "
        "allocator gives without THP_MEM_ALLOC_ENABLE=1)",
    )
    p.add_argument(
        "-o",
        "--op",
        default="all_reduce,sum",
        help="comma list of collectives (" + ", ".join(COLLECTIVES) + ") and/or reduction "
        "ops (" + ", ".join(REDOPS) + ", all); default all_reduce,sum",
    )
    p.add_argument(
        "-d",
        "--datatype",
        default="float",
        help="float (default), half, bfloat16, " "double, int8, uint8, int32, int64",
    )
    p.add_argument(
        "--skew",
        type=float,
        default=1.0,
        help="all_to_allv: how unevenly each rank splits what it sends, as a router splits "
        "tokens over experts: receiver r gets a share proportional to (r + 1) ** -skew, the "
        "same at every sender (0: nearly even; 1, the default: rank 0 takes 2/3 at 2 ranks)",
    )
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast/reduce (0)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check results (1)")
    p.add_argument(
        "--algo",
        type=_algorithms,
        default=["auto"],
        help="algorithms to compare, one variant each: ring, tree, hierarchical, direct, "
        "scatter_allgather, reducescatter_gather, auto, or op:name (e.g. broadcast:tree); a "
        "bare name applies to every op that has it, the others run auto (default auto); "
        "deterministic: a group with CLAWCOMM_DETERMINISTIC=1 (its reductions)",
    )
    p.add_argument(
        "--compare",
        type=_csv(COMPARE_CHOICES, "backend"),
        default=[],
        help="add gloo (torch.distributed), mpi (mpi4py under mpirun), raw "
        "(clawcomm's engine on numpy, below torch's dispatch) and/or nccl (--device cuda; "
        "n/a where NCCL refuses several ranks on one GPU)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the tensors live (cpu). cuda: rank r uses GPU r %% device count, so "
        "ranks share a GPU when there are fewer GPUs than ranks",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default=None,
        help="clawcomm transport (sets CLAWCOMM_TRANSPORT)",
    )
    p.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    p.add_argument(
        "--calibrate",
        metavar="FILE",
        help="instead of the tables: measure the cost model's latencies and bandwidths "
        "(shared memory, network, reduction) and write a model file for "
        "CLAWCOMM_COST_MODEL and clawcomm simulate",
    )
    p.add_argument("--plot", metavar="FILE", help="draw busbw against size (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def sizes_from(args) -> list[int]:
    lo, hi = args.minbytes, args.maxbytes
    if hi < lo:
        raise ValueError(f"-e {hi} is smaller than -b {lo}")
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        if args.stepbytes:
            size += args.stepbytes
        else:
            if args.stepfactor < 2:
                raise ValueError(f"-f {args.stepfactor}: the step factor must be at least 2")
            size = size * args.stepfactor if size else 1
    return sizes


def parse_ops(text: str) -> tuple[list[str], list[str]]:
    collectives, redops = [], []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        if item in COLLECTIVES:
            collectives.append(item)
        elif item == "all":
            redops += [r for r in REDOPS if r not in redops]
        elif item in REDOPS:
            redops.append(item)
        else:
            raise ValueError(
                f"-o {item!r} is neither a collective ({', '.join(COLLECTIVES)}) nor a "
                f"reduction op ({', '.join(REDOPS)}, all)"
            )
    return collectives or ["all_reduce"], redops or ["sum"]


def memcpy_ceiling(nbytes: int = 64 << 20, repeats: int = 10) -> float:
    """One core's copy bandwidth (GB/s): best of `repeats` numpy.copyto,
    between buffers of the run's kind of pages (runners.host_array)."""
    import numpy as np

    from clawcomm.bench.runners import host_array

    src = host_array(nbytes // 8, np.float64)
    dst = host_array(nbytes // 8, np.float64)
    src.fill(1.0)
    dst.fill(0.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def machine_info() -> dict:
    import torch

    from clawcomm import _C

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "simd": _C.kernels.simd_level(),
    }


def _mpi_available() -> str | None:
    """None if MPI can run, else why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (docs/benchmarks.md: 'Comparing with MPI')"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (docs/benchmarks.md: 'Comparing with MPI')"
    return None


def run_mpi(options: dict, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="clawcomm-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "out.json")
        with open(cfg_path, "w") as f:
            json.dump(options, f)
        cmd = ["mpirun", "-n", str(nproc), "--oversubscribe"]
        env = dict(os.environ)
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += [sys.executable, "-m", "clawcomm.bench.mpi_worker", cfg_path, out_path]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=None, text=True)
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"mpirun failed (exit {proc.returncode}): {proc.stdout[-2000:]}")
        with open(out_path) as f:
            return json.load(f)


def run(args, argv: list[str] | None = None) -> int:
    """Runs the bench for parsed `args`; `argv` (the flags as typed) is
    recorded in the JSON so a result file says how to reproduce it."""
    from clawcomm.bench.report import format_tables, plot, single_copy_line, write_json
    from clawcomm.bench.torch_worker import clawcomm_name, rank_main, reference_algo

    if args.calibrate:
        from clawcomm.bench import calibrate

        return calibrate.run(args.calibrate, under_torchrun())

    try:
        check_settings()  # every CLAWCOMM_* setting, before any rank starts
        sizes = sizes_from(args)
        collectives, redops = parse_ops(args.op)
        if args.datatype not in DTYPE_ALIASES:
            raise ValueError(
                f"-d {args.datatype!r} is not one of {', '.join(sorted(DTYPE_ALIASES))}"
            )
        dtype = DTYPE_ALIASES[args.datatype]
        torchrun = under_torchrun()
        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
        if world < 1:
            raise ValueError(f"--nproc {args.nproc}: need at least one rank")
        if not 0 <= args.root < world:
            raise ValueError(f"-r {args.root} is not a rank of {world}")
        if args.warmup_iters < 1 or args.iters < 0 or args.repeats < 1:
            raise ValueError("-w and --repeats must be at least 1, -n at least 0")
        if args.device == "cuda":
            import torch

            if not (torch.backends.cuda.is_built() and torch.cuda.device_count() > 0):
                raise ValueError("--device cuda: no CUDA GPU (or torch is a CPU build)")
            if "raw" in args.compare or "mpi" in args.compare:
                raise ValueError("--device cuda compares with gloo and nccl, not raw or mpi")
        elif "nccl" in args.compare:
            raise ValueError("--compare nccl needs --device cuda")
        if not torchrun or os.environ.get("RANK") == "0":
            outputs.check("--json", args.json)
            outputs.check("--plot", args.plot)
    except ValueError as e:  # (an outputs.OutputError too)
        print(f"clawcomm bench: error: {e}", file=sys.stderr)
        return 2

    options = {
        "config": {
            "collectives": collectives,
            "sizes": sizes,
            "dtype": dtype,
            "redops": redops,
            "root": args.root,
            "warmup": args.warmup_iters,
            "iters": args.iters,
            "check": bool(args.check),
            "repeats": args.repeats,
            "pages": args.pages,
            "skew": args.skew,
        },
        "algos": args.algo,
        "compare": [c for c in args.compare if c != "mpi"],
        "progress": not args.quiet,
        "device": args.device,
    }
    # The ranks' CLAWCOMM_TRANSPORT; this process's environment is left alone.
    transport = args.transport or os.environ.get("CLAWCOMM_TRANSPORT", "auto")
    reference = clawcomm_name(reference_algo(args.algo), args.algo)
    info = machine_info()
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    from clawcomm.bench.runners import set_pages

    set_pages(args.pages)
    memcpy = memcpy_ceiling() if rank == 0 else None

    if torchrun:
        import torch.distributed as dist

        import clawcomm  # noqa: F401

        os.environ["CLAWCOMM_TRANSPORT"] = transport  # this process is a rank
        dist.init_process_group("clawcomm")
        try:
            result = rank_main(rank, world, options)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        from clawcomm.launch import run_ranks

        result = run_ranks(
            rank_main,
            world,
            options,
            timeout=24 * 3600,
            pg_timeout=600,
            env={"CLAWCOMM_TRANSPORT": transport},
        )[0]
    records, d2d = result["records"], result.get("d2d_GBps")

    notes = []
    if "mpi" in args.compare:
        why_not = "not run under torchrun (start it with mpirun yourself)" if torchrun else None
        why_not = why_not or _mpi_available()
        if why_not:
            notes.append(f"# mpi: skipped: {why_not}")
        else:
            records += run_mpi(options, world)

    header = (
        f", {DTYPE_ALIASES[args.datatype]}, "
        f"{'-n ' + str(args.iters) if args.iters else '-n auto'} -w {args.warmup_iters}"
    )
    print(
        f"# clawcomm bench: {world} ranks, transport "
        f"{transport}, sizes {sizes[0]}..{sizes[-1]} B"
    )
    print(
        f"# {info['cpu']}, {info['cores']} cores, torch {info['torch']}, " f"kernels {info['simd']}"
    )
    if args.device == "cuda":
        print(
            f"# device {result['gpu']}; device-to-device copy (256 MiB, best of 10): {d2d:.1f} GB/s"
        )
    else:
        print(f"# memcpy ceiling (one core, 64 MiB numpy.copyto, best of 10): {memcpy:.2f} GB/s")
        if result.get("engine_floor_s"):
            print(
                f"# engine floor (the raw engine's 8-byte all-reduce, no torch, best of 3 x 1000 "
                f"calls, slowest rank): {result['engine_floor_s'] * 1e6:.2f} us"
            )
        print(f"# buffers from 2 MiB up on {args.pages} pages (--pages), for every system")
        if result.get("single_copy"):
            print(single_copy_line(result["single_copy"]))
    for note in notes:
        print(note)
    print(format_tables(records, lambda _coll: reference, world, header))
    wrong = sum(r.get("wrong", 0) + r.get("oob", 0) for r in records)
    if args.json:
        write_json(
            args.json,
            {
                "command": shlex.join(["clawcomm", "bench", *(argv or [])]),
                "world_size": world,
                "machine": info,
                "memcpy_GBps": memcpy,
                "engine_floor_s": result.get("engine_floor_s"),
                "device": args.device,
                "gpu": result.get("gpu"),
                "d2d_copy_GBps": d2d,
                "options": options,
                "reference": reference,
                "single_copy": [[s, r, b] for (s, r), b in result.get("single_copy", {}).items()],
                "records": records,
            },
        )
        outputs.wrote("clawcomm bench", "results", args.json)
    if args.plot:
        where = result.get("gpu") if args.device == "cuda" else info["cpu"]
        plot(
            args.plot,
            records,
            d2d if args.device == "cuda" else memcpy,
            f"clawcomm bench, {world} ranks, {where}",
        )
        outputs.wrote("clawcomm bench", "plot", args.plot)
    if wrong:
        print(f"# FAILED: {wrong} wrong or out-of-bounds elements", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clawcomm.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(argv), argv)
