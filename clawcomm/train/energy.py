"""What a step cost: energy where a meter exists, device-seconds always.

- **GPUs**: NVML's energy counter of the rank's GPU (millijoules since the
  driver loaded; Volta and later), through ``pynvml`` (``pip install
  'clawcomm[energy]'``, the ``nvidia-ml-py`` package NVIDIA publishes).
  Each rank reads its own GPU.
- **CPUs**: RAPL's package counters in ``/sys/class/powercap``
  (``intel-rapl:N/energy_uj``, microjoules, wrapping at
  ``max_energy_range_uj``; AMD's Zen packages appear there too). A package
  is the host's, shared by its ranks, so only the host's first rank
  (``LOCAL_RANK`` 0) reads them. ``CLAWCOMM_POWERCAP`` names another
  directory (the tests' fake counters).

Where neither exists (a virtual machine has no RAPL counters; a kernel may
keep ``energy_uj`` to root) the metrics carry no energy and the summary
says "n/a" and why. ``device_s`` (the step's seconds times the devices it
held: GPUs, or ranks on CPUs) is always there, and so is ``cpu_s``: the
CPU-seconds the ranks' processes used (each process's every thread), which
on CPUs says how much of the device-seconds the cores were working (more
than the device-seconds where ranks outnumber cores and their threads share
them).
"""

from __future__ import annotations

import glob
import os
import re
import time

import torch

POWERCAP = "/sys/class/powercap"


class Meter:
    """A cumulative energy counter: ``joules()``, never decreasing."""

    name = "none"

    def joules(self) -> float:
        raise NotImplementedError


class Rapl(Meter):
    """The packages' RAPL counters under ``root``."""

    name = "RAPL"

    def __init__(self, zones: list[str]):
        self.zones = zones
        self.ranges = [_read_int(os.path.join(z, "max_energy_range_uj")) for z in zones]
        self.last = [_read_int(os.path.join(z, "energy_uj")) for z in zones]
        self.total_uj = 0

    def joules(self) -> float:
        for k, z in enumerate(self.zones):
            now = _read_int(os.path.join(z, "energy_uj"))
            step = now - self.last[k]
            if step < 0:  # the counter wrapped
                step += self.ranges[k] + 1
            self.total_uj += step
            self.last[k] = now
        return self.total_uj / 1e6


class Nvml(Meter):
    """The total energy counter of GPU ``index``."""

    name = "NVML"

    def __init__(self, pynvml, index: int):
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.joules()  # raises if the GPU has no counter

    def joules(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def meter_for(device: torch.device, local_rank: int) -> tuple[Meter | None, str]:
    """This rank's meter, or None and why there is none. On CPUs only the
    host's first rank meters (the packages are the host's): the others get
    None and an empty reason."""
    if device.type == "cuda":
        return _nvml(device.index if device.index is not None else 0)
    if local_rank != 0:
        return None, ""
    return _rapl(os.environ.get("CLAWCOMM_POWERCAP", POWERCAP))


def _nvml(index: int) -> tuple[Meter | None, str]:
    try:
        import pynvml
    except ImportError:
        return None, "no pynvml (pip install 'clawcomm[energy]')"
    try:
        pynvml.nvmlInit()
        return Nvml(pynvml, index), ""
    except Exception as e:  # NVMLError_NotSupported and the like
        return None, f"NVML has no energy counter for GPU {index}: {e}"


def _rapl(root: str) -> tuple[Meter | None, str]:
    zones = sorted(
        z
        for z in glob.glob(os.path.join(root, "intel-rapl:*"))
        if re.fullmatch(r"intel-rapl:\d+", os.path.basename(z))  # packages, not their parts
    )
    if not zones:
        return None, f"no RAPL counters in {root}: a virtual machine has none"
    try:
        return Rapl(zones), ""
    except PermissionError:
        return None, f"the RAPL counters in {root} are readable by root only"
    except (OSError, ValueError) as e:
        return None, f"the RAPL counters in {root} could not be read: {e}"


class StepEnergy:
    """This rank's joules per step: ``lap()`` gives those counted since the
    previous lap (the first: since ``begin()``), so in steady state each
    step's lap covers one whole step; -1 where the rank has no meter.
    ``cpu_lap()``: likewise the CPU-seconds of the rank's process (every
    thread's, the progress thread's too), which every rank has."""

    def __init__(self, device: torch.device, local_rank: int):
        self.meter, self.reason = meter_for(device, local_rank)
        self._at: float | None = None
        self._cpu_at: float | None = None

    def begin(self) -> None:
        """The first lap's start (later calls change nothing)."""
        if self._cpu_at is None:
            self._cpu_at = time.process_time()
        if self.meter is not None and self._at is None:
            self._at = self.meter.joules()

    def lap(self) -> float:
        if self.meter is None:
            return -1.0
        self.begin()
        now = self.meter.joules()
        used, self._at = now - self._at, now
        return used

    def cpu_lap(self) -> float:
        self.begin()
        now = time.process_time()
        used, self._cpu_at = now - self._cpu_at, now
        return used
