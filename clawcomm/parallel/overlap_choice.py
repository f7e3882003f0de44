"""``DataParallel(overlap="auto")``: whether to reduce gradients during
backward or after it, decided from the first steps' timings.

Reducing during backward hides communication behind the layers still to be
computed, where those layers leave the host's cores free (an accelerator's
kernels, a wait). On a CPU-bound model the reduction and the backward fight
for the same cores instead, and reducing after backward is faster (measured
on 2 cores: 4-20 ms a step, bench/data_parallel_bench.py). Which one wins
depends on the model and the machine, so the default measures both:

after the first synchronised step (which learns the bucket order), the next
``2 * trial_steps`` synchronised steps alternate the two ways, each timed
from the end of the forward to the end of the reduction (the part of the
step the choice changes). The slowest rank's median for each way decides,
the same on every rank (one all-reduce of the two medians, MAX), and the
faster way is kept from then on. ``choice`` reports it; the decision is also
logged (logger ``clawcomm.parallel``, INFO).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

log = logging.getLogger("clawcomm.parallel")


class OverlapChooser:
    """Times the trial steps and decides (see the module's docstring)."""

    def __init__(self, group, rank: int, trial_steps: int = 4):
        if isinstance(trial_steps, bool) or not isinstance(trial_steps, int) or trial_steps < 1:
            raise ValueError(f"DataParallel: overlap trial steps must be >= 1, got {trial_steps!r}")
        self.group = group
        self.rank = rank
        self.trial_steps = trial_steps
        self.choice: dict | None = None
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._mode: bool | None = None  # the way the step under way uses
        self._started = 0.0

    @property
    def decided(self) -> bool:
        return self.choice is not None

    def begin(self) -> bool:
        """A trial step's forward has ended: the way its reduction goes
        (overlap first, then alternating), and its clock starts."""
        done = len(self._times[True]) + len(self._times[False])
        self._mode = done % 2 == 0
        self._started = time.perf_counter()
        return self._mode

    def end(self) -> bool | None:
        """The trial step's reduction has ended. Once every trial step is
        in: the decision (True: overlap), the same on every rank; else None."""
        if self._mode is None:
            return None
        self._times[self._mode].append(time.perf_counter() - self._started)
        self._mode = None
        if min(len(t) for t in self._times.values()) < self.trial_steps:
            return None
        medians = torch.tensor(
            [statistics.median(self._times[True]), statistics.median(self._times[False])],
            dtype=torch.float64,
        )
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.group)
        during, after = (float(m) * 1e3 for m in medians)
        overlap = during <= after
        self.choice = {
            "overlap": overlap,
            "during_backward_ms": round(during, 2),
            "after_backward_ms": round(after, 2),
            "trial_steps": self.trial_steps,
        }
        if self.rank == 0:
            log.info(
                "DataParallel(overlap='auto'): reducing %s backward (%.1f ms during it, %.1f ms "
                "after it: backward and reduction, median of %d steps each, slowest rank)",
                "during" if overlap else "after",
                during,
                after,
                self.trial_steps,
            )
        return overlap
