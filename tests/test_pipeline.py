"""Pipeline schedules, the validator and the clock (and their agreement with
torch.distributed.pipelining's), the I/W split, and the executor against
single-process training for every schedule."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.schedules import _simulate_comms_compute, _validate_schedule

from clawcomm.launch import run_ranks
from clawcomm.pipeline import build_schedule, format_schedule, parse_schedule
from clawcomm.pipeline.actions import Action, to_torch
from clawcomm.pipeline.clock import timing
from clawcomm.pipeline.executor import PipelineExecutor
from clawcomm.pipeline.schedules import check_schedule_args
from clawcomm.pipeline.validate import ScheduleError, validate
from clawcomm.pipeline.weight_grad import WeightGradStore, deferring, split_linear_backward

CASES = [
    (name, pp, m, v)
    for pp in (1, 2, 3, 4)
    for m in sorted({pp, pp + 1, 2 * pp, 7})
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2))
    if m >= pp and not (name == "interleaved" and m % pp)
]


def _closed_form(name, pp, m, v):
    """The bubble with f = 1, b = 2 (i = w = 1) per stage of one-stage-per-
    rank cost (a virtual stage costs 1/v of it)."""
    if name == "interleaved":
        return (pp - 1) / (v * m + pp - 1)
    if name == "zb1":
        return (pp - 1) / (3 * m + pp - 1)
    return (pp - 1) / (m + pp - 1)


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_schedules_validate_here_and_in_torch_and_match_their_bubble(name, pp, m, v):
    sched = build_schedule(name, pp, m, v)
    validate(sched, pp, pp * v, m)
    _validate_schedule(to_torch(sched, comms=False), pp, pp * v, m)
    _simulate_comms_compute(to_torch(sched), lambda s: s % pp, pp * v)
    sim = timing(sched, {"F": 1 / v, "B": 2 / v, "I": 1 / v, "W": 1 / v})
    assert sim.bubble == pytest.approx(_closed_form(name, pp, m, v), abs=1e-9)
    assert parse_schedule(format_schedule(sched)) == sched


def test_zero_bubble_holds_at_most_half_of_1f1b_bubble():
    for pp in (2, 4):
        for m in (4, 8, 16):
            costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
            zb = timing(build_schedule("zb1", pp, m), costs).bubble
            ofob = timing(build_schedule("1f1b", pp, m), costs).bubble
            assert zb <= 0.5 * ofob, (pp, m, zb, ofob)


def test_action_notation_round_trips_and_bad_strings_are_named():
    for text in ("0F0", "12B3", "3I10", "1W0", "0SEND_F3", "1RECV_F3", "2SEND_B0", "2RECV_B1"):
        assert str(Action.parse(text)) == text
    assert str(Action.parse("2REDUCE_GRAD")) == "2REDUCE_GRAD"
    for bad in ("F0", "0X1", "0F", "1REDUCE_GRAD2", ""):
        with pytest.raises(ValueError, match="pipeline action"):
            Action.parse(bad)


def test_schedule_settings_errors_name_the_value():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        check_schedule_args("pipedream", 2, 4)
    with pytest.raises(ValueError, match="needs at least pp=4 micro-batches.*microbatches=2"):
        check_schedule_args("1f1b", 4, 2)
    with pytest.raises(ValueError, match="microbatches=6 is not a multiple of 4"):
        check_schedule_args("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual stages v=2 need --schedule interleaved"):
        check_schedule_args("zb1", 2, 4, 2)


# ---- broken lists -------------------------------------------------------------------


def _edit(sched, rank, drop=None, swap=None, insert=None):
    out = {r: list(a) for r, a in sched.items()}
    acts = out[rank]
    if drop is not None:
        acts.remove(Action.parse(drop))
    if swap is not None:
        i, j = (acts.index(Action.parse(a)) for a in swap)
        acts[i], acts[j] = acts[j], acts[i]
    if insert is not None:
        at, action = insert
        acts.insert(at, Action.parse(action))
    return out


def _torch_rejects(sched, pp, stages, m) -> bool:
    try:
        _validate_schedule(to_torch(sched, comms=False), pp, stages, m)
        _simulate_comms_compute(to_torch(sched), lambda s: s % pp, stages)
    except (AssertionError, ValueError, RuntimeError):
        return True
    return False


BROKEN = [
    # (what, edit, expected message); torch's validator rejects all but the
    # last (it counts micro-batches in sets, so a repeat goes unseen)
    ("receive removed", dict(rank=1, drop="1RECV_F2"),
     r"rank 1, action \d+ \(1F2\): needs the activation of micro-batch 2 from stage 0 "
     r"\(1RECV_F2\), which rank 1 has not posted before it"),
    ("backward before forward", dict(rank=0, swap=("0F1", "0B1")),
     r"rank 0, action \d+ \(0B1\): needs the forward of micro-batch 1 on stage 0"),
    ("send removed", dict(rank=0, drop="0SEND_F3"),
     r"rank 1, action \d+ \(1RECV_F3\): waits for micro-batch 3, but rank 0 never runs the "
     r"matching 0SEND_F3"),
    ("micro-batch left out", dict(rank=1, drop="1B3"),
     r"rank 1, action \d+ \(1SEND_B3\): needs the backward of micro-batch 3 on stage 1 "
     r"\(1B3 or 1I3\), which rank 1 has not run before it"),
    ("stage on the wrong rank", dict(rank=0, insert=(0, "1F0")), r"stage 1 lives on rank 1"),
    ("micro-batch that does not exist", dict(rank=0, insert=(0, "0F9")),
     r"micro-batch 9 does not exist \(0..3\)"),
    ("run twice", dict(rank=0, insert=(2, "0F0")), r"\(0F0\): runs twice"),
]  # fmt: skip


@pytest.mark.parametrize("what,edit,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_validator_names_rank_action_and_what_is_missing(what, edit, message):
    sched = _edit(build_schedule("1f1b", 2, 4), **edit)
    with pytest.raises(ScheduleError, match=message):
        validate(sched, 2, 2, 4)
    assert _torch_rejects(sched, 2, 2, 4) == (what != "run twice")


def test_validator_finds_a_deadlock_torch_finds_too():
    """Each rank's list is fine on its own; together they wait on each
    other: rank 0 wants micro-batch 0's gradient before it sends micro-batch
    1, rank 1 wants micro-batch 1 first."""
    sched = parse_schedule(
        {
            0: "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1".split(),
            1: "1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F0 1F0 1B0 1SEND_B0".split(),
        }
    )
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at action 2 \(0RECV_B0\)|deadlock:"):
        validate(sched, 2, 2, 2)
    with pytest.raises(ScheduleError, match=r"rank 1 at action 1 \(1F1\) waits for 0SEND_F1"):
        validate(sched, 2, 2, 2)
    assert _torch_rejects(sched, 2, 2, 2)


def test_the_clock_counts_transfer_latency():
    sched = build_schedule("gpipe", 2, 1)
    assert timing(sched, {"F": 1, "B": 1}).makespan == 4
    assert timing(sched, {"F": 1, "B": 1}, latency=0.5).makespan == 5


# ---- the I/W split ---------------------------------------------------------------------


def test_split_linear_gives_autograd_gradients_in_two_passes():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 3))
    split = _clone(ref)
    assert split_linear_backward(split) == 2
    x = torch.randn(4, 7, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa).square().sum().backward()
    store = WeightGradStore()
    with deferring(store):
        split(xb).square().sum().backward()
    assert len(store) == 2
    lin0, norm, lin1 = split[0], split[2], split[3]
    assert lin0.weight.grad is None and lin1.bias.grad is None  # waiting for W
    assert norm.weight.grad is not None  # not a linear layer: done in I
    torch.testing.assert_close(xb.grad, xa.grad)
    store.run()
    for (n, a), b in zip(ref.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
        assert not b.grad.requires_grad, n
    # Outside `deferring` the same module does a full backward.
    split.zero_grad()
    split(x).square().sum().backward()
    for a, b in zip(ref.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def _clone(module):
    import copy

    return copy.deepcopy(module)


# ---- the executor against one process -------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    layers = []
    for i in range(8):
        layers += [nn.Linear(6 if i == 0 else 10, 10), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(10, 3))


def _data(m, mbs):
    g = torch.Generator().manual_seed(1)
    return torch.randn(m * mbs, 6, generator=g), torch.randn(m * mbs, 3, generator=g)


def _pipeline_grads(rank, world, name, v, m, mbs):
    full = _mlp()
    layers = list(full)
    stages_n = world * v
    cuts = [round(i * len(layers) / stages_n) for i in range(stages_n + 1)]
    stages = {
        s: nn.Sequential(*layers[cuts[s] : cuts[s + 1]])
        for s in range(stages_n)
        if s % world == rank
    }
    if name == "zb1":
        for st in stages.values():
            split_linear_backward(st)
    sched = build_schedule(name, world, m, v)
    x, y = _data(m, mbs)
    ex = PipelineExecutor(
        stages, sched[rank], stages_n, m, rank, world, None,
        loss_fn=lambda o, t: ((o - t) ** 2).sum(),
    )  # fmt: skip
    losses = []
    for _ in range(2):  # twice: the second run has shapes known and receives posted early
        for p in full.parameters():
            p.grad = None
        st = ex.run(list(x.chunk(m)), list(y.chunk(m)), loss_scale=1.0 / (m * mbs))
        losses.append(sum(float(v) for v in st.losses))
    names = dict((id(p), n) for n, p in full.named_parameters())
    grads = {names[id(p)]: p.grad for mod in stages.values() for p in mod.parameters()}
    return grads, losses


@pytest.mark.parametrize(
    "name,pp,v,m,mbs",
    [
        ("gpipe", 2, 1, 3, 2),
        ("gpipe", 4, 1, 1, 3),
        ("1f1b", 2, 1, 5, 1),
        ("1f1b", 3, 1, 4, 2),
        ("1f1b", 4, 1, 6, 1),
        ("zb1", 2, 1, 3, 2),
        ("zb1", 4, 1, 5, 1),
        ("interleaved", 1, 3, 2, 2),
        ("interleaved", 2, 2, 4, 1),
        ("interleaved", 3, 2, 6, 1),
    ],
)
def test_executor_matches_single_process(name, pp, v, m, mbs):
    full = _mlp()
    x, y = _data(m, mbs)
    loss = ((full(x) - y) ** 2).sum() / (m * mbs)
    loss.backward()
    loss = loss.detach()
    want = dict(full.named_parameters())
    results = run_ranks(_pipeline_grads, pp, name, v, m, mbs)
    got = {}
    for grads, _ in results:
        got.update(grads)
    assert sorted(got) == sorted(want)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n].grad, atol=1e-6, rtol=1e-5, msg=n)
    total = [sum(r[1][k] for r in results) / (m * mbs) for k in range(2)]
    assert total == pytest.approx([loss.item()] * 2, rel=1e-5)


def test_the_package_docstring_runs_as_written():
    """The usage lines in clawcomm.pipeline's docstring, executed as they are."""
    import clawcomm.pipeline as pipeline

    lines = [ln[4:].split("#")[0] for ln in pipeline.__doc__.splitlines() if ln.startswith("    ")]
    namespace: dict = {}
    exec("\n".join(lines[:-1]), namespace)  # noqa: S102
    bubble = eval(lines[-1], namespace)  # noqa: S307 - the last line is an expression
    assert bubble == pytest.approx(3 / 11)


@pytest.mark.parametrize("name,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("zb1", 4, 8, 1),
                                         ("interleaved", 2, 4, 2), ("1f1b", 1, 4, 1)])  # fmt: skip
def test_what_a_schedule_holds_for_backward(name, pp, m, v):
    # Each stage's forward holds 1 (or its stage number + 1) until its
    # backward (B, or zero-bubble's I): GPipe holds every micro-batch,
    # 1F1B a rank's depth (pp - r), pp 1 one micro-batch.
    from clawcomm.pipeline.schedules import held_for_backward

    sched = build_schedule(name, pp, m, v)
    held = {r: held_for_backward(sched[r], lambda s: 1.0) for r in sched}
    if name == "gpipe":
        assert held == dict.fromkeys(range(pp), m)
    elif name in ("1f1b", "zb1"):
        assert held == {r: min(m, pp - r) for r in range(pp)}
    else:  # interleaved: more than 1F1B's depth, at most every stage's micro-batches
        assert all(pp - r < held[r] <= m * v for r in range(pp))
    weighted = held_for_backward(sched[0], lambda s: s + 1.0)
    assert weighted >= held[0]
