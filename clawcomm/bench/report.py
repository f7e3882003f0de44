"""nccl-tests-style tables, the JSON file and the busbw plot."""

from __future__ import annotations

import json
from collections import defaultdict

from clawcomm.bench.collectives import DTYPE_SHORT


def _groups(records):
    """Records grouped by table: (collective, redop) in first-seen order."""
    tables = defaultdict(list)
    for r in records:
        tables[(r["collective"], r["redop"])].append(r)
    return tables


def _variants(rows, reference):
    names = []
    for r in rows:
        if r["variant"] not in names:
            names.append(r["variant"])
    names.sort(key=lambda v: v != reference)
    return names


def format_tables(records, reference_of, world_size: int, header: str = "") -> str:
    """The tables, one per (collective, redop). `reference_of(collective)`
    names the variant the ratio columns divide by."""
    out = []
    ratios = False  # a table with a ratio column, which the footer explains
    for (coll, redop), rows in _groups(records).items():
        reference = reference_of(coll)
        variants = _variants(rows, reference)
        ratios = ratios or len(variants) > 1
        by = {(r["size"], r["variant"]): r for r in rows}
        sizes = sorted({r["size"] for r in rows})
        what = coll if redop == "-" else f"{coll} ({redop})"
        out.append(f"#\n# {what}, {world_size} ranks{header}")
        top = "#" + " " * 48 + f"{variants[0]:>31}"
        cols = "#       size      count      type  redop  root     time   algbw   busbw  #wrong"
        units = "#        (B) (elements)                            (us)  (GB/s)  (GB/s)        "
        for v in variants[1:]:
            top += f"{v:>40}"
            cols += "     time   busbw  #wrong   ratio"
            units += "     (us)  (GB/s)             (x)"
        out += [top, cols, units]
        for size in sizes:
            ref = by.get((size, variants[0]))
            first = next(by[(size, v)] for v in variants if (size, v) in by)
            line = (
                f"{size:12d} {first['count']:10d} {DTYPE_SHORT[first['dtype']]:>9} "
                f"{redop:>6} {first['root']:5d}"
            )
            line += _cells(ref, full=True)
            for v in variants[1:]:
                r = by.get((size, v))
                line += _cells(r, full=False)
                ok = r and ref and "error" not in r and "error" not in ref
                line += f" {r['time_us'] / ref['time_us']:7.2f}" if ok else "     n/a"
            out.append(line)
        oob = sum(r.get("oob", 0) for r in rows)
        out.append(f"# Out of bounds values : {oob} {'OK' if oob == 0 else 'FAILED'}")
        avgs = []
        for v in variants:
            bws = [r["busbw"] for r in rows if r["variant"] == v and "busbw" in r]
            if bws:
                avgs.append(f"{sum(bws) / len(bws):.3f} ({v})")
        out.append("# Avg bus bandwidth    : " + "   ".join(avgs))
        notes = sorted({f"{r['variant']}: {r['error']}" for r in rows if "error" in r})
        out += [f"# n/a  {n}" for n in notes]
    if ratios:
        out.append(
            "#\n# ratio = that variant's time / the first variant's time "
            "(above 1: the first is faster)"
        )
    return "\n".join(out)


def single_copy_line(pairs: dict) -> str:
    """``{(sender, receiver): bytes or None}`` as one header line: from which
    size each pair's payloads go by single copy (None: never, as between
    hosts or with CLAWCOMM_SINGLE_COPY=off)."""
    counts: dict = defaultdict(int)
    for threshold in pairs.values():
        counts[threshold] += 1
    parts = [
        ("never" if t is None else f"from {size_text(t)}") + f" on {k} pair{'s' * (k != 1)}"
        for t, k in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    ]
    return ("# clawcomm's single copy (each reader's measurement at setup, or "
            "CLAWCOMM_SINGLE_COPY_BYTES): " + ", ".join(parts))  # fmt: skip


def size_text(n: float) -> str:
    """Bytes in binary units, as -b/-e read them: 1 GiB is 2**30 bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _cells(r, full: bool) -> str:
    if r is None or "error" in r:
        return "      n/a     n/a     n/a     n/a" if full else "      n/a     n/a     n/a"
    if full:
        return f" {r['time_us']:8.2f} {r['algbw']:7.2f} {r['busbw']:7.2f} {r['wrong']:7d}"
    return f" {r['time_us']:8.2f} {r['busbw']:7.2f} {r['wrong']:7d}"


def write_json(path: str, payload: dict) -> None:
    """``payload`` as JSON, with its ``provenance`` (date, commit, machine:
    clawcomm/bench/provenance.py) unless it carries one."""
    from clawcomm.bench.provenance import provenance

    with open(path, "w") as f:
        json.dump({"provenance": provenance(), **payload}, f, indent=1)


def plot(path: str, records, memcpy_gbps: float | None, title: str) -> None:
    """busbw against size on log axes: one panel per table, one line per variant."""
    from clawcomm._optional import require

    require("matplotlib", "clawcomm bench --plot").use("Agg")
    import matplotlib.pyplot as plt

    tables = _groups(records)
    cols = min(len(tables), 4)  # then wrap: seven operations are two rows, not one strip
    nrows = (len(tables) + cols - 1) // cols
    fig, axes = plt.subplots(
        nrows, cols, figsize=(4.6 * cols, 3.8 * nrows), squeeze=False, sharey=True
    )
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(tables) :]:
        ax.set_visible(False)
    for ax, ((coll, redop), rows) in zip(flat, tables.items(), strict=False):
        for v in _variants(rows, None):
            pts = sorted(
                (r["size"], r["busbw"]) for r in rows if r["variant"] == v and "busbw" in r
            )
            pts = [(s, b) for s, b in pts if b > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=v)
        if memcpy_gbps:
            ax.axhline(memcpy_gbps, ls="--", color="grey", lw=1, label="memcpy (1 core)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_title(coll if redop == "-" else f"{coll} ({redop})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for row in axes:
        row[0].set_ylabel("bus bandwidth (GB/s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
