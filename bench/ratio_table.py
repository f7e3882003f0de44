"""The ratio tables of docs/benchmarks.md, from ``clawcomm bench --json``
files: one row per operation, one column per size, each cell the other
system's time divided by clawcomm's (above 1: clawcomm is faster), the
second system's in brackets, bold where the first system is faster
(`--ours raw`: the engine alone, below torch's call path, as the divisor).

    python3 bench/ratio_table.py bench/results/collectives_2ranks.json
    python3 bench/ratio_table.py FILE.json --against mpi,gloo
    python3 bench/ratio_table.py FILE.json --ours raw --against mpi   # the engine alone
"""

from __future__ import annotations

import argparse
import json


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def ratio_table(payload: dict, against: list[str], ours: str = "clawcomm") -> str:
    times: dict[tuple[str, int, str], float] = {}
    ops: list[str] = []
    sizes: list[int] = []
    for r in payload["records"]:
        times[(r["collective"], r["size"], r["variant"])] = r["time_us"]
        if r["collective"] not in ops:
            ops.append(r["collective"])
        if r["size"] not in sizes:
            sizes.append(r["size"])
    sizes.sort()
    lines = [
        "| operation | " + " | ".join(_size(s) for s in sizes) + " |",
        "| --- |" + " --- |" * len(sizes),
    ]
    for op in ops:
        cells = []
        for s in sizes:
            mine = times.get((op, s, ours))
            ratios = [times.get((op, s, v)) for v in against]
            if mine is None or ratios[0] is None:
                cells.append("-")
                continue
            first = ratios[0] / mine
            cell = f"{first:.2f}"
            if len(ratios) > 1 and ratios[1] is not None:
                cell += f" ({ratios[1] / mine:.1f})"
            cells.append(f"**{cell}**" if first < 1 else cell)
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("json", help="a clawcomm bench --json file")
    p.add_argument("--against", default="mpi,gloo", help="systems, first one decides bold")
    p.add_argument("--ours", default="clawcomm", help="the divisor: clawcomm or raw")
    args = p.parse_args()
    with open(args.json) as f:
        payload = json.load(f)
    print(ratio_table(payload, args.against.split(","), args.ours))


if __name__ == "__main__":
    main()
