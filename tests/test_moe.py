"""The mixture-of-experts GPT (train/moe.py) and expert parallelism
(parallel/expert.py): routing, capacity and the auxiliary losses on their
own; every layout (dp x ep x pp, each schedule, top-1 and top-2, tight
capacity) against single-process training written out here; checkpoints
across ep; memory at 1/ep; the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _training import _train_slices as _train

from clawcomm.launch import run_ranks
from clawcomm.parallel.split import Split, cut_parameter, split_of
from clawcomm.train import TrainConfig, Trainer, moe
from clawcomm.train import models as train_models
from clawcomm.train.data import global_batches

MOE = dict(model="moe", dim=32, heads=2, layers=2, seq_len=16, experts=4, lr=3e-3,
           lr_decay="none", clip=0.5, steps=3, quiet=True, microbatches=2,
           micro_batch_size=2)  # fmt: skip


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{**MOE, **kw})


# ---- routing, capacity, the auxiliary losses ------------------------------------------


def test_top1_takes_the_likeliest_expert_and_top2_renormalises_its_two_gates():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    r1 = moe.route(logits, 1, 0.0)
    assert r1.chosen.squeeze(1).tolist() == [0, 2]
    torch.testing.assert_close(r1.gates.squeeze(1), logits.softmax(-1).max(-1).values)
    r2 = moe.route(logits, 2, 0.0)
    assert r2.chosen.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(r2.gates.sum(-1), torch.ones(2))
    p = logits.softmax(-1)
    torch.testing.assert_close(r2.gates[0, 0] / r2.gates[0, 1], p[0, 0] / p[0, 1])
    assert r2.keep.all()


def test_capacity_keeps_first_choices_first_in_token_order():
    """Six tokens all prefer expert 0, then expert 1; 4 experts, top-2,
    factor 1: each expert takes ceil(6 * 2 / 4) = 3 slots. Expert 0 keeps
    tokens 0-2's first choices; expert 1 is every token's second choice
    and keeps tokens 0-2's."""
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]]).repeat(6, 1)
    assert moe.capacity(6, 4, 2, 1.0) == 3
    r = moe.route(logits, 2, 1.0)
    assert r.keep[:, 0].tolist() == [True] * 3 + [False] * 3
    assert r.keep[:, 1].tolist() == [True] * 3 + [False] * 3
    # A first choice beats an earlier token's second choice for the same expert.
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 2 + [[0.0, 3.0, 2.0, 0.0]] * 2)
    r = moe.route(logits, 2, 0.5)  # capacity ceil(0.5 * 4 * 2 / 4) = 1
    assert r.keep.tolist() == [[True, False], [False, False], [True, True], [False, False]]


def test_the_aux_losses_by_hand():
    """Zero logits: every expert equally likely (P = 1/E); top-2 picks
    experts 0 and 1 for every token (f = 1/2 each): the balance loss
    E * sum f P = 1; the z-loss log(E)^2."""
    r = moe.route(torch.zeros(8, 4), 2, 0.0)
    torch.testing.assert_close(r.balance, torch.tensor(1.0))
    torch.testing.assert_close(r.z, torch.tensor(math.log(4) ** 2))
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    r = moe.route(logits, 1, 0.0)
    f = torch.bincount(logits.argmax(-1), minlength=4).float() / 10
    torch.testing.assert_close(r.balance, 4 * (f * logits.softmax(-1).mean(0)).sum())


def test_the_aux_losses_join_the_objective_with_their_weights():
    """The layer's gradient equals autograd's of (output . g) + aux_scale *
    (balance_coeff * balance + z_coeff * z), the routing recomputed
    outside."""
    torch.manual_seed(0)
    layer = moe.MoE(8, 4, top_k=2, balance_coeff=0.3, z_coeff=0.2)
    layer.aux_scale = 0.25
    x = torch.randn(2, 5, 8)
    g = torch.randn(2, 5, 8)
    (layer(x) * g).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    tokens = x.reshape(-1, 8)
    r = moe.route(layer.router(tokens), 2, 0.0)
    from clawcomm.parallel.expert import dispatch

    out = dispatch(tokens, r.chosen, r.gates, r.keep, layer.experts, None)
    objective = (out.view_as(x) * g).sum() + 0.25 * (0.3 * r.balance + 0.2 * r.z)
    objective.backward()
    torch.testing.assert_close(got, layer.router.weight.grad)


def test_an_evaluation_counts_no_routing_and_adds_no_aux_gradient():
    layer = moe.MoE(8, 4)
    moe.ROUTING.lap()
    with torch.no_grad():
        layer(torch.randn(1, 4, 8))
    assert moe.ROUTING.lap() == (0.0,) * 5


def test_a_parameter_cut_twice_takes_and_boxes_its_part():
    """Tensor-parallel experts are cut along hidden, then along the expert
    dimension: the part taken, and the checkpoint's boxes, are the product."""
    whole = torch.arange(4 * 3 * 6.0).view(4, 3, 6)
    p = torch.nn.Parameter(whole.clone())
    cut_parameter(p, 2, ((2, 2),))
    cut_parameter(p, 0, ((1, 2),))
    assert torch.equal(p.detach(), whole[1:3, :, 2:4])
    assert split_of(p).local_shape() == (2, 3, 2) and split_of(p).whole == (4, 3, 6)
    assert torch.equal(split_of(p).take(whole), p.detach())
    assert split_of(p).boxes() == [((1, 0, 2), (2, 3, 2), (0, 0, 0))]
    qkv = Split((6, 2), 0, ((0, 1), (3, 1))).cut(1, ((1, 1),))
    assert qkv.boxes() == [((0, 1), (1, 1), (0, 0)), ((3, 1), (1, 1), (1, 0))]
    with pytest.raises(ValueError, match="dimension 0 of \\[6, 2\\] is cut already"):
        qkv.cut(0, ((0, 1),))


# ---- every layout against one process --------------------------------------------------


def _reference(cfg: TrainConfig):
    """One process, written out: the whole model, each micro-batch of the
    effective batch in turn (the groups every layout routes together),
    each one's LM loss over the batch's tokens and its aux losses weighted
    1 / micro-batches, torch's clipping, the optimizer. Returns the losses,
    norms, dropped slots per step and the final weights."""
    one = dataclasses.replace(cfg, dp=1, ep=1, pp=1, schedule="1f1b", virtual_stages=1)
    model, loss_fn, make_opt, ds, _, _ = train_models.build(one)
    rounds = cfg.microbatches * cfg.accumulation * cfg.dp
    moe.set_aux_scale(model, 1.0 / rounds)
    params = list({id(p): p for p in model.parameters()}.values())
    opt = make_opt(params)
    losses, norms, dropped = [], [], []
    batches = global_batches(ds, cfg.effective_batch, cfg.seed)
    for _, (x, y) in zip(range(cfg.steps), batches, strict=False):
        moe.ROUTING.lap()
        total = 0.0
        for xs, ys in zip(
            x.split(cfg.micro_batch_size), y.split(cfg.micro_batch_size), strict=True
        ):
            loss = loss_fn(model(xs), ys) / y.numel()
            loss.backward()
            total += loss.item()
        dropped.append(int(moe.ROUTING.lap()[1]))
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        norms.append(float(norm))
    return losses, norms, dropped, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(results, cfg, atol=1e-5):
    losses, norms, dropped, want = _reference(cfg)
    for metrics, _ in results:
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
        assert [m["grad_norm"] for m in metrics] == pytest.approx(norms, rel=1e-4)
        assert [m["dropped_tokens"] for m in metrics] == dropped
    seen = set()
    for _, params in results:
        for name, (p, split) in params.items():
            expect = split.take(want[name]) if split is not None else want[name]
            torch.testing.assert_close(
                p, expect, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
            seen.add(name)
    assert seen == set(want)


# SGD: AdamW turns a rounding difference in a gradient near its eps into
# one of up to lr in a weight, which no tolerance on weights survives.
SGD = dict(optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize(
    "kw",
    [
        dict(dp=2, ep=2),
        dict(dp=2, ep=1),
        dict(dp=4, ep=2, microbatches=1),
        dict(dp=4, ep=4, microbatches=1),
        dict(dp=2, ep=2, pp=2, schedule="1f1b", microbatches=4),
        dict(dp=2, ep=2, pp=2, schedule="zb1", microbatches=4),
        dict(dp=2, ep=2, pp=2, schedule="interleaved", virtual_stages=2, layers=4, microbatches=4),
        dict(dp=2, ep=2, zero=1),
        dict(dp=4, ep=2, zero=2, microbatches=1),
        dict(dp=2, ep=2, zero=3),
        dict(dp=2, ep=1, zero=3),
        dict(dp=4, ep=2, zero=3, microbatches=1),
        dict(dp=2, ep=2, pp=2, zero=3, microbatches=4),
        dict(tp=2),
        dict(tp=2, sequence_parallel=False),
        dict(dp=2, ep=2, tp=2),
        dict(dp=2, ep=2, tp=2, sequence_parallel=False, zero=1),
        dict(tp=2, pp=2, schedule="1f1b", microbatches=4),
    ],
    ids=[
        "dp2-ep2",
        "dp2-ep1",
        "dp4-ep2",
        "dp4-ep4",
        "ep2-pp2",
        "ep2-pp2-zb1",
        "ep2-interleaved",
        "ep2-zero1",
        "dp4-ep2-zero2",
        "ep2-zero3",
        "ep1-zero3",
        "dp4-ep2-zero3",
        "ep2-pp2-zero3",
        "tp2",
        "tp2-nosp",
        "ep2-tp2",
        "ep2-tp2-nosp-zero1",
        "tp2-pp2",
    ],  # fmt: skip
)
def test_every_layout_trains_like_one_process(kw, top_k):
    cfg = _config(top_k=top_k, **SGD, **kw)
    _check(run_ranks(_train, cfg.world, cfg), cfg)


def test_tight_capacity_drops_the_same_slots_at_every_ep():
    cfg = _config(dp=2, ep=2, capacity_factor=1.0, moe_every=2, layers=4, **SGD)
    results = run_ranks(_train, 2, cfg)
    assert results[0][0][0]["dropped_tokens"] > 0
    _check(results, cfg)


def test_adamw_losses_match_over_ten_steps_and_reruns_are_bitwise_equal():
    """The issue's equivalence: ep 2 and ep 4 give ep 1's losses within 1e-5
    over 10 steps (AdamW), and a rerun of one layout the same bits."""
    base = _config(steps=10, dp=4, microbatches=1)
    ep1 = run_ranks(_train, 4, base)
    for ep in (2, 4):
        got = run_ranks(_train, 4, dataclasses.replace(base, ep=ep))
        a = [m["loss"] for m in ep1[0][0]]
        assert [m["loss"] for m in got[0][0]] == pytest.approx(a, rel=1e-5)
    again = run_ranks(_train, 4, dataclasses.replace(base, ep=4))
    assert [m["loss"] for m in again[0][0]] == [m["loss"] for m in got[0][0]]
    for (_, pa), (_, pb) in zip(got, again, strict=True):
        assert all(torch.equal(pa[n][0], pb[n][0]) for n in pa)


def test_expert_parallelism_runs_on_gloo_too():
    cfg = _config(dp=2, ep=2, **SGD)
    _check(run_ranks(_train, 2, cfg, backend="gloo"), cfg)


# ---- checkpoints, memory, metrics -------------------------------------------------------


@pytest.mark.parametrize(
    "saved,loaded",
    [
        (dict(dp=2, ep=2), dict(dp=2, ep=1)),
        (dict(dp=2, ep=1), dict(dp=4, ep=4, microbatches=1)),
        (dict(dp=4, ep=4, microbatches=1), dict(dp=2, ep=2, pp=2, microbatches=2)),
        (dict(dp=2, ep=2, zero=2), dict(dp=2, ep=1, zero=1)),
        (dict(dp=4, ep=2, zero=3, microbatches=1), dict(dp=2, ep=2, zero=1)),
        (dict(dp=2, ep=2, tp=2), dict(dp=2, ep=1)),
        (dict(dp=2, ep=1), dict(dp=2, ep=2, tp=2, sequence_parallel=False)),
    ],
    ids=[
        "ep2-to-ep1",
        "ep1-to-ep4",
        "ep4-to-ep2-pp2",
        "ep2-zero2-to-ep1-zero1",
        "ep2-zero3-to-zero1",
        "ep2-tp2-to-ep1",
        "ep1-to-ep2-tp2",
    ],
)
def test_a_checkpoint_loads_at_another_ep(tmp_path, saved, loaded):
    """Saved after 2 steps at one ep, loaded at another with the same global
    batch: the run goes on as one process's (experts resharded)."""
    a = _config(steps=4, **saved)
    run_ranks(_train, a.world, dataclasses.replace(a, steps=2), str(tmp_path))
    b = _config(steps=4, **loaded)
    assert b.effective_batch == a.effective_batch
    results = run_ranks(_train, b.world, b, None, str(tmp_path))
    losses = _reference(_config(steps=4, **saved))[0]
    for metrics, _ in results:
        assert [m["loss"] for m in metrics] == pytest.approx(losses[2:], rel=1e-5)


def _held(rank, world, cfg):
    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = tr.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    tr.close()
    return metrics[-1]


def test_experts_and_their_optimizer_state_are_one_ep_th_per_rank():
    cfg = _config(dp=4, microbatches=1, steps=2)
    whole = run_ranks(_held, 4, cfg)[0]
    spread = run_ranks(_held, 4, dataclasses.replace(cfg, ep=4))[0]
    model = train_models.build(cfg)[0]
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    assert whole["param_bytes"] - spread["param_bytes"] == experts * 3 // 4
    # AdamW keeps two moments per element (and a step count per tensor)
    assert whole["optim_bytes"] - spread["optim_bytes"] == 2 * experts * 3 // 4
    assert spread["bytes_sent_ep"] > 0 and whole["bytes_sent_ep"] == 0
    for key in ("dropped_fraction", "balance_loss", "z_loss", "ep_ms"):
        assert key in spread


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(dp=2, ep=3), "ep 3 must divide dp 2"),
        (dict(dp=4, ep=4, experts=6), "experts 6 must be a multiple of ep 4"),
        (dict(activation_checkpoint="full"), "activation_checkpoint full with --model moe"),
        (dict(model="gpt", ep=2, dp=2), "ep 2 spreads experts: it needs --model moe"),
        (dict(top_k=3), "top_k 3 is not one of"),
        (dict(capacity_factor=-1.0), "capacity_factor must be >= 0"),
    ],
)
def test_refusals_name_the_setting(kw, words):
    with pytest.raises(ValueError, match=words):
        _config(**kw).check()


@pytest.mark.parametrize(
    "kw",
    [dict(compression="topk:0.25"), dict(zero=1), dict(zero=3)],
    ids=["topk", "zero1", "zero3"],
)
def test_resuming_at_ep_2_is_exact(tmp_path, kw):
    """At ep 2 the reducer holds the dense parameters only: their
    error-feedback residuals are saved and loaded by its own indices, and
    under ZeRO the experts' optimizer state, outside the shards, with them."""
    cfg = _config(dp=2, ep=2, steps=4, **kw)
    straight = run_ranks(_train, 2, cfg)
    run_ranks(_train, 2, dataclasses.replace(cfg, steps=2), str(tmp_path))
    resumed = run_ranks(_train, 2, cfg, None, str(tmp_path))
    assert [m["loss"] for m in resumed[0][0]] == [m["loss"] for m in straight[0][0]][2:]
    for (_, pa), (_, pb) in zip(straight, resumed, strict=True):
        assert all(torch.equal(pa[n][0], pb[n][0]) for n in pa)


# ---- the plan -----------------------------------------------------------------------------


def test_the_plan_searches_ep_and_prices_its_all_to_alls_and_memory():
    """ep widths that divide dp, as flags the trainer takes; what each MoE
    layer's experts hold and send (the expert room's answer); an ep 2
    layout predicted with its all-to-alls and half the experts' state."""
    from clawcomm.parallel.expert import traffic
    from clawcomm.plan import search as plan

    cands = list(plan.candidates(4, 4, 16, eps=(1, 2, 4)))
    assert {(c.dp, c.ep) for c in cands if c.pp == 1} == {(4, 1), (4, 2), (4, 4)}
    assert {c.ep for c in cands if c.dp == 2} == {1, 2}
    c = plan.Candidate(2, 1, "1f1b", 1, 2, 4, 0, ep=2)
    assert c.flags()[:4] == ["--dp", "2", "--ep", "2"] and "(ep 2)" in c.name()
    assert plan.apply(_config(), c).ep == 2
    model = train_models.build(_config())[0]
    per_layer = traffic([moe.layers_of(layer) for layer in model], 4, 16)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert sum(e for e, _ in per_layer) == experts
    assert [b for _, b in per_layer] == [0.0, 4.0 * 4 * 16 * 2 * 32, 4.0 * 4 * 16 * 2 * 32, 0.0]

    preds, _, prof = plan.plan(_config(micro_batch_size=4), 2)
    by_shape = {(p.cand.dp, p.cand.ep, p.cand.zero, p.cand.pp): p for p in preds}
    one, two = by_shape[(2, 1, 0, 1)], by_shape[(2, 2, 0, 1)]
    assert two.memory_mb < one.memory_mb
    assert two.compute_ms > one.compute_ms - 1e-9  # the all-to-alls, inside the passes
