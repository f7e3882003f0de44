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
import statistics
import time
from dataclasses import dataclass

import torch

from clawcomm.train.stage_cuts import parameter_costs

RANK_THREADS = 1  # intra-op threads of a CPU trainer rank (clawcomm.launch.ranks, torchrun)


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
    # zero-bubble's split backward, per layer: I (input gradient), W (weight gradient)
    input_grad: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    weight_grad: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    # per layer, the shape of each trainable parameter it holds (shared ones
    # where they first appear), in registration order: the trainer's buckets
    tensors: list[list[tuple[int, ...]]] = dataclasses.field(default_factory=list)
    host_s: float = 0.0  # a trainer step's own time beyond its layers and optimizer
    # where ranks outnumber cores: CPU-seconds a compute action costs beyond
    # its profile, and the trial that measured it ("a trial: ..."), or why
    # none ran ("no trial: ..."; shared_cores)
    action_s: float = 0.0
    trial: str = ""
    # per pipeline shape (schedule, pp, v): each pass kind's time in the
    # schedule's order over its time back to back (pass_order; none on GPUs)
    order: dict[tuple[str, int, int], dict[str, float]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    threads: int = 0  # intra-op threads the layers were timed with
    # per micro-batch size, per layer: what its tensor-parallel form sends
    # by pass (clawcomm.parallel.tensor.parallelize.traffic); empty if no tp searched
    tp_traffic: dict[int, list[dict]] = dataclasses.field(default_factory=dict)
    # per micro-batch size, per layer: (its experts' parameters, the bytes
    # one all-to-all carries; clawcomm.parallel.expert.traffic); empty if no ep searched
    ep_traffic: dict[int, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    # per layer, the bytes of one sample's keys and values (float32) where it
    # attends (what the cp ring passes, context.kv_bytes); empty if no cp searched
    kv_bytes: list[float] = dataclasses.field(default_factory=list)
    # per --activation-checkpoint mode searched, per micro-batch size, per
    # layer: (the activation bytes it keeps over what it keeps without
    # recomputation, its backward's seconds with the recomputation)
    recompute: dict[str, dict[int, tuple[list[float], list[float]]]] = dataclasses.field(
        default_factory=dict
    )


def profile(cfg, sizes: list[int], repeats: int = 7, built=None, gpu: bool = False,
            split: bool = False) -> Profile:  # fmt: skip
    """Times the model's layers at each micro-batch size in ``sizes``
    (``built``: ``models.build``'s result for ``cfg`` at one rank, if made),
    with a rank's intra-op threads. Each time is the median of ``repeats``,
    not the best: a training run's steps take the typical time, and on a
    noisy machine the best of a few is 10-20% below it. ``split``: also
    time zero-bubble's I and W passes (``pipeline.weight_grad``). On the
    CPU, with ``cfg.keep_heap``, this process keeps its heap as a rank does
    (``device.keep_heap``, for good): a profile that faulted its
    activations in again each pass read 5-10% above the ranks' passes."""
    if not gpu and cfg.keep_heap:
        from clawcomm.train.device import keep_heap

        keep_heap()
    with rank_threads(gpu):
        prof = _profile(cfg, sizes, repeats, built, split)
        prof.threads = torch.get_num_threads()
    return prof


def recompute_profile(cfg, prof: Profile, modes: list[str], sizes: list[int], built,
                      gpu: bool = False, repeats: int = 3) -> None:  # fmt: skip
    """Adds to ``prof`` what each of ``modes`` (``--activation-checkpoint``)
    keeps and costs, layer by layer, at each size: the live activation bytes
    after the layer's forward against those without recomputation
    (``recompute.LiveActivations``), and its backward's time (the median of
    ``repeats``), on copies of the layers."""
    import copy

    from torch import nn

    from clawcomm.train import recompute

    model, _, _, ds, _, _ = built
    with rank_threads(gpu):
        for mode in modes:
            copies = nn.Sequential(*(copy.deepcopy(layer) for layer in model))
            recompute.apply(copies, mode)
            base = nn.Sequential(*(copy.deepcopy(layer) for layer in model))
            prof.recompute[mode] = {}
            for mbs in sorted(set(sizes)):
                x = ds.batch(torch.arange(mbs))[0]
                kept, back = [], []
                for layer, plain in zip(copies, base, strict=True):
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    ratio, times = 1.0, []
                    for r in range(repeats):
                        with recompute.LiveActivations() as mine:
                            out = layer(inp)
                        held = mine.live  # (read now: backward frees what it kept)
                        t0 = time.perf_counter()
                        out.backward(torch.ones_like(out))
                        times.append(time.perf_counter() - t0)
                        if r == 0:
                            with recompute.LiveActivations() as theirs:
                                ref = plain(inp)
                            ratio = held / theirs.live if theirs.live else 1.0
                            del ref
                    kept.append(ratio)
                    back.append(statistics.median(times))
                    x = out.detach()
                for layer in (*copies, *base):
                    layer.zero_grad(set_to_none=True)
                prof.recompute[mode][mbs] = (kept, back)


def _profile(cfg, sizes: list[int], repeats: int, built, split: bool) -> Profile:
    from clawcomm.train import models

    t_start = time.perf_counter()
    built = built or models.build(dataclasses.replace(cfg, dp=1, pp=1))
    model, _, make_opt, ds, _, _ = built
    layers = list(model)
    prof = Profile(parameter_costs(layers), {}, {}, {}, {}, 0.0, tensors=_tensors(layers))
    sizes = sorted(set(sizes))
    inputs = {mbs: ds.batch(torch.arange(mbs))[0] for mbs in sizes}
    copies = _split_copies(layers) if split else None
    times = {mbs: _Times(len(layers)) for mbs in sizes}
    # Repeats outermost: a slow stretch of the machine (seconds long) then
    # touches every size's samples alike instead of all of one size's.
    for _ in range(repeats):
        for mbs in sizes:
            _timed_pass(layers, inputs[mbs], times[mbs])
            if copies:
                _timed_split_pass(copies, inputs[mbs], times[mbs])
    for mbs, t in times.items():
        prof.forward[mbs], prof.backward[mbs] = t.medians("forward"), t.medians("backward")
        prof.saved[mbs], prof.out_bytes[mbs] = t.saved, t.out_bytes
        prof.cpu_share[mbs] = [statistics.median(sh) for sh in t.share]
        if copies:
            prof.input_grad[mbs], prof.weight_grad[mbs] = t.medians("i"), t.medians("w")
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = make_opt(params)
    steps = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t0)
    prof.opt_s_per_param = statistics.median(steps) / max(1, sum(p.numel() for p in params))
    prof.host_s = _host_seconds(cfg, min(sizes), prof)
    prof.seconds = time.perf_counter() - t_start
    return prof


def _tensors(layers) -> list[list[tuple[int, ...]]]:
    seen: set[int] = set()
    out = []
    for layer in layers:
        mine = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(map(id, mine))
        out.append([tuple(p.shape) for p in mine])
    return out


class _Times:
    """One micro-batch size's samples, per layer."""

    def __init__(self, n: int):
        self.samples = {k: [[] for _ in range(n)] for k in ("forward", "backward", "i", "w")}
        self.share = [[] for _ in range(n)]  # per pass: thread time / wall time
        self.saved, self.out_bytes = [0.0] * n, [0.0] * n

    def medians(self, kind: str) -> list[float]:
        return [statistics.median(t) for t in self.samples[kind]]


def _timed_pass(layers, x, t: _Times) -> None:
    """Each layer's forward and backward, on its own (inputs detached)."""
    for i, layer in enumerate(layers):
        inp = x.detach().requires_grad_(x.is_floating_point())
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda v, keep=packed: keep.append(v.numel() * v.element_size()) or v,
            lambda v: v,
        ):
            c0, t0 = time.thread_time(), time.perf_counter()
            out = layer(inp)
            t1 = time.perf_counter()
        out.backward(torch.ones_like(out))  # on this thread, for CPU tensors
        t2, c2 = time.perf_counter(), time.thread_time()
        t.samples["forward"][i].append(t1 - t0)
        t.samples["backward"][i].append(t2 - t1)
        # a pass's share on a core; the median over passes, not the sum's ratio,
        # so that one pass the kernel preempted (a busy machine) cannot make a
        # layer of microseconds look like one that waits
        t.share[i].append(min(1.0, (c2 - c0) / (t2 - t0)) if t2 > t0 else 1.0)
        t.saved[i], t.out_bytes[i] = float(sum(packed)), float(out.numel() * out.element_size())
        x = out.detach()
    for layer in layers:
        layer.zero_grad(set_to_none=True)


def _split_copies(layers) -> list:
    """Copies of the layers, split as the trainer splits a zero-bubble
    stage's (``pipeline.weight_grad``)."""
    import copy

    from clawcomm.pipeline.weight_grad import split_linear_backward

    copies = [copy.deepcopy(layer) for layer in layers]
    for layer in copies:
        split_linear_backward(layer)
    return copies


def _timed_split_pass(copies, x, t: _Times) -> None:
    """Each layer's I pass (input gradient; weight gradients deferred) and
    W pass (the deferred jobs)."""
    from clawcomm.pipeline.weight_grad import WeightGradStore, deferring

    for i, layer in enumerate(copies):
        out = layer(x.detach().requires_grad_(x.is_floating_point()))
        store = WeightGradStore()
        t0 = time.perf_counter()
        with deferring(store):
            out.backward(torch.ones_like(out))
        t1 = time.perf_counter()
        store.run()
        t.samples["i"][i].append(t1 - t0)
        t.samples["w"][i].append(time.perf_counter() - t1)
        x = out.detach()
    for layer in copies:
        layer.zero_grad(set_to_none=True)


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
                              timeline="", tensorboard="", checkpoint_dir="",
                              max_memory_mb=0.0)  # fmt: skip
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
