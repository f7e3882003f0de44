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


class _Libc:
    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def _no_malloc_env(monkeypatch):
    for k in ("GLIBC_TUNABLES", *train_device._MALLOC_ENV):
        monkeypatch.delenv(k, raising=False)


def test_keep_heap_fixes_both_of_glibcs_thresholds(monkeypatch):
    _no_malloc_env(monkeypatch)
    libc = _Libc()
    assert train_device.keep_heap(libc) is None
    assert libc.calls == [(-3, 32 << 20), (-1, 2**31 - 1)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert train_device.keep_heap(_Libc(answer=0)) == "glibc refused the thresholds"


@pytest.mark.parametrize("var,value", [("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
                                       ("MALLOC_TRIM_THRESHOLD_", "0"),
                                       ("MALLOC_MMAP_THRESHOLD_", "65536")])  # fmt: skip
def test_keep_heap_leaves_the_users_own_malloc_settings_alone(monkeypatch, var, value):
    _no_malloc_env(monkeypatch)
    monkeypatch.setenv(var, value)
    libc = _Libc()
    assert train_device.keep_heap(libc) == "the environment sets malloc's thresholds"
    assert libc.calls == []


def test_a_cpu_rank_keeps_its_heap_unless_told_not_to(monkeypatch):
    from clawcomm.train import Trainer
    from clawcomm.train import models as train_models
    from clawcomm.train import trainer as trainer_module

    for keep in (True, False):
        called = []
        monkeypatch.setattr(trainer_module, "keep_heap", lambda c=called: c.append(1))
        cfg = TrainConfig(model="mlp", hidden=16, device="cpu", keep_heap=keep, quiet=True)
        model, loss, opt, _, tokens, sample = train_models.build(cfg)
        Trainer(model, loss, opt, cfg, tokens_per_sample=tokens, sample=sample).close()
        assert called == ([1] if keep else []), keep


# Four activations of about 8 MiB made and freed, as a gpipe stage's are each
# step, ten times: the page faults a round, over the last five (the heap
# settles in its first few), against the 8192 pages a round writes. Once
# with the same size each round, once 256 KiB larger each round. glibc's
# default serves a block above its threshold (the size of the last such
# block it unmapped) from a fresh mapping, so growing blocks fault at least
# one block's 2048 pages in every round, where a kept heap faults only its
# growth (256 pages); whether the same-size blocks fault depends on whether
# they reach the top of the heap, which glibc then trims, so only the kept
# heap is held to a figure there.
_FAULTS = """
import resource, sys, torch
from clawcomm.train import device
if sys.argv[1] == "keep":
    assert device.keep_heap() is None
for grow in (0, 1 << 16):
    counts = []
    for k in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones((2 << 20) + k * grow) for _ in range(4)]
        del blocks
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(counts[5:]) / 5)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_kept_heap_does_not_fault_freed_activations_in_again():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc")
    env = {k: v for k, v in os.environ.items()
           if k != "GLIBC_TUNABLES" and k not in train_device._MALLOC_ENV}  # fmt: skip
    faults = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        faults[mode] = [float(line) for line in out.stdout.split()]
    (same, growing), (_, growing_default) = faults["keep"], faults["default"]
    assert same < 100, faults  # the heap's pages are reused
    assert growing < 800, faults  # only the heap's growth, 1 MiB a round, faults
    assert growing_default > 1500, faults  # a fresh mapping a round, faulted in
