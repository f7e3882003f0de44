"""Does a step wait for data, and does memory grow with the corpus? The GPT
at dp 2 trained from a generated token file of 1 GB (and, for comparison,
of 10 MB), prefetched and not (``--prefetch 0``): the median wait for a
batch against the median step, and the ranks' peak resident memory.

    python3 bench/data_stall.py > bench/results/data_stall.txt

The token files are random uint16 ids below 256 (a made-up vocabulary),
written once under --dir and removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

CHUNK = 1 << 26  # ids written per piece (128 MB)


def write_tokens(path: str, size_bytes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = size_bytes // 2
        while left:
            n = min(left, CHUNK)
            rng.integers(0, 256, n, dtype=np.uint16).tofile(f)
            left -= n
    with open(os.path.join(os.path.dirname(path), "meta.json"), "w") as f:
        json.dump({"dtype": "uint16", "vocab": 256}, f)


def run(path: str, steps: int, prefetch: int, metrics: str) -> dict:
    cmd = [sys.executable, "-c", "import sys; from clawcomm.cli import main; sys.exit(main())",
           "train", "--data", path, "--dp", "2",
           "--steps", str(steps), "--prefetch", str(prefetch), "--quiet",
           "--metrics", metrics]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f][steps // 2 :]  # the steady second half
    wait = statistics.median(r["data_wait_ms"] for r in rows)
    step = statistics.median(r["step_ms"] for r in rows)
    return {"wait_ms": wait, "step_ms": step, "rss_mb": max(r["max_rss_mb"] for r in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    print("# clawcomm train --data FILE --dp 2 (GPT, defaults), median of the second half")
    print(f"# {'file':>8} {'prefetch':>8} {'data wait ms':>12} {'step ms':>8} "
          f"{'wait/step':>9} {'peak RSS MB':>11}")  # fmt: skip
    for size, label in ((10 << 20, "10 MB"), (1 << 30, "1 GB")):
        folder = tempfile.mkdtemp(dir=args.dir, prefix="clawcomm-tokens-")
        path = os.path.join(folder, "train.bin")
        write_tokens(path, size)
        try:
            for prefetch in (2, 0):
                r = run(path, args.steps, prefetch, os.path.join(folder, "m.jsonl"))
                os.remove(os.path.join(folder, "m.jsonl"))
                share = 100 * r["wait_ms"] / r["step_ms"]
                print(f"  {label:>8} {prefetch:>8} {r['wait_ms']:>12.3f} {r['step_ms']:>8.1f} "
                      f"{share:>8.2f}% {r['rss_mb']:>11.0f}")  # fmt: skip
        finally:
            if not args.keep:
                for name in os.listdir(folder):
                    os.remove(os.path.join(folder, name))
                os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
