"""The cost model's parameters and what it is asked about: the seconds per
message and per byte (``CostModel``), the hosts a group spans
(``Topology``), link rates as ``--link`` writes them, and nccl-tests' bus
bandwidth factors."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace


@dataclass
class CostModel:
    """Seconds per message (alpha), per byte (beta) and per byte reduced
    (gamma); the defaults are the engine's (csrc/common/cost_model.h)."""

    shm_alpha: float = 8e-6
    shm_beta: float = 1 / 5e9
    net_alpha: float = 50e-6
    net_beta: float = 1 / 1.25e9
    gamma: float = 1 / 4e9

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            data = json.load(f)
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise ValueError(f"cost model {path}: missing {', '.join(missing)}")
        return cls(**{f.name: float(data[f.name]) for f in fields(cls)})

    def save(self, path: str, **extra) -> None:
        with open(path, "w") as f:
            json.dump({**asdict(self), **extra}, f, indent=2)
            f.write("\n")

    def with_link(self, rate: str | None) -> CostModel:
        """This model with each host's link at ``rate`` (tc's syntax, as
        ``--link`` takes it: ``1gbit``, ``200mbit``); unchanged for None."""
        return replace(self, net_beta=8 / link_bits_per_s(rate)) if rate else self


def link_bits_per_s(rate: str) -> float:
    """A link rate in tc's syntax (``10gbit``, ``200mbit``, ``500kbit``) in
    bits per second: the one parser of ``--link`` for the cost model, the
    compression lab and the namespace hosts that shape their links with it."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]?)bit", str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not like '1gbit', '200mbit' or '10gbit'")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


@dataclass(frozen=True)
class Topology:
    """`hosts` hosts of `ranks_per_host` ranks, numbered host by host (as
    torchrun numbers them)."""

    hosts: int
    ranks_per_host: int

    @property
    def size(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    @property
    def hierarchical(self) -> bool:
        return self.hosts >= 2 and self.ranks_per_host >= 2


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if n <= 1:
        return 1.0
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(collective, (n - 1) / n)
