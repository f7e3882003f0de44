"""The chaos suite's long run (tests/chaos/ runs a few trials of each family
in CI). Prints one scorecard line per family and writes them as JSON:

    python3 bench/chaos.py --json bench/results/chaos.json

Defaults are the figures issue 13 asks for: 100 kill trials (setup
included), 120 mismatches, 200 hangs (each of the 5 faults 20 times on shared
memory and 20 on TCP), 20 cut links, every bad setting and argument, 10^5 random
collectives in the soak, 10^4 hostile connections. About 25 minutes on the
2-core CI machine; --quick runs a tenth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from clawcomm.testing import chaos

AMOUNTS = {
    "kill": 100,
    "mismatch": 120,
    "hang": 200,
    "link": 20,
    "settings": 1,
    "timeout": 5,
    "soak": 100_000,
    "storm": 10_000,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(AMOUNTS), help="comma-separated (all)")
    p.add_argument("--quick", action="store_true", help="a tenth of every amount")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    scores = []
    for name in args.families.split(","):
        amount = AMOUNTS[name] if not args.quick else max(1, AMOUNTS[name] // 10)
        start = time.monotonic()
        score = chaos.FAMILIES[name](amount, seed=args.seed)
        score.extra["seconds"] = round(time.monotonic() - start, 1)
        print(score.line(), flush=True)
        for note in score.notes:
            print("   ", note[:300])
        scores.append(score)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(s) for s in scores], f, indent=1)
    return 0 if all(s.perfect for s in scores) else 1


if __name__ == "__main__":
    raise SystemExit(main())
