"""``clawcomm train --device``: the rule that places each rank (on the CPU
here; the trainer on CUDA against the CPU run is in tests/test_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from clawcomm.train import TrainConfig
from clawcomm.train import device as train_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = train_device._gpus() == 0


@pytest.mark.skipif(not NO_GPU, reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_one_clear_error_before_any_rank_starts():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "clawcomm.train", "--model", "mlp", "--dp", "2", "--device",
         "cuda", "--steps", "1", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "device 'cuda'" in proc.stderr and "--device cpu or auto" in proc.stderr, proc.stderr
    assert proc.stderr.count("device 'cuda'") == 1, proc.stderr  # once, not once per rank
    assert time.monotonic() - start < 60


@pytest.mark.skipif(not NO_GPU, reason="needs a machine without a GPU")
def test_the_python_api_refuses_cuda_without_a_gpu_and_auto_means_cpu():
    with pytest.raises(ValueError, match=r"device 'cuda': .*(CPU-only build|sees no GPU)"):
        TrainConfig(model="mlp", device="cuda").check(1)
    TrainConfig(model="mlp", device="auto").check(1)
    assert train_device.for_rank("auto", 3) == torch.device("cpu")


def test_an_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match=r"device 'tpu' is not one of auto, cpu, cuda"):
        TrainConfig(model="mlp", device="tpu").check(1)


@pytest.mark.parametrize("local_rank,gpus,want", [(0, 1, 0), (3, 1, 0), (3, 4, 3), (5, 4, 1)])
def test_a_rank_takes_its_local_rank_modulo_the_gpus(monkeypatch, local_rank, gpus, want):
    chosen = []
    monkeypatch.setattr(train_device, "_gpus", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    for spec in ("cuda", "auto"):
        assert train_device.for_rank(spec, rank=99) == torch.device("cuda", want)
    assert chosen == [torch.device("cuda", want)] * 2
    assert train_device.for_rank("cpu") == torch.device("cpu")
