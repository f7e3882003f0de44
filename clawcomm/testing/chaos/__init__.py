"""The chaos families: a job is attacked the way real jobs fail, and every
trial is scored. tests/chaos/ runs each family a few times in CI;
bench/chaos.py runs them long and writes the scorecard docs/reliability.md shows.

Each family returns a :class:`Score`: trials, how many ended as they must
(an error on every rank that had to fail, within the group's timeout + 1 s,
or a correct result), hangs (a rank still running at the harness's limit),
leaks (a shared-memory segment of the job left in /dev/shm) and wrong
results (a collective that returned a wrong value instead of failing).

Families:
  kill      SIGKILL of a random rank at a random moment, setup included,
            over shm and TCP, 2 to 4 ranks, in a loop of all-reduce,
            broadcast and all-gather, with messages small or large enough
            to go by single copy.
  mismatch  one rank calls another collective: op, size, dtype, root,
            reduce op, or skips a call.
  settings  every numeric CLAWCOMM_* setting given nonsense, and arguments
            at their limits: refused at setup, or before any byte is sent.
  hang      one rank holds the others up (SIGSTOP, asleep before a call,
            another op, size or dtype), over shm and TCP: every other rank's
            error names it by rank, host and pid, and so does the first line
            of `clawcomm flight`.
  link      a namespace host's link cut mid-run (TCP; needs root and
            iproute2): every rank on the other hosts names a rank of the cut
            host, and so does `clawcomm flight`.
  timeout   one rank stops calling; the other times out, then both destroy
            the group and exit cleanly.
  soak      random collectives on 2 ranks, results checked; RSS and open file
            descriptors sampled.
  storm     hostile clients (empty, random bytes, a wrong token, a cut-short
            hello, absurd frame lengths) against rank 0's listener while the
            group sets up (rank 1 connects only after 1 s of it), then against
            the job's ports while it runs (the listener is closed by then:
            the kernel refuses them); results checked, stalls timed.
"""

from __future__ import annotations

from .endurance import floor_rise, rss_growth, soak, storm
from .failures import kill, mismatch, settings, timeout
from .hangs import hang, link
from .harness import SLACK, SOAK_HEAP_GROWTH_LIMIT, SOAK_RSS_GROWTH_LIMIT, TIMEOUT, Score, segments

__all__ = [
    "FAMILIES", "SLACK", "SOAK_HEAP_GROWTH_LIMIT", "SOAK_RSS_GROWTH_LIMIT", "TIMEOUT", "Score",
    "floor_rise", "rss_growth", "segments",
    "kill", "mismatch", "hang", "link", "settings", "timeout", "soak", "storm",
]  # fmt: skip

FAMILIES = {
    "kill": kill,
    "mismatch": mismatch,
    "hang": hang,
    "link": link,
    "settings": settings,
    "timeout": timeout,
    "soak": soak,
    "storm": storm,
}
