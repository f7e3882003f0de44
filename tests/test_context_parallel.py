"""Context parallelism (parallel/context.py, ``--cp``): which tokens a rank
holds; ring and all-gather attention against torch's causal attention,
forward and backward, in float64; every layout (cp alone, with dp, pp and
each schedule, tp with sequence parallelism, ZeRO-3) against single-process
training; the held-out loss; checkpoints across cp; the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _training import _check_against_reference, _config, _reference, _train, _train_slices

from clawcomm.launch import run_ranks
from clawcomm.parallel import context

# ---- which tokens --------------------------------------------------------------------


def test_each_rank_holds_chunk_i_and_its_mirror():
    assert context.chunks(0, 2) == (0, 3) and context.chunks(1, 2) == (1, 2)
    assert context.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = sorted(p for r in range(4) for p in context.positions(16, 4, r).tolist())
    assert held == list(range(16))  # every token on one rank
    x = torch.arange(16).view(1, 16)
    assert context.take(x, 4, 1).tolist() == [[2, 3, 12, 13]]
    with pytest.raises(ValueError, match="not a multiple of 2 cp"):
        context.positions(10, 3, 0)


def _attention(rank, world, method, seq):
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, seq, 8, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True)
    (out * g).sum().backward()
    group = dist.new_group(list(range(world)))
    mine = [context.take(t, world, rank, 2).clone().requires_grad_() for t in (q, k, v)]
    fn = context.ring_attention if method == "ring" else context.allgather_attention
    o = fn(*mine, group)
    (o * context.take(g, world, rank, 2)).sum().backward()
    errors = [(o - context.take(out, world, rank, 2)).abs().max().item()]
    for m, w in zip(mine, whole, strict=True):
        errors.append((m.grad - context.take(w.grad, world, rank, 2)).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_over_the_group_is_causal_attention_forward_and_backward(method, cp):
    """Each rank's output and its queries', keys' and values' gradients are
    torch's causal attention's over the whole sequence, to float64's
    rounding."""
    assert max(run_ranks(_attention, cp, method, 4 * cp)) < 1e-12


# ---- training against one process ------------------------------------------------------

# SGD: AdamW turns a rounding difference in a gradient near its eps into one
# of up to lr in a weight (test_moe says more).
SGD = dict(optimizer="sgd", lr=0.1, seq_len=32, micro_batch_size=2, microbatches=2)


@pytest.mark.parametrize(
    "kw",
    [
        dict(cp=2),
        dict(cp=4),
        dict(cp=2, cp_method="allgather"),
        dict(cp=2, dp=2),
        dict(cp=2, pp=2, schedule="1f1b", microbatches=4),
        dict(cp=2, pp=2, schedule="zb1", microbatches=4),
        dict(cp=2, pp=2, schedule="interleaved", virtual_stages=2, layers=4, microbatches=4),
        dict(cp=2, tp=2, heads=2),
        dict(cp=2, tp=2, heads=2, sequence_parallel=False),
        dict(cp=2, dp=2, zero=3, reshard_after_forward=True),
        dict(cp=2, activation_checkpoint="selective"),
    ],
    ids=[
        "cp2",
        "cp4",
        "cp2-allgather",
        "cp2-dp2",
        "cp2-pp2",
        "cp2-pp2-zb1",
        "cp2-interleaved",
        "cp2-tp2-sp",
        "cp2-tp2",
        "cp2-dp2-zero3",
        "cp2-selective",
    ],  # fmt: skip
)
def test_every_layout_trains_like_one_process(kw):
    """Losses, norms and every weight (a TP rank's slices of it) are one
    process's."""
    from test_tensor_parallel import _check

    cfg = _config(**{**SGD, **kw})
    _check(run_ranks(_train_slices, cfg.world, cfg), cfg, atol=1e-5)


def test_adamw_losses_and_norms_match_one_process():
    cfg = _config(cp=2, seq_len=32)
    _check_against_reference(run_ranks(_train, 2, cfg), cfg, atol=float("inf"))


def _held_out(rank, world, cfg):
    from clawcomm.train import Trainer
    from clawcomm.train import models as train_models
    from clawcomm.train.data import global_batches

    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    batches = global_batches(ds, cfg.effective_batch, cfg.seed + 1)
    value = tr.evaluate([next(batches) for _ in range(2)])
    tr.close()
    return value


def test_the_held_out_loss_is_one_processes():
    cfg = _config(**SGD)
    one = run_ranks(_held_out, 1, cfg)[0]
    assert run_ranks(_held_out, 2, dataclasses.replace(cfg, cp=2)) == pytest.approx([one] * 2)


@pytest.mark.parametrize("saved,loaded", [(dict(cp=2), dict()), (dict(), dict(cp=2, pp=2))])
def test_a_checkpoint_loads_at_another_cp(tmp_path, saved, loaded):
    a = _config(**{**SGD, "steps": 4, **saved})
    run_ranks(_train_slices, a.world, dataclasses.replace(a, steps=2), str(tmp_path))
    b = _config(**{**SGD, "steps": 4, **loaded})
    results = run_ranks(_train_slices, b.world, b, None, str(tmp_path))
    want = _reference(_config(**{**SGD, "steps": 4}))[0]
    for metrics, _ in results:
        assert [m["loss"] for m in metrics] == pytest.approx(want[2:], rel=1e-5)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(cp=2, model="mlp"), "cp 2 splits each sequence over ranks: it needs --model gpt"),
        (dict(cp=3, seq_len=16), "seq_len 16 is not a multiple of 6"),
        (dict(cp=2, dp=2, compression="topk:0.1"), "cp 2 with compression 'topk:0.1'"),
        (dict(cp=2, dp=2, sync="local-sgd:4"), "cp 2 with sync 'local-sgd:4'"),
        (dict(cp=2, cp_method="zigzag"), "cp_method 'zigzag' is not one of ring, allgather"),
    ],
)
def test_refusals_name_the_setting(kw, words):
    with pytest.raises(ValueError, match=words):
        _config(**kw).check()


def test_the_world_size_message_names_cp():
    with pytest.raises(ValueError, match=r"dp \* cp \* tp \* pp = 1 \* 2 \* 1 \* 1 = 2 ranks"):
        _config(cp=2).check(4)


def test_the_metrics_say_what_the_ring_carried():
    """A micro-batch's attention sends cp - 1 key/value blocks forward, and
    cp - 1 blocks and cp gradient sums backward, a layer; the figures count
    them on every rank."""
    cfg = _config(**SGD, cp=2)
    m = run_ranks(_train, 2, cfg)[0][0][-1]
    kv = 2 * cfg.micro_batch_size * cfg.heads * (cfg.seq_len // 2) * (cfg.dim // cfg.heads) * 4
    payload = 2 * cfg.layers * cfg.microbatches * (2 * (2 - 1) + 2) * kv
    assert payload <= m["bytes_sent_cp"] <= 1.02 * payload
    assert m["cp_ms"] >= 0 and m["cp_attention_cpu_ms_max"] >= m["cp_attention_cpu_ms_min"] > 0


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_every_rank_computes_the_same_number_of_blocks(cp):
    """The load-balanced mask: over the ring's cp steps each rank computes
    2 cp + 1 blocks of a chunk's queries against a chunk's keys (two of
    them causal), whatever its place in the sequence."""
    counts = [
        sum(1 for s in range(cp) for _ in context._pairs(context.chunks(r, cp),
                                                          context.chunks((r - s) % cp, cp)))
        for r in range(cp)
    ]  # fmt: skip
    assert counts == [2 * cp + 1] * cp


def test_the_plan_searches_cp_and_prices_its_ring_and_memory():
    """cp widths that divide the world and cut the sequence in 2 cp chunks,
    as flags the trainer takes; each attention layer's key/value bytes (the
    CP room's answer); a cp 2 layout holds half the activations and its
    passes half the compute, plus the ring beyond it."""
    from clawcomm.plan import search as plan
    from clawcomm.train import models as train_models

    cands = list(plan.candidates(4, 4, 16, cps=(1, 2, 4)))
    assert {(c.dp, c.cp) for c in cands if c.pp == 1} == {(4, 1), (2, 2), (1, 4)}
    c = plan.Candidate(1, 1, "1f1b", 1, 2, 4, 0, cp=2)
    assert c.flags()[:4] == ["--dp", "1", "--cp", "2"] and "cp 2" in c.name()
    assert c.averaged_over == 2 and c.work_split == 2
    assert plan.apply(_config(), c).cp == 2
    model = train_models.build(_config(seq_len=32))[0]
    kv = context.kv_bytes(model, 32)
    assert kv == [0.0, 2.0 * 4 * 32 * 32, 2.0 * 4 * 32 * 32, 0.0]

    _, _, prof = plan.plan(_config(seq_len=32, micro_batch_size=4, microbatches=2), 2)
    assert prof.kv_bytes == kv
    whole = plan.predict(plan.Candidate(1, 1, "1f1b", 1, 2, 4, 0), prof, 2)
    split = plan.predict(plan.Candidate(1, 1, "1f1b", 1, 2, 4, 0, cp=2), prof, 2)
    assert split.compute_ms < whole.compute_ms
    assert split.memory_mb < whole.memory_mb
