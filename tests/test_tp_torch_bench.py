"""bench/tp_torch.py, torch's own tensor parallelism on the trainer's GPT:
at tp 2 over clawcomm, step 1's loss is the single-process loss of the same
weights and batch, and step 2's the single-process run's after one AdamW
step (so the sharded gradients, the tied embedding's included, are right).
Two steps, a few seconds; timings are not looked at."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys

import pytest
import torch

from clawcomm.train import data, models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "tp_torch", os.path.join(ROOT, "bench", "tp_torch.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tp_torch"] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


def _single_process(cfg) -> list[float]:
    """The same GPT, batches and AdamW in this process, without TP."""
    ds = data.CharText(data.default_text(), cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = models.gpt(ds.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    losses = []
    for x, y in itertools.islice(data.global_batches(ds, cfg.micro_batch, cfg.seed), cfg.steps):
        loss = models.gpt_loss(model(x), y) / y.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tp2_loss_equals_the_single_process_loss(sequence_parallel):
    bench = _bench()
    cfg = bench.TpConfig(tp=2, steps=2, sequence_parallel=sequence_parallel)
    row = bench.measure("clawcomm", cfg, timeout=60)
    assert row["loss_step1_ok"], row
    assert row["loss_step1"] == pytest.approx(row["loss_reference"], rel=bench.TOLERANCE)
    assert row["losses"] == pytest.approx(_single_process(cfg), rel=bench.TOLERANCE)
    assert row["bytes_per_step"] > 0
