"""Micro-benchmarks of clawcomm's CUDA kernels (csrc/cuda/) against a
device-to-device copy measured in the same run (GPU only).

Each kernel is timed with CUDA events (best of --repeats) and reported as
the bytes it must touch per call divided by its time, next to the copy's
rate (bytes read + written by torch's copy_ divided by its time), and as a
fraction of it. Top-k is also timed against torch.topk on the same data.
Every kernel's result was validated against the CPU kernels by
tests/test_gpu_kernels.py before it is timed here::

    python3 bench/gpu_kernels_bench.py --json bench/results/gpu_kernels.json

Bytes touched per element (float32 unless said): reduce 12 (read two,
write one), fp16 encode 6, fp16 decode-add 10, 16-bit error feedback 14
(read grad and residual, write residual and a 16-bit payload), top-k fold
16 + selection 4 (the pass over the residual) = 20, scatter-add 8 per pair
plus the sort, quantisation with feedback 12 + bits/8 + 4/block (the
scales), decode-add 8 + bits/8 + 4/block.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _time(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # warm-up (allocations, first-launch costs)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _profile_topk(call) -> None:
    """Each kernel of one sampled top-k call and its GPU time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_time > 0]
    print(f"# sampled top-k, one call: {len(events)} kernels, GPU time in us")
    for e in events:
        print(f"#   {e.device_time:9.1f}  {e.name[:90]}")
    print(f"#   {sum(e.device_time for e in events):9.1f}  total")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=100_000_000, help="elements (100M)")
    p.add_argument("--k", type=float, default=0.01, help="top-k fraction (0.01)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", metavar="FILE")
    p.add_argument(
        "--profile", action="store_true", help="also list the sampled top-k's kernels and times"
    )
    args = p.parse_args()
    from clawcomm import _C

    if not torch.cuda.is_available() or not getattr(_C, "cuda_built", False):
        print("gpu_kernels_bench: needs a GPU and a CUDA build of clawcomm", file=sys.stderr)
        return 2
    K, n, reps = _C.cuda, args.n, args.repeats
    s = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    a = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    out = torch.empty_like(a)
    h = torch.empty(n, dtype=torch.float16, device="cuda")
    rows = []
    copy = _time(lambda: out.copy_(a), reps)
    copy_gbps = 2 * 4 * n / copy / 1e9
    rows.append(("d2d copy (read + write)", copy, 8.0, None))

    def row(name, fn, bytes_per_elem, elems=n):
        t = _time(fn, reps)
        rows.append((name, t, bytes_per_elem * elems / n, None))

    row(
        "reduce sum float32",
        lambda: K.reduce(a.data_ptr(), b.data_ptr(), n, "float32", "sum", s()),
        12,
    )
    row(
        "from_float32 (fp16 encode)",
        lambda: K.from_float32(a.data_ptr(), h.data_ptr(), n, "float16", 1.0, s()),
        6,
    )
    row(
        "add_from16 (fp16 decode-add)",
        lambda: K.add_from16(out.data_ptr(), h.data_ptr(), n, "float16", 1.0, s()),
        10,
    )
    row(
        "encode16_feedback (fused)",
        lambda: K.encode16_feedback(
            a.data_ptr(), b.data_ptr(), h.data_ptr(), n, "float16", 1.0, s()
        ),
        14,
    )
    k = max(1, int(args.k * n))
    idx = torch.zeros(k, dtype=torch.int32, device="cuda")
    val = torch.zeros(k, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    ws = torch.empty(K.topk_workspace_bytes(n), dtype=torch.uint8, device="cuda")
    g = torch.randn(n, device="cuda")
    r = torch.zeros(n, device="cuda")
    for method in ("sampled", "exact"):
        row(
            f"topk_feedback {method} k={args.k:g}",
            lambda method=method: K.topk_feedback(
                g.data_ptr(),
                r.data_ptr(),
                n,
                k,
                idx.data_ptr(),
                val.data_ptr(),
                count.data_ptr(),
                ws.data_ptr(),
                method,
                1,
                s(),
            ),  # fmt: skip
            20,
        )
    if args.profile:
        _profile_topk(lambda: K.topk_feedback(
            g.data_ptr(), r.data_ptr(), n, k, idx.data_ptr(), val.data_ptr(),
            count.data_ptr(), ws.data_ptr(), "sampled", 1, s(),
        ))  # fmt: skip
    row("torch.topk(|x|) (reference)", lambda: torch.topk(a.abs(), k, sorted=False), 4)
    m = 8 * k
    sidx = torch.randint(0, n, (m,), dtype=torch.int32, device="cuda")
    sval = torch.randn(m, device="cuda")
    sws = torch.empty(K.scatter_add_workspace_bytes(m), dtype=torch.uint8, device="cuda")
    row(
        "scatter_add deterministic (8k pairs)",
        lambda: K.scatter_add(
            out.data_ptr(), n, sidx.data_ptr(), sval.data_ptr(), m, 1.0, True, sws.data_ptr(), s()
        ),
        8,
        m,
    )
    row(
        "scatter_add atomic (8k pairs)",
        lambda: K.scatter_add(
            out.data_ptr(), n, sidx.data_ptr(), sval.data_ptr(), m, 1.0, False, 0, s()
        ),
        8,
        m,
    )
    # Block quantisation with error feedback (compress/quantize.h on the GPU):
    # read x and the residual, write the residual, the codes and the scales;
    # decoding adds alpha * codes * scale into out (read codes, read and
    # write out).
    codes = torch.empty(n, dtype=torch.uint8, device="cuda")
    scales = torch.empty(n // 64 + 1, device="cuda")
    for bits, block, scale in ((8, 256, "max"), (2, 128, "l2")):
        if n % block:
            continue
        row(
            f"quantize {bits}-bit {scale} /{block} + feedback",
            lambda bits=bits, block=block, scale=scale: K.quantize(
                g.data_ptr(),
                codes.data_ptr(),
                scales.data_ptr(),
                n,
                bits,
                block,
                scale,
                True,
                7,
                r.data_ptr(),
                s(),
            ),  # fmt: skip
            12 + bits / 8 + 4 / block,
        )
        row(
            f"dequantize {bits}-bit accumulate",
            lambda bits=bits, block=block, scale=scale: K.dequantize(
                codes.data_ptr(),
                scales.data_ptr(),
                out.data_ptr(),
                n,
                bits,
                block,
                scale,
                1.0,
                True,
                s(),
            ),  # fmt: skip
            8 + bits / 8 + 4 / block,
        )
    print(f"# {torch.cuda.get_device_name()}, n = {n:,} float32, best of {reps}")
    print(f"{'kernel':40s} {'time ms':>9s} {'GB/s':>8s} {'of copy':>8s}")
    results = []
    for name, t, bpe, _ in rows:
        gbps = bpe * n / t / 1e9
        print(f"{name:40s} {t * 1e3:9.3f} {gbps:8.1f} {gbps / copy_gbps:8.0%}")
        results.append({"kernel": name, "seconds": t, "bytes": bpe * n, "GBps": gbps})
    topk = {row[0]: row[1] for row in rows}
    ratio = topk["torch.topk(|x|) (reference)"] / topk[f"topk_feedback sampled k={args.k:g}"]
    print(f"# sampled top-k is {ratio:.1f}x faster than torch.topk")
    if args.json:
        from clawcomm.bench.report import write_json  # with its provenance

        write_json(
            args.json,
            {"gpu": torch.cuda.get_device_name(), "n": n, "copy_GBps": copy_gbps, "rows": results},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
