"""Each compression method's local pass on the CPU against the memory
bandwidth it touches, in one run (issue 24's figure: at least 50%).

For N float32 values (16M by default) it times, in --repeats rounds beside a copy:

* the quantisers' encode (csrc/compress/quantize_avx2.cc on AVX2): int8,
  int4, qsgd:4, qsgd:2, terngrad read 4N bytes and write N bits/8; sign also reads and
  writes its residual (12N more); the receiving side's decode-and-add of
  int8 reads N + 4N and writes 4N;
* threshold's fold + scan (reads gradient and residual, writes both: 16N);
* DGC's momentum correction (u = m u + g; v += u: 24N) and its sampled
  top-k over v (reads 4N);

and reports each as GB/s of the bytes it must touch and as a share of this
machine's copy bandwidth (numpy copyto of the same 64 MiB, which moves 8N).
PowerSGD's pass is matrix products, not a stream: its time for a
4096 x 4096 matrix at rank 4 is set against a 2-rank float32 all-reduce of
that matrix over TCP loopback, measured in the same run.

    python3 bench/method_passes.py --json bench/results/method_passes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from clawcomm import _C
from clawcomm.compression import CompressorState
from clawcomm.compression.powersgd import PowerSGD
from clawcomm.launch import run_ranks


def best_of(fn, repeats, setup=lambda: None):
    best = float("inf")
    for _ in range(repeats):
        setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def passes(n: int, repeats: int) -> list[dict]:
    """Each pass timed beside a copy: in each of `repeats` rounds, the copy
    then every pass, each the best of two; a pass's share of the copy is the
    median over rounds of its bandwidth against that round's copy, so a
    machine whose speed drifts (a shared 2-core VM's does) does not tilt it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    dst = np.empty_like(x)
    work = []  # (name, bytes touched, pass, setup)
    for name, bits, scale, block in [("int8", 8, "max", 256), ("int4", 4, "max", 256),
                                     ("qsgd:4", 4, "l2", 512), ("qsgd:2", 2, "l2", 128),
                                     ("terngrad", 2, "max", 256)]:  # fmt: skip
        codes = np.empty(n * bits // 8, np.uint8)
        scales = np.empty(n // block, np.float32)
        args = (x, codes, scales, bits, block, scale, True, 1)
        work.append((f"{name} encode", 4 * n + n * bits // 8,
                     lambda args=args: _C.compress.quantize(*args), None))  # fmt: skip
    r = np.zeros(n, np.float32)
    codes1, scales1 = np.empty(n // 8, np.uint8), np.empty(n // 1024, np.float32)
    work.append(("sign encode + residual", 16 * n + n // 8,
                 lambda: _C.compress.quantize(x, codes1, scales1, 1, 1024, "mean_abs", False, 1, r),
                 None))  # fmt: skip
    codes8, scales8 = np.empty(n, np.uint8), np.empty(n // 256, np.float32)
    _C.compress.quantize(x, codes8, scales8, 8, 256)
    out = np.zeros(n, np.float32)
    work.append(("int8 decode + add", 9 * n,
                 lambda: _C.compress.dequantize(codes8, scales8, out, 8, 256, "max", 0.5, True),
                 None))  # fmt: skip
    grad, res = np.empty_like(x), np.zeros_like(x)
    work.append(("threshold:2.5 fold + scan", 16 * n,
                 lambda: _C.compress.threshold_scan(res, 2.5, grad=grad),
                 lambda: np.copyto(grad, x)))  # fmt: skip
    g, u, v = torch.from_numpy(x), torch.zeros(n), torch.zeros(n)
    work.append(("dgc momentum correction", 24 * n, lambda: (u.mul_(0.9).add_(g), v.add_(u)), None))
    vn = v.numpy()
    work.append(("dgc top-0.1% of v", 4 * n,
                 lambda: _C.compress.topk(vn, n // 1000, "sampled", 1), None))  # fmt: skip
    copies, times = [], {name: [] for name, *_ in work}
    shares = {name: [] for name, *_ in work}
    for _ in tqdm(range(repeats), desc="rounds", leave=False):
        copy = best_of(lambda: np.copyto(dst, x), 2)
        copies.append(copy)
        for name, nbytes, fn, setup in work:
            t = best_of(fn, 2, setup or (lambda: None))
            times[name].append(t)
            shares[name].append((nbytes / t) / (8 * n / copy))
    rows = [{"pass": "memcpy (reference)", "ms": statistics.median(copies) * 1e3, "bytes": 8 * n,
             "share_of_copy": 1.0}]  # fmt: skip
    for name, nbytes, _, _ in work:
        rows.append({"pass": name, "ms": statistics.median(times[name]) * 1e3, "bytes": nbytes,
                     "share_of_copy": statistics.median(shares[name])})  # fmt: skip
    for row in rows:
        row["gb_per_s"] = row["bytes"] / (row["ms"] / 1e3) / 1e9
    return rows


def _dense_all_reduce(rank, world, numel, repeats):
    import torch.distributed as dist

    t = torch.randn(numel)
    dist.all_reduce(t)
    return best_of(lambda: dist.all_reduce(t), repeats)


def powersgd(repeats: int) -> dict:
    m = torch.randn(4096, 4096)
    c, state = PowerSGD(4), CompressorState()
    q = torch.randn(4096, 4)
    p = torch.empty(4096, 4)

    def low_rank():
        from clawcomm.compression.powersgd import orthogonalize

        orthogonalize(q)
        torch.matmul(m, q, out=p)
        orthogonalize(p)
        torch.matmul(m.t(), p, out=q)
        m.copy_(p @ q.t())

    t = best_of(low_rank, repeats)
    dense = max(run_ranks(_dense_all_reduce, 2, m.numel(), repeats,
                          env={"CLAWCOMM_TRANSPORT": "tcp"}, timeout=600))  # fmt: skip
    del c, state
    return {"powersgd_ms": t * 1e3, "dense_all_reduce_ms": dense * 1e3, "ratio": t / dense}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mvalues", type=int, default=16, help="values, in millions (16)")
    ap.add_argument("--repeats", type=int, default=9, help="rounds (9)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = passes(args.mvalues << 20, args.repeats)
    print(f"# {args.mvalues}M float32 values, medians of {args.repeats} rounds "
          "(each pass the best of 2, beside that round's copy)")  # fmt: skip
    print(f"# {'pass':30s} {'ms':>8s} {'GB/s':>7s} {'vs copy':>8s}")
    for row in rows:
        print(f"  {row['pass']:30s} {row['ms']:8.2f} {row['gb_per_s']:7.2f} "
              f"{row['share_of_copy']:8.0%}")  # fmt: skip
    low = powersgd(args.repeats)
    dense, ratio = low["dense_all_reduce_ms"], low["ratio"]
    print(f"  powersgd:4 on 4096x4096: {low['powersgd_ms']:.1f} ms against a 2-rank TCP "
          f"all-reduce of it, {dense:.1f} ms ({ratio:.0%})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"passes": rows, "powersgd": low, "mvalues": args.mvalues}, f, indent=1)


if __name__ == "__main__":
    main()
