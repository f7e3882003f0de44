"""Energy per step (clawcomm/train/energy.py) against fake meters: RAPL
counters in a fake powercap directory (wrapping included) and a fake
pynvml; the trainer's metrics and summary with a meter and without one."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from clawcomm.train import energy
from clawcomm.train.cli import _cost_line


def _zone(root, name: str, uj: int, wrap: int = 2**32) -> None:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{wrap}\n")


def test_rapl_sums_the_packages_and_survives_a_wrap(tmp_path):
    _zone(tmp_path, "intel-rapl:0", 1_000_000)
    _zone(tmp_path, "intel-rapl:1", 5_000_000, wrap=9_999_999)
    _zone(tmp_path, "intel-rapl:0:0", 123)  # a part of package 0 (its cores): not added
    meter, reason = energy._rapl(str(tmp_path))
    assert reason == "" and meter.name == "RAPL" and len(meter.zones) == 2
    assert meter.joules() == 0.0
    _zone(tmp_path, "intel-rapl:0", 3_500_000)  # +2.5 J
    _zone(tmp_path, "intel-rapl:1", 500_000, wrap=9_999_999)  # wrapped: +5.5 J
    assert meter.joules() == pytest.approx(8.0)


def test_no_meter_says_why(tmp_path, monkeypatch):
    assert energy._rapl(str(tmp_path))[1].startswith("no RAPL counters in")
    monkeypatch.setenv("CLAWCOMM_POWERCAP", str(tmp_path))
    meter, reason = energy.meter_for(torch.device("cpu"), 0)
    assert meter is None and "no RAPL counters" in reason
    # the host's other ranks leave the packages to its first
    assert energy.meter_for(torch.device("cpu"), 1) == (None, "")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert "pip install 'clawcomm[energy]'" in energy._nvml(0)[1]


def test_nvml_reads_the_gpus_counter_in_millijoules(monkeypatch):
    counter = {"mj": 10_000}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
        nvmlDeviceGetTotalEnergyConsumption=lambda h: counter["mj"],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter, reason = energy._nvml(1)
    assert reason == "" and meter.handle == ("gpu", 1) and meter.joules() == 10.0

    def unsupported(h):
        raise RuntimeError("Not Supported")

    fake.nvmlDeviceGetTotalEnergyConsumption = unsupported
    assert "NVML has no energy counter for GPU 1: Not Supported" in energy._nvml(1)[1]


def test_step_energy_laps_cover_whole_steps(tmp_path, monkeypatch):
    _zone(tmp_path, "intel-rapl:0", 0)
    monkeypatch.setenv("CLAWCOMM_POWERCAP", str(tmp_path))
    steps = energy.StepEnergy(torch.device("cpu"), 0)
    steps.begin()
    _zone(tmp_path, "intel-rapl:0", 2_000_000)
    assert steps.lap() == pytest.approx(2.0)
    steps.begin()  # a later begin changes nothing: laps follow each other
    _zone(tmp_path, "intel-rapl:0", 2_500_000)
    assert steps.lap() == pytest.approx(0.5)
    assert energy.StepEnergy(torch.device("cpu"), 3).lap() == -1.0


def _train(rank, world, powercap):
    import os

    os.environ["CLAWCOMM_POWERCAP"] = powercap
    from _training import _config

    from clawcomm.train import Trainer
    from clawcomm.train import models as train_models
    from clawcomm.train.data import global_batches

    cfg = _config(dp=world, micro_batch_size=2)
    model, loss_fn, make_opt, ds, tok, sample = train_models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tok, sample=sample)
    metrics = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    trainer.close()
    return metrics


def test_the_metrics_carry_energy_with_a_meter_and_say_why_not_without(tmp_path):
    from clawcomm.launch import run_ranks

    _zone(tmp_path / "host", "intel-rapl:0", 0)  # a counter that stands still: 0 J a step
    metered = run_ranks(_train, 2, str(tmp_path / "host"))[0]
    assert all(m["energy_j"] == 0.0 and m["energy_per_sample_j"] == 0.0 for m in metered)
    assert all(m["device_s"] == pytest.approx(2 * m["step_ms"] / 1e3) for m in metered)
    assert all(m["cpu_s"] > 0 for m in metered)
    assert "energy_note" not in metered[0]
    bare = run_ranks(_train, 2, str(tmp_path / "nothing"))[0]
    assert all("energy_j" not in m for m in bare)
    assert bare[0]["energy_note"].startswith("no RAPL counters in")
    med = {"device_s": 0.25, "energy_j": 3.0, "energy_per_sample_j": 0.375}
    assert _cost_line(med, {}) == "cost per step: 0.250 device-s, 3.00 J (375.0 mJ per sample)"
    med["cpu_s"] = 0.5
    assert _cost_line(med, {}).startswith("cost per step: 0.250 device-s (0.500 CPU-s), 3.00 J")
    assert "energy n/a (no RAPL counters in" in _cost_line({"device_s": 0.1}, bare[0])


def test_a_cpu_lap_counts_the_process_s_cpu_not_the_wall_clock():
    """A lap over a sleep is near 0; one over a thread that computes counts
    that thread's CPU, though the lap is taken on another."""
    import threading
    import time

    from clawcomm.train.energy import StepEnergy

    meter = StepEnergy(torch.device("cpu"), 1)
    meter.begin()
    time.sleep(0.3)
    assert meter.cpu_lap() < 0.1

    def burn():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()
    assert meter.cpu_lap() >= 0.28
