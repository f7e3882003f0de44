"""The plan's profile of a model (``clawcomm plan``, step 1): each layer's
forward and backward time and the bytes autograd saves for backward, at
each micro-batch size a candidate uses; one optimizer step; and what a
trainer step costs beyond them.

Everything is timed with the intra-op threads a trainer rank runs with:
one on the CPU (``clawcomm train`` and ``torchrun`` both start ranks with
one thread), where the planning process would otherwise time the layers on
every core and predict CPU steps at about half what the ranks measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from clawcomm.train.layout import parameter_costs

RANK_THREADS = 1  # intra-op threads of a CPU trainer rank (clawcomm.testing.ranks, torchrun)


@contextlib.contextmanager
def rank_threads(gpu: bool):
    """Runs the block with a CPU rank's intra-op threads (unchanged on GPUs)."""
    before = torch.get_num_threads()
    if not gpu:
        torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Profile:
    """Per layer: forward and backward seconds, and the bytes autograd saves
    for backward, per micro-batch size; parameters per layer; the optimizer's
    seconds per parameter; output bytes per sample at each layer; and the
    share of each layer's time its thread spent on a core (1 for layers
    that compute on the CPU, about 0 for layers that wait, as on an
    accelerator: only that share slows down when ranks outnumber cores)."""

    params: list[float]
    forward: dict[int, list[float]]
    backward: dict[int, list[float]]
    saved: dict[int, list[float]]
    out_bytes: dict[int, list[float]]
    opt_s_per_param: float
    cpu_share: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    host_s: float = 0.0  # a trainer step's own time beyond its layers and optimizer
    seconds: float = 0.0
    threads: int = 0  # intra-op threads the layers were timed with


def profile(cfg, sizes: list[int], repeats: int = 3, built=None, gpu: bool = False) -> Profile:
    """Times the model's layers at each micro-batch size in ``sizes``
    (``built``: ``models.build``'s result for ``cfg`` at one rank, if made),
    with a rank's intra-op threads."""
    with rank_threads(gpu):
        prof = _profile(cfg, sizes, repeats, built)
        prof.threads = torch.get_num_threads()
    return prof


def _profile(cfg, sizes: list[int], repeats: int, built) -> Profile:
    from clawcomm.train import models

    t_start = time.perf_counter()
    built = built or models.build(dataclasses.replace(cfg, dp=1, pp=1))
    model, _, make_opt, ds, _, _ = built
    layers = list(model)
    prof = Profile(parameter_costs(layers), {}, {}, {}, {}, 0.0)
    for mbs in sorted(set(sizes)):
        x0 = ds.batch(torch.arange(mbs))[0]
        fw, bw = [math.inf] * len(layers), [math.inf] * len(layers)
        saved, outs = [0.0] * len(layers), [0.0] * len(layers)
        wall, cpu = [0.0] * len(layers), [0.0] * len(layers)
        for _ in range(repeats):
            x = x0
            for i, layer in enumerate(layers):
                inp = x.detach().requires_grad_(x.is_floating_point())
                packed = []
                with torch.autograd.graph.saved_tensors_hooks(
                    lambda t, keep=packed: keep.append(t.numel() * t.element_size()) or t,
                    lambda t: t,
                ):
                    c0, t0 = time.thread_time(), time.perf_counter()
                    out = layer(inp)
                    t1 = time.perf_counter()
                out.backward(torch.ones_like(out))  # on this thread, for CPU tensors
                t2, c2 = time.perf_counter(), time.thread_time()
                fw[i], bw[i] = min(fw[i], t1 - t0), min(bw[i], t2 - t1)
                wall[i], cpu[i] = wall[i] + t2 - t0, cpu[i] + c2 - c0
                saved[i], outs[i] = float(sum(packed)), float(out.numel() * out.element_size())
                x = out.detach()
            for layer in layers:
                layer.zero_grad(set_to_none=True)
        prof.forward[mbs], prof.backward[mbs], prof.saved[mbs] = fw, bw, saved
        prof.out_bytes[mbs] = outs
        prof.cpu_share[mbs] = [
            min(1.0, c / w) if w > 0 else 1.0 for c, w in zip(cpu, wall, strict=True)
        ]
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = make_opt(params)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    prof.opt_s_per_param = best / max(1, sum(p.numel() for p in params))
    prof.host_s = _host_seconds(cfg, min(sizes), prof)
    prof.seconds = time.perf_counter() - t_start
    return prof


def _host_seconds(cfg, mbs: int, prof: Profile, steps: int = 4) -> float:
    """What one process's trainer step takes beyond its layers' forward and
    backward and the optimizer (the executor's bookkeeping, the metrics):
    a few steps of the real trainer, the median, less the profiled parts."""
    from clawcomm.train import models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    one = dataclasses.replace(cfg, dp=1, pp=1, microbatches=1, micro_batch_size=mbs,
                              accumulation=1, global_batch=0, zero=0, layout="", quiet=True,
                              compression="", sync="every-step", metrics="", trace="",
                              timeline="", tensorboard="", checkpoint_dir="")  # fmt: skip
    model, loss, make_opt, ds, tokens, sample = models.build(one)
    trainer = Trainer(model, loss, make_opt, one, tokens_per_sample=tokens, sample=sample)
    try:
        times = [m["step_ms"] / 1e3 for m in trainer.fit(
            global_batches(ds, mbs, one.seed), steps=steps, progress=False)]  # fmt: skip
    finally:
        trainer.close()
    layers = sum(prof.forward[mbs]) + sum(prof.backward[mbs])
    params = sum(prof.params)
    return max(0.0, sorted(times)[len(times) // 2] - layers - prof.opt_s_per_param * params)
