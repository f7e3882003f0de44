"""What a schedule's order does to the cost of its passes on the CPU (the
plan's profile, step 1b: ``plan.predict`` scales each pass by it).

The profile times each layer's passes as a micro-batch's forward and, at
once, its backward. A schedule runs a rank's passes in its own order:
gpipe every forward before any backward, 1F1B a backward between
forwards, zero-bubble's weight passes deferred, interleaved's chunks in
turn. On a CPU a pass then finds more activations alive, and a forward
writes memory that the last backward did not just free and leave in
cache. Traced at 2 GPT ranks (dp 1 x pp 2, 4 x 8, the heap kept), a step's
forwards took 17.8 ms a rank in 1F1B and 19.6-21.7 in gpipe, 20.2-21.4 in
zero-bubble, 21.5 interleaved: the same layers, the same micro-batches.

``ratios`` measures it in one process, for each pipeline shape (schedule,
pp, v) among the candidates: it runs each pipeline rank's compute actions
over its stages, once in the schedule's order and once in the profile's
(each micro-batch's passes back to back), in turn, ``repeats`` times, and
keeps per pass kind (F, B, I, W) the median ratio of the two. The GPT reads
1.02-1.03 for 1F1B, 1.13-1.18 for gpipe at pp 2, 1.07-1.10 for zero-bubble
and interleaved; the waiting model, whose layers sleep, 1.00. On a GPU the
passes are the device's and none of this applies: no ratios. The shapes
are measured as many as fit the time the plan has left (``PLAN_SECONDS``,
at most ``ORDER_BUDGET_S``), as the profile estimates them and as the
clock says: one shape of each schedule first (1F1B's, nearest the
profile's own order, last of them), then the cheapest of the rest. A
shape left over takes its schedule's ratios at the nearest pp measured
(``borrowed``), or none; the report says which.
"""

from __future__ import annotations

import statistics
import time

import torch

from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.train.stage_cuts import balanced_cuts

ORDER_REPEATS = 3  # each order timed this many times, in turn; the median ratio
# The most seconds the orders may add to a plan, as the profile estimates
# them (a warm-up and both orders' repeats, each m micro-batches' passes
# through the whole model; the GPT here: 2.9-3.9 s estimated, 2.8-3.9
# measured). Shapes beyond it take their schedule's ratios at another pp, or none.
ORDER_BUDGET_S = 6.0
# The plan's measuring (the profile, the trial where ranks outnumber cores,
# the orders) aims to end within this, under issue 29's 15 s for a whole
# plan: the orders, measured last, get what is left of it. On a 2-core VM
# that ran the GPT 1.8x slower than the reference, the GPT on 2 namespace
# hosts had planned in 21.8 s with a fixed budget (profile 3.5 s, orders
# 4.4, the trial 13.1 before its ranks were forked: ``launch.forkrun``).
PLAN_SECONDS = 14.0
Shape = tuple[str, int, int]  # schedule, pp, v
# Measured only where the layers spend at least this share of their time on
# a core: the waiting model's layers sleep (share about 0), and timing their
# orders would take as long as the sleeps (38 s at 4 ranks), for ratios of 1.
ON_CORE = 0.5


def shapes(cands: list) -> dict[Shape, tuple[int, int]]:
    """The pipeline shapes (schedule, pp, v) among ``cands``, each with the
    micro-batches and micro-batch size it is measured at: its candidates'
    closest to 2 pp micro-batches (the first of equals)."""
    out: dict[Shape, tuple[int, int]] = {}
    for c in cands:
        if c.pp < 2:
            continue
        key = (c.schedule, c.pp, c.virtual_stages)
        if key not in out or abs(c.microbatches - 2 * c.pp) < abs(out[key][0] - 2 * c.pp):
            out[key] = (c.microbatches, c.micro_batch_size)
    return out


def of(c, prof) -> dict[str, float]:
    """The candidate's ratio per pass kind: its own shape's, else (a shape
    left unmeasured for time) its schedule's at the nearest pp measured
    (``borrowed``), else none (pp 1, or nothing of its schedule measured:
    its passes unscaled)."""
    if c.pp < 2:
        return {}
    own = prof.order.get((c.schedule, c.pp, c.virtual_stages))
    if own:
        return own
    lender = borrowed((c.schedule, c.pp, c.virtual_stages), prof.order)
    return prof.order[lender] if lender else {}


def borrowed(shape: Shape, order: dict) -> Shape | None:
    """The measured shape of the same schedule and v at the nearest pp (the
    smaller of equals) whose ratios an unmeasured ``shape`` takes, or None.
    The ratios follow the schedule far more than the pp: the GPT read
    1.02-1.04 for 1F1B at pp 2 and 4, 1.08-1.18 for gpipe's forward."""
    schedule, pp, v = shape
    same = [s for s, kinds in order.items() if kinds and s[0] == schedule and s[2] == v]
    return min(same, key=lambda s: (abs(s[1] - pp), s[1])) if same else None


def measure(cfg, cands: list, prof, built, budget: float = ORDER_BUDGET_S) -> tuple[dict, float]:
    """(``ratios`` for the candidates' pipeline shapes, the seconds it took),
    with a CPU rank's intra-op threads, within ``budget`` seconds (at most
    ``ORDER_BUDGET_S``); ``built``: ``models.build``'s result for ``cfg``
    at one rank, ``prof`` its profile (the layers' parameters)."""
    from clawcomm.plan.profile import _split_copies, rank_threads

    t0 = time.perf_counter()
    if _on_core(prof) < ON_CORE:
        return {}, 0.0  # layers that wait: no caches for the order to cool
    budget = max(0.0, min(budget, ORDER_BUDGET_S))
    every = shapes(cands)
    wanted, _ = within_budget(every, prof, budget)
    layers, ds = list(built[0]), built[3]
    split = _split_copies(layers) if any(s == "zb1" for s, _, _ in wanted) else None
    with rank_threads(False):
        out = ratios(layers, prof.params, lambda n: ds.batch(torch.arange(n))[0], wanted, split,
                     deadline=t0 + budget)  # fmt: skip
    out.update({shape: {} for shape in every if shape not in out})  # unscaled, and said so
    return out, time.perf_counter() - t0


def within_budget(wanted: dict, prof, budget: float = ORDER_BUDGET_S,
                  repeats: int = ORDER_REPEATS) -> tuple[dict, list]:  # fmt: skip
    """(the shapes of ``wanted`` whose orders fit ``budget`` seconds, as
    ``prof`` estimates them: one of each schedule first (the cheapest;
    1F1B's last), then the cheapest of the rest; the shapes left over)."""

    def seconds(item) -> float:
        (_, _, _), (m, mbs) = item
        return (1 + 2 * repeats) * m * (sum(prof.forward[mbs]) + sum(prof.backward[mbs]))

    cheapest = sorted(wanted.items(), key=seconds)
    firsts = {}  # (schedule, v) -> its cheapest shape
    for (schedule, pp, v), _ in cheapest:
        firsts.setdefault((schedule, v), (schedule, pp, v))

    def rank(item) -> tuple:
        # one shape of each schedule first (the others can borrow its ratios), 1F1B's last of
        # them (its order keeps each backward near its forward, as the profile does: 1.02-1.04),
        # then the rest; the cheapest first within each
        return (item[0] not in firsts.values(), item[0][0] == "1f1b", seconds(item))

    kept, over, total = {}, [], 0.0
    for item in sorted(cheapest, key=rank):
        if total + seconds(item) > budget:
            over.append(item[0])
            continue
        kept[item[0]] = item[1]
        total += seconds(item)
    return kept, over


def ratios(layers: list, params: list[float], batch, wanted: dict, split_layers=None,
           repeats: int = ORDER_REPEATS,
           deadline: float | None = None) -> dict[Shape, dict[str, float]]:  # fmt: skip
    """Per shape of ``wanted`` (``shapes``'s), per pass kind: its time in the
    schedule's order over its time with each micro-batch's passes back to
    back. ``batch(n)``: a micro-batch of n samples' inputs; ``split_layers``:
    the layers split as zero-bubble's are (``profile._split_copies``).
    Past ``deadline`` (``time.perf_counter``'s) no further shape starts,
    where the profile's estimate fell short of the clock."""
    out = {}
    for (schedule, pp, v), (m, mbs) in wanted.items():
        if deadline is not None and time.perf_counter() > deadline:
            break
        layer_list = split_layers if schedule == "zb1" and split_layers else layers
        cuts = balanced_cuts(params, pp * v)
        stages = [torch.nn.Sequential(*layer_list[cuts[s] : cuts[s + 1]]) for s in range(pp * v)]
        inputs = _stage_inputs(stages, batch(mbs))
        acts = {r: [a for a in a_list if a.is_compute]
                for r, a_list in build_schedule(schedule, pp, m, v).items()}  # fmt: skip
        back_to_back = {r: sorted(a, key=_micro_batch_order) for r, a in acts.items()}
        _run(stages, inputs, back_to_back)  # warm up: the heap, the lazy paths
        samples: dict[str, list[float]] = {}
        for _ in range(repeats):
            ref, own = _run(stages, inputs, back_to_back), _run(stages, inputs, acts)
            for kind in ref:
                samples.setdefault(kind, []).append(own[kind] / ref[kind])
        out[(schedule, pp, v)] = {k: statistics.median(s) for k, s in samples.items()}
    return out


def summary(order: dict) -> str | None:
    """The report's line: how far the schedules' orders moved their passes."""
    if not order:
        return None
    measured = {shape: kinds for shape, kinds in order.items() if kinds}
    over = [shape for shape in order if shape not in measured]
    lent = sum(borrowed(shape, order) is not None for shape in over)
    left = ""
    if over:
        left = (f"; {len(over)} of {len(order)} pipeline shapes unmeasured, past the time the "
                f"plan had left for them (its measuring within {PLAN_SECONDS:g} s, the orders' "
                f"at most {ORDER_BUDGET_S:g}): {lent} scaled by their schedule's at another pp, "
                f"{len(over) - lent} left unscaled")  # fmt: skip
    if not measured:
        return f"passes in their schedule's order: not measured{left} (docs/plan.md)"
    (schedule, pp, v), kinds = max(measured.items(), key=lambda kv: max(kv[1].values()))
    every = [r for k in measured.values() for r in k.values()]
    name = f"{schedule}{f' v{v}' if v > 1 else ''} at pp {pp}"
    passes = ", ".join(f"{k} {r:.2f}x" for k, r in kinds.items())
    return (
        f"passes in their schedule's order took {min(every):.2f}-{max(every):.2f}x their "
        "time with each micro-batch's passes back to back, measured here "
        f"(the most: {name}, {passes}); each layout's passes are scaled by its "
        f"schedule's{left} (docs/plan.md)"
    )


def _on_core(prof) -> float:
    """The share of the model's profiled time its layers spent on a core."""
    total = on = 0.0
    for mbs, shares in prof.cpu_share.items():
        for share, f, b in zip(shares, prof.forward[mbs], prof.backward[mbs], strict=True):
            total += f + b
            on += share * (f + b)
    return on / total if total else 0.0


def _micro_batch_order(a) -> tuple[int, int, int]:
    return (a.microbatch, a.stage, "FBIW".index(str(a.kind)))


def _stage_inputs(stages: list, x) -> list:
    """Each stage's input for the micro-batch ``x`` (the stages before it run
    without autograd)."""
    inputs = []
    with torch.no_grad():
        for stage in stages:
            inputs.append(x)
            x = stage(x)
    return inputs


def _run(stages: list, inputs: list, acts: dict) -> dict[str, float]:
    """Seconds per pass kind of every rank's ``acts`` run in their order,
    one rank after another: a forward keeps its output for the backward
    (B, or I whose deferred weight jobs W runs), as the executor does."""
    from clawcomm.pipeline.weight_grad import WeightGradStore, deferring

    seconds: dict[str, float] = {}
    for rank_acts in acts.values():
        outs, stores = {}, {}
        for a in rank_acts:
            kind, key = str(a.kind), (a.stage, a.microbatch)
            t0 = time.perf_counter()
            if kind == "F":
                x = inputs[a.stage]
                outs[key] = stages[a.stage](x.detach().requires_grad_(x.is_floating_point()))
            elif kind == "W":
                stores.pop(key).run()
            else:
                out = outs.pop(key)
                if kind == "I":
                    stores[key] = WeightGradStore()
                    with deferring(stores[key]):
                        out.backward(torch.ones_like(out))
                else:
                    out.backward(torch.ones_like(out))
            seconds[kind] = seconds.get(kind, 0.0) + time.perf_counter() - t0
        for stage in stages:
            stage.zero_grad(set_to_none=True)
    return seconds
