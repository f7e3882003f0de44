"""What every chaos family shares: the score, the job's settings, the
harness that runs a trial's ranks, and the leak check."""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass, field

TIMEOUT = 3.0  # the group's timeout in every trial (s)
SLACK = 1.0  # an error must come within TIMEOUT + SLACK of its cause
# The soak's limits after warm-up. The heap (malloc's bytes in use, every
# arena) is exact: a flat run's floors stay within 4 KB over 20,000 ops, so
# it must not keep rising by 16 bytes an op. The resident set (sampled after
# malloc_trim) is the backstop for what malloc does not see (Python's
# arenas, mmaps): its floors swing with the pages, by up to 0.34% in CI's
# full suite (a 288 MB process), so it must not keep rising by 1%.
SOAK_HEAP_GROWTH_LIMIT = 16.0  # bytes per op
SOAK_RSS_GROWTH_LIMIT = 1.0  # percent


@dataclass
class Score:
    family: str
    trials: int = 0
    ok: int = 0
    hangs: int = 0
    leaks: int = 0
    wrong: int = 0
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def add(self, ok: bool, *, hang=False, leak=False, wrong=False, note: str | None = None):
        self.trials += 1
        self.ok += ok and not (hang or leak or wrong)
        self.hangs += hang
        self.leaks += leak
        self.wrong += wrong
        if note and len(self.notes) < 5 and not ok:
            self.notes.append(note)

    @property
    def perfect(self) -> bool:
        return self.trials > 0 and self.ok == self.trials

    def line(self) -> str:
        extra = "".join(f", {k} {v}" for k, v in self.extra.items())
        return (
            f"{self.family:9s} trials {self.trials:5d}  as required {self.ok:5d}  "
            f"hangs {self.hangs}  leaks {self.leaks}  wrong results {self.wrong}{extra}"
        )


def segments() -> set[str]:
    """The clawcomm shared-memory segments in /dev/shm."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("clawcomm-")}


def slow_to_read_addresses(store, seconds: float):
    """Wraps a c10d store so that this rank waits `seconds` before it first
    reads a peer's TCP address: the peer's listener stays open (and exposed)
    that long during setup."""
    import torch.distributed as dist

    class Slow(dist.Store):
        def __init__(self):
            super().__init__()
            self.waited = False

        def set(self, key, value):
            store.set(key, value)

        def get(self, key):
            return store.get(key)

        def add(self, key, value):
            return store.add(key, value)

        def check(self, keys):
            if any("addr/tcp/" in k for k in keys) and not self.waited:
                self.waited = True
                time.sleep(seconds)
            return store.check(keys)

        def wait(self, keys, timeout=None):
            store.wait(keys) if timeout is None else store.wait(keys, timeout)

    return Slow()


def join_group(
    rank: int, ws: int, store_path: str, expose_s: float = 0.0, prefix: str = ""
) -> None:
    import torch.distributed as dist

    import clawcomm  # noqa: F401
    from clawcomm.testing.stores import open_store

    store = open_store(store_path, ws)
    if prefix:  # one store, several groups one after another
        store = dist.PrefixStore(prefix, store)
    if expose_s and rank > 0:
        store = slow_to_read_addresses(store, expose_s)
    dist.init_process_group(
        "clawcomm",
        store=store,
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )


def run_trial(fn, ws, *args, env=None, limit=60.0):
    """run_ranks with a fresh store (a TCPStore served here: trials kill
    ranks mid-setup, which hangs a FileStore's readers); returns (results,
    hung)."""
    from clawcomm.launch import RankFailure, run_ranks
    from clawcomm.testing.stores import StoreServer

    with StoreServer() as server:
        results = run_ranks(
            fn, ws, server.address, *args,
            env=env, init=False, timeout=limit, allow_failures=True,
        )  # fmt: skip
    stuck = [
        e for r in results if isinstance(r, RankFailure)
        for e in r.errors.values() if "hung for more than" in e
    ]  # fmt: skip
    if stuck:  # where it hung (pytest shows it with the failing score)
        print(f"chaos: {fn.__name__} hung; its first hung rank:\n{stuck[0]}", file=sys.stderr)
    return results, bool(stuck)
