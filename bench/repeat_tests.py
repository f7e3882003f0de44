"""Runs multi-rank test files many times in a row, to find the races and
hangs that fail one run in twenty. Each file runs in its own pytest process,
``--times`` times; a failure is recorded (with its first error line and the
log kept) and the loop goes on. Prints a table and, with ``--json``, writes it.

    python3 bench/repeat_tests.py                       # every multi-rank file, 20 times
    python3 bench/repeat_tests.py tests/test_train.py --times 50
    python3 bench/repeat_tests.py --times 20 --json bench/results/repeat_tests.json

Every multi-rank file 20 times takes about 2 hours on the 2-core machine;
run it before landing a change to the engine's protocol, the scheduler or
the trainer (docs/tests.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files whose tests run in one process (no ranks): nothing to race.
SINGLE_PROCESS = {
    "test_codecs.py", "test_cuda_build.py", "test_docs.py", "test_house.py", "test_style.py",
    "test_gpu_kernels.py", "test_wire.py", "test_torch_suite.py",
}  # fmt: skip


def multi_rank_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True))
    return [
        os.path.relpath(f, ROOT)
        for f in files
        if os.path.basename(f) not in SINGLE_PROCESS and "torch_suite" not in f
    ]


def run_once(path: str, log_dir: str, i: int) -> tuple[bool, float, str]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    if proc.returncode in (0, 5):  # 5: every test skipped here (a GPU file without a GPU)
        return True, seconds, ""
    log = os.path.join(log_dir, f"{os.path.basename(path)}.{i}.log")
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    first = next((ln for ln in proc.stdout.splitlines() if ln.startswith(("E ", "FAILED"))), "")
    return False, seconds, f"{first[:200]} (log: {log})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "files", nargs="*", help="test files or FILE::test ids (default: every multi-rank file)"
    )
    p.add_argument("--times", type=int, default=20)
    p.add_argument("--logs", default="/tmp/clawcomm-repeat", help="where failed runs' logs go")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if args.times < 1:
        p.error(f"--times must be at least 1, got {args.times}")
    files = args.files or multi_rank_files()
    # A file, or one test of it (pytest's node id: FILE::test[params]).
    missing = [f for f in files if not os.path.exists(os.path.join(ROOT, f.split("::")[0]))]
    if missing:
        p.error(f"no such test file: {', '.join(missing)}")
    os.makedirs(args.logs, exist_ok=True)
    from tqdm import tqdm

    rows = []
    with tqdm(total=len(files) * args.times, unit="run", file=sys.stderr) as bar:
        for path in files:
            fails, took = [], []
            for i in range(args.times):
                ok, seconds, why = run_once(path, args.logs, i)
                took.append(seconds)
                if not ok:
                    fails.append(why)
                bar.update(1)
                bar.set_postfix(file=os.path.basename(path), failures=len(fails))
            rows.append(
                {"file": path, "runs": args.times, "failures": len(fails), "why": fails,
                 "median_s": sorted(took)[len(took) // 2]}
            )  # fmt: skip
    print(f"{'file':40s} {'runs':>5s} {'failed':>7s} {'median s':>9s}")
    for r in rows:
        print(f"{r['file']:40s} {r['runs']:5d} {r['failures']:7d} {r['median_s']:9.1f}")
        for why in r["why"]:
            print(f"    {why}")
    total = sum(r["failures"] for r in rows)
    print(f"# {total} failures in {sum(r['runs'] for r in rows)} runs of {len(rows)} files")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times": args.times, "files": rows}, f, indent=1)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
