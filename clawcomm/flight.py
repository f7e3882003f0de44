"""``clawcomm flight DIR``: which ranks are missing from which operation.

A communicator that fails (a timeout, a dead peer, ranks calling different
collectives) writes its flight record, its last operations with their
state, and names the file in its error. A job writes one folder,
``<CLAWCOMM_FLIGHT_DIR>/<job token>/``: the first group's records (the
default group's, under torch) as ``rank<r>.json``, every other group's
(a dp x pp run's pipeline and data-parallel groups) in
``group-<token>/rank<r>.json`` beside them. Point this command at the job's
folder (or at one group's)::

    clawcomm flight /tmp/clawcomm-flight/1bcf244e98326bc3

The first line names the culprit where a rank's record names one: the
rank, host and pid that held the group up (stopped, not yet at the call,
or in another call; docs/reliability.md). Then, for each group that failed,
it reads every rank's record and reports the first collective that did
not complete everywhere: the ranks that reached it (and whether they were
waiting in it or failed), the ranks that never called it and the last
collective they did call, ranks that called a different collective under
the same number, pending sends and receives, and ranks that wrote no record
at all (still running, killed, or stuck outside clawcomm).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys


def load(directory: str) -> dict[int, dict]:
    """rank -> its flight record, for every rank<r>.json in `directory` (one
    group's)."""
    out = {}
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        with open(path) as f:
            record = json.load(f)
        out[int(record["rank"])] = record
    return out


def load_job(directory: str) -> dict[str, dict[int, dict]]:
    """Each group's records in a job's folder: "" for the folder's own
    ``rank<r>.json``, the subfolder's name for each ``group-<token>/``."""
    groups = {"": load(directory)}
    for sub in sorted(glob.glob(os.path.join(directory, "group-*"))):
        groups[os.path.basename(sub)] = load(sub)
    return {name: records for name, records in groups.items() if records}


def _members(records: dict[int, dict]) -> str:
    mapping = next((r["global_ranks"] for r in records.values() if "global_ranks" in r), None)
    return f"ranks {mapping}" if mapping else "every rank"


def _describe(op: dict) -> str:
    what = f"{op['op']} #{op['seq']}" if "seq" in op else op["op"]
    if op["op"] in ("send", "recv"):
        direction = "to" if op["op"] == "send" else "from"
        return f"{what} of {op['bytes']} bytes {direction} rank {op['peer']}"
    if op["op"] == "barrier" or not op.get("count"):
        return what
    return f"{what} of {op['count']} {op['dtype']} elements"


def diagnose(records: dict[int, dict]) -> list[str]:
    """The report, one line per finding."""
    if not records:
        return ["no flight records found"]
    size = max(r["size"] for r in records.values())
    # A group that is not the world: its records say the job's rank of each
    # of its ranks, which the report names first.
    mapping = next((r["global_ranks"] for r in records.values() if "global_ranks" in r), None)

    def who(r: int) -> str:
        return f"rank {mapping[r]} (group rank {r})" if mapping else f"rank {r}"

    def whom(ranks: list[int]) -> str:
        return (
            f"ranks {[mapping[r] for r in ranks]} (group ranks {ranks})"
            if mapping
            else (f"ranks {ranks}")
        )

    lines = []
    for rank in sorted(records):
        lines.append(f"{who(rank)} failed: {records[rank]['why']}")
    silent = [r for r in range(size) if r not in records]
    if silent:
        lines.append(
            f"{whom(silent)} wrote no flight record: they did not see the failure (still running, "
            "killed, or stuck outside clawcomm)"
        )
    collectives = {
        rank: {op["seq"]: op for op in rec["ops"] if "seq" in op} for rank, rec in records.items()
    }
    pending = sorted(
        {seq for ops in collectives.values() for seq, op in ops.items() if op["state"] != "done"}
    )
    if pending:
        seq = pending[0]
        at = {rank: ops[seq] for rank, ops in collectives.items() if seq in ops}
        kinds = {(op["op"], op["count"], op["dtype"]) for op in at.values()}
        if len(kinds) > 1:
            calls = ", ".join(f"{who(r)}: {_describe(op)}" for r, op in sorted(at.items()))
            lines.append(f"collective #{seq} differs between ranks: {calls}")
        else:
            op = next(iter(at.values()))
            states = ", ".join(f"{who(r)} {o['state']}" for r, o in sorted(at.items()))
            lines.append(f"first collective not completed everywhere: {_describe(op)} ({states})")
        missing = [r for r in range(size) if r in collectives and seq not in collectives[r]]
        for r in missing:
            last = max(collectives[r], default=None)
            before = f"its last collective was #{last}" if last is not None else "it issued none"
            lines.append(f"{who(r)} is missing from collective #{seq}: {before}")
        if silent:
            lines.append(f"{whom(silent)} may be missing from collective #{seq} (no record)")
    for rank, rec in sorted(records.items()):
        for op in rec["ops"]:
            if "seq" not in op and op["state"] in ("queued", "started", "failed"):
                lines.append(f"{who(rank)}: {_describe(op)} {op['state']}, not completed")
    return lines


def culprit(groups: dict[str, dict[int, dict]]) -> str | None:
    """Who held the job up, as the failing ranks' records name it. Each
    record's verdict is a vote for the rank its first clause names; the
    rank with the strongest evidence wins, then the most votes. Evidence,
    strongest first: what a rank saw of the culprit itself (stopped, not
    called, another call, a link's unacknowledged bytes); only that nothing
    came from it over TCP (both sides of a cut say so of each other); only
    that it is still inside an earlier collective (held up itself). A rank
    that failed on a peer's word votes with the verdict it carries."""
    texts = []
    for records in groups.values():
        for record in records.values():  # one vote a rank: its own verdict, or the one it carries
            if record.get("culprit"):
                texts.append(record["culprit"].removeprefix("held up by "))
                continue
            found = re.search(r"held up by (.*?)(?: \(flight record: |$)", record["why"])
            if found:
                texts.append(found.group(1))
    if not texts:
        return None

    def strength(text: str) -> int:
        first = text.split("; and by ", 1)[0]
        if "it is still in " in first:
            return 0
        return 1 if "nothing came from it over TCP" in first else 2

    votes: dict[str, list[str]] = {}
    for text in texts:
        who = re.match(r"(rank \d+ \([^)]*\))", text)
        votes.setdefault(who.group(1) if who else text, []).append(text)
    best = max(votes.values(), key=lambda ts: (max(map(strength, ts)), len(ts)))
    return max(best, key=strength)


def report(directory: str) -> list[str]:
    """What the command prints for a job's folder (or one group's)."""
    groups = load_job(directory)
    lines = []
    named = culprit(groups)
    if named:
        lines.append(f"culprit: {named}")
    for k, (name, records) in enumerate(groups.items()):
        if len(groups) > 1:
            lines.append(
                ("" if k == 0 else "\n") + f"# group {name or 'of the job'}: {_members(records)}"
            )
        lines.extend(diagnose(records))
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="the job's folder, named in the error (or one group's)")


def run(args) -> int:
    if not os.path.isdir(args.directory):
        print(f"clawcomm flight: error: {args.directory} is not a folder (the error that named a "
              "flight record gives its job's folder)", file=sys.stderr)  # fmt: skip
        return 2
    if not load_job(args.directory):
        print(f"clawcomm flight: no flight records in {args.directory} (rank<r>.json, or "
              "group-*/rank<r>.json)", file=sys.stderr)  # fmt: skip
        return 1
    for line in report(args.directory):
        print(line)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clawcomm flight", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
