"""Where a small CUDA all-reduce's time goes (GPU only): per call, the host's
time to issue it, the kernel's time on the GPU, and the rate calls complete
at when issued back to back, through the clawcomm backend's CUDA IPC path.

    python3 bench/gpu_latency.py --nproc 2 --json bench/results/gpu_latency.json

Columns, per size (2 ranks on one GPU share it under MPS; with one GPU per
rank the same script runs unchanged, rank r on cuda:r):
  per op      back-to-back calls, from the first issue to the last completion,
              divided by the calls (what `clawcomm bench` reports)
  host        time to issue one call (dist.all_reduce returning), no sync
  kernel      the IPC kernel's own duration (torch.profiler's CUDA events),
              median over the calls
  floor       torch's no-op backend ("fake") issuing the same call: what
              torch.distributed itself costs, whatever the backend
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from clawcomm.bench.report import write_json
from clawcomm.launch import run_ranks

SIZES = [8, 4096, 65536, 262144, 1 << 20, 8 << 20]


def _issue_time(x, calls, group=None):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x, group=group)
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued / calls, (time.perf_counter() - t0) / calls


def _kernel_time(x, calls):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dist.all_reduce(x)
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if "ipcKernel" in e.name and e.device_time > 0]
    return statistics.median(times) if times else float("nan")


def _host_breakdown(x, calls):
    """The CUDA runtime calls one all_reduce makes on the host, and their
    time, per call (torch.profiler's CPU events): where the host time goes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dist.all_reduce(x)
        torch.cuda.synchronize()
    per, ops = {}, {}
    for e in prof.key_averages():
        if e.key.startswith("cuda") and e.key != "cudaDeviceSynchronize":
            per[e.key] = (e.count / calls, e.cpu_time_total / calls)
        elif e.self_cpu_time_total > 0 and e.key != "cudaDeviceSynchronize":
            ops[e.key] = (e.count / calls, e.self_cpu_time_total / calls)
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:8]
    return dict(sorted(per.items(), key=lambda kv: -kv[1][1])), dict(top)


def _fake_group():
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

        return dist.new_group(backend="fake")
    except Exception:  # noqa: BLE001  (no fake backend in this torch: no floor column)
        return None


def _worker(rank, n, calls):
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    import clawcomm

    fake = _fake_group()
    rows = []
    for size in SIZES:
        x = torch.ones(max(1, size // 4), device=dev)
        for _ in range(20):
            dist.all_reduce(x)  # warm-up: the IPC group, the pools
        host, per_op = _issue_time(x, calls)
        kernel = _kernel_time(x, min(calls, 200))
        floor = _issue_time(x, calls, fake)[0] if fake is not None else float("nan")
        rows.append(
            {
                "size": size,
                "per_op_us": per_op * 1e6,
                "host_us": host * 1e6,
                "kernel_us": kernel,
                "floor_us": floor * 1e6,
            }
        )
    x = torch.ones(262144 // 4, device=dev)
    breakdown, ops = _host_breakdown(x, min(calls, 500))
    status = clawcomm.backend_of(device="cuda").cuda_ipc_status()
    return {
        "rows": rows,
        "breakdown_256k": breakdown,
        "cpu_ops_256k": ops,
        "status": status,
        "gpu": torch.cuda.get_device_name(dev),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = run_ranks(_worker, args.nproc, args.calls, timeout=600)[0]
    print(f"# {args.nproc} ranks, {out['gpu']}, CUDA IPC status {out['status']}")
    print(f"# {'size (B)':>10} {'per op':>9} {'host':>9} {'kernel':>9} {'floor':>9}   (us)")
    for r in out["rows"]:
        print(
            f"  {r['size']:>10} {r['per_op_us']:>9.2f} {r['host_us']:>9.2f} "
            f"{r['kernel_us']:>9.2f} {r['floor_us']:>9.2f}"
        )
    print("# CUDA runtime calls per 256 KiB all_reduce on the host: calls, us")
    for name, (count, us) in out["breakdown_256k"].items():
        print(f"  {name:<34} {count:>5.1f} {us:>8.2f}")
    print("# other host work per 256 KiB all_reduce (profiler's CPU ops, self time): calls, us")
    for name, (count, us) in out["cpu_ops_256k"].items():
        print(f"  {name[:34]:<34} {count:>5.1f} {us:>8.2f}")
    if args.json:
        write_json(args.json, {"nproc": args.nproc, **out})  # with its provenance


if __name__ == "__main__":
    main()
