"""A longer fuzz run of the frame parser than the suite's (tests/test_wire.py
runs 3,000 cases): random well-formed streams of every frame kind, mutated,
fed to the messenger through the test hook ``clawcomm._C._feed_frames``.

    python3 bench/fuzz_frames.py --seconds 600 --seed 7

Each case must end in a clean parse or a clear error; a crash kills the
process (the finding: rerun with the same seed to reproduce it). This is a
random, not a coverage-guided, fuzzer: the parser is C++ built with g++, and
libFuzzer's coverage needs clang, which the CI machine does not have.
"""

from __future__ import annotations

import argparse

from clawcomm.testing.frames import fuzz_frames


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (60)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(fuzz_frames(seed=args.seed, cases=10**12, seconds=args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
