"""The plan's data-parallel traffic on a pipeline rank's timeline, as the
trainer runs it (``parallel.reducer``, ``parallel.zero3``), so that the
plan hides what the trainer hides and no more:

- **Buckets** are the reducer's (``parallel.buckets.assign_buckets``): the
  rank's parameters in the order their gradients turn final, the first
  bucket at most 1 MiB (so the first reduction starts early in backward),
  the others at most ``--bucket-cap-mb``.
- **Reduction**: a gradient turns final as its layer's part of the stage's
  last backward (B; zero-bubble's W) ends, the layers of a stage taking
  their profiled shares of that action; a bucket launches when its last
  gradient does, and the buckets go over the wire one after another. What
  runs past the pipeline's end (its drain included) is exposed.
- **ZeRO-1 and 2's gathers** of the updated shards start after the
  optimizer, every bucket in forward order, one after another, and the
  next step's forward waits, layer by layer, only for its own bucket: what
  the first forward waits is exposed.
- **ZeRO-3's gathers** (``parallel.zero3``): as many a round as
  ``zero3.gathers_per_round`` says (resharding after forward, before every
  micro-batch's forward and again in its backward; else once), each
  layer's gather prefetched while the layer before it computes, so a pass
  waits for the first layer's gather and for what each later one takes
  beyond its predecessor's compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clawcomm.parallel.buckets import FIRST_BUCKET_MB, assign_buckets


@dataclass(frozen=True)
class _Tensor:
    """What ``assign_buckets`` reads of a float32 gradient."""

    elems: int
    dtype: str = "float32"
    device: str = "cpu"

    def numel(self) -> int:
        return self.elems

    def element_size(self) -> int:
        return 4


@dataclass
class Rank:
    """One pipeline rank's data-parallel timeline inputs: its layers (index
    into the profile), per layer the sizes of its gradients and when the
    last backward makes them final, and its first forward's layers with
    their start and durations."""

    tensors: list[tuple[int, tuple[int, ...]]]  # (layer, shape), in registration order
    ready: dict[int, float]  # layer -> when its gradients turn final
    forward: list[tuple[float, list[tuple[int, float]]]]  # per stage: (start, [(layer, s)])


def rank_timeline(sim, r: int, span, per_layer, tensors) -> Rank:
    """``sim``: the pipeline simulation; ``span[s]``: stage s's layers;
    ``per_layer(kind, layer)``: a layer's scaled seconds in a pass of
    ``kind`` (F, B or W); ``tensors[layer]``: its gradients' shapes."""
    acts = sim.schedule[r]
    ready, forward = {}, []
    for s in sorted({a.stage for a in acts}):
        layers = list(span[s])
        mine = [i for i, a in enumerate(acts) if a.stage == s]
        final = [i for i in mine if str(acts[i].kind) in ("B", "W")]
        if final:
            k = final[-1]
            kind = str(acts[k].kind)
            times = [per_layer(kind, i) for i in reversed(layers)]
            t, total = sim.start[r][k], sum(times)
            stretch = (sim.end[r][k] - t) / total if total > 0 else 0.0
            for i, dt in zip(reversed(layers), times, strict=True):
                t += dt * stretch
                ready[i] = t
        first = next((i for i in mine if str(acts[i].kind) == "F"), None)
        if first is not None:
            forward.append((sim.start[r][first], [(i, per_layer("F", i)) for i in layers]))
    owned = [(i, shape) for i in sorted(ready) for shape in tensors[i]]
    return Rank(owned, ready, forward)


def buckets(rank: Rank, cap_bytes: float) -> list[tuple[float, float, set[int], list]]:
    """(launch time, bytes, layers, shapes laid out) of each bucket, in
    launch order."""
    # the order the first step learns: gradients as they turn final (ties: reverse registration)
    order = sorted(range(len(rank.tensors)), key=lambda j: (rank.ready[rank.tensors[j][0]], -j))
    grads = [_Tensor(math.prod(shape)) for _, shape in rank.tensors]
    cap = int(cap_bytes)
    groups = assign_buckets(order, grads, cap, min(int(FIRST_BUCKET_MB * 2**20), cap))
    out = []
    for g in groups:
        layers = {rank.tensors[j][0] for j in g}
        out.append((max(rank.ready[i] for i in layers), 4.0 * sum(grads[j].elems for j in g),
                    layers, [rank.tensors[j][1] for j in g]))  # fmt: skip
    return sorted(out, key=lambda b: b[0])


def exposed_reduction(bs: list, makespan: float, reduce) -> float:
    """What a rank's reduction adds to the step: its buckets ``bs``
    (``buckets``), launched as they turn final and sent one after another,
    past the pipeline's end. ``reduce(bytes, share, shapes)``: one bucket's
    reduction, ``share`` its part of the rank's gradient, ``shapes`` the
    parameters it lays out."""
    total = sum(b[1] for b in bs) or 1.0
    done = 0.0
    for launch, nbytes, _, shapes in bs:
        done = max(done, launch) + reduce(nbytes, nbytes / total, shapes)
    return max(0.0, done - makespan) if bs else 0.0


def exposed_gathers(rank: Rank, bs: list, gather) -> float:
    """What ZeRO-1 and 2's gathers of the updated shards delay the rank's
    first forward by: its buckets ``bs`` gathered one after another from
    the step's start in the order the forward needs them, each layer
    waiting for its own. ``gather(bytes)``: one bucket's all-gather."""
    if not bs:
        return 0.0
    first_use = {i: n for n, i in enumerate(sorted(rank.ready))}
    landed, t = {}, 0.0
    for _, nbytes, layers, _ in sorted(bs, key=lambda b: min(first_use[i] for i in b[2])):
        t += gather(nbytes)
        for i in layers:
            landed[i] = max(landed.get(i, 0.0), t)
    delay = 0.0
    for start, layers in rank.forward:
        t = planned = start
        for i, dt in layers:
            t = max(t, landed.get(i, 0.0)) + dt
            planned += dt
        delay = max(delay, t - planned)
    return delay


def exposed_unit_gathers(passes: list[tuple[list[tuple[int, float]], list[tuple[int, float]]]],
                         gather, per_round: tuple[int, int]) -> float:  # fmt: skip
    """What ZeRO-3's gathers add to a rank's round: ``passes`` per stage
    (its layers' forward as [(layer, s)] in order, their backward the same
    in backward order); ``gather(layer)``: that layer's all-gather;
    ``per_round``: (forward, backward) gathers of each layer a round."""

    def waited(seq: list[tuple[int, float]]) -> float:
        if not seq:
            return 0.0
        wait = gather(seq[0][0])
        for (_, before), (layer, _) in zip(seq, seq[1:], strict=False):
            wait += max(0.0, gather(layer) - before)  # prefetched while the one before computes
        return wait

    forwards, backwards = per_round
    return sum(forwards * waited(f) + backwards * waited(b) for f, b in passes)
