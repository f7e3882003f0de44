"""``clawcomm train --deterministic`` (clawcomm.train.deterministic): at one
micro-batch size and global batch, the losses, gradient norms and weights
are bitwise those of one process for every dp x pp x ZeRO stage and
schedule, for the GPT (its head tied to the embedding), the MLP and the
mixture of experts; without the mode they are not. Settings it cannot keep
bitwise are refused before training."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from _training import _config, _train, _train_slices

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig
from clawcomm.train import deterministic as det

ENV = {det.ENV: "1"}
MICROBATCHES = 8  # in the global batch, of 2 samples each


def _run(dp=1, pp=1, zero=0, schedule="1f1b", v=1, accumulation=1, on=True, **kw):
    """(losses, gradient norms, every parameter by name) of 3 steps."""
    cfg = _config(dp=dp, pp=pp, zero=zero, schedule=schedule, virtual_stages=v,
                  microbatches=MICROBATCHES // (dp * accumulation), accumulation=accumulation,
                  micro_batch_size=2, deterministic=on, **kw)  # fmt: skip
    out = run_ranks(_train, dp * pp, cfg, env=ENV if on else {})
    params = {}
    for _, p in out:
        params.update(p)
    metrics = out[0][0]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], params


def _bits_differ(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))]


@pytest.fixture(scope="module")
def one_process():
    return _run()


@pytest.mark.parametrize(
    "dp,pp,zero,schedule,v,accumulation",
    [
        (2, 1, 0, "1f1b", 1, 1),
        (4, 1, 0, "1f1b", 1, 1),
        (1, 2, 0, "1f1b", 1, 1),
        (1, 2, 0, "gpipe", 1, 1),
        (1, 2, 0, "interleaved", 2, 1),
        (2, 2, 0, "1f1b", 1, 1),
        (2, 1, 1, "1f1b", 1, 1),
        (2, 1, 2, "1f1b", 1, 2),
        (2, 1, 3, "1f1b", 1, 1),
        (2, 2, 1, "1f1b", 1, 1),
        (2, 2, 3, "gpipe", 1, 1),
        (4, 1, 3, "1f1b", 1, 1),
        (1, 1, 0, "1f1b", 1, 4),
    ],
)
def test_every_layout_gives_one_process_bits(one_process, dp, pp, zero, schedule, v, accumulation):
    """Losses, clipped norms and weights equal bit for bit (the GPT's head,
    tied to the embedding, on one rank or on two)."""
    losses, norms, params = _run(dp, pp, zero, schedule, v, accumulation)
    assert losses == one_process[0]
    assert norms == one_process[1]
    assert _bits_differ(one_process[2], params) == []


def test_a_checkpoint_resumed_at_another_layout_continues_bit_for_bit(one_process, tmp_path):
    """Saved after step 2 at dp 2 ZeRO-1, resumed for step 3 at pp 2: the
    weights of three uninterrupted steps in one process."""
    kw = dict(micro_batch_size=2, deterministic=True)
    first = _config(dp=2, zero=1, microbatches=MICROBATCHES // 2, steps=2, **kw)
    run_ranks(_train_slices, 2, first, str(tmp_path), env=ENV)
    then = _config(pp=2, microbatches=MICROBATCHES, **kw)
    out = run_ranks(_train_slices, 2, then, None, str(tmp_path), env=ENV)
    params = {n: t for _, p in out for n, (t, _) in p.items()}
    assert [m["loss"] for m in out[0][0]] == one_process[0][2:]
    assert _bits_differ(one_process[2], params) == []


def test_without_the_mode_the_layouts_differ(one_process):
    """The check above can fail: the default mode's sums follow the layout."""
    base = _run(on=False)
    other = _run(dp=2, zero=1, on=False)
    assert _bits_differ(base[2], other[2])
    assert base[2].keys() == one_process[2].keys()


@pytest.mark.parametrize("model,extra", [("mlp", dict(hidden=32)), ("moe", dict(experts=4))])
def test_the_mlp_and_the_experts_are_bitwise_too(model, extra):
    ref = _run(model=model, **extra)
    for dp, pp, zero in ((2, 1, 1), (2, 2, 0)):
        got = _run(dp, pp, zero, model=model, **extra)
        assert got[0] == ref[0] and got[1] == ref[1]
        assert _bits_differ(ref[2], got[2]) == []


def test_the_tree_adds_neighbours_lower_index_first():
    """Four micro-batch gradients are summed as (g0 + g1) + (g2 + g3), which
    here rounds differently from the running sum ((g0 + g1) + g2) + g3."""
    leaves = [1.0, 2.0**-24, 2.0**-24, 2.0**-23]
    stack: list = []
    for x in leaves:
        det._push(stack, [torch.tensor([x], dtype=torch.float32)])
    ((count, (got,)),) = stack
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    tree = (f(leaves[0]) + f(leaves[1])) + (f(leaves[2]) + f(leaves[3]))
    running = ((f(leaves[0]) + f(leaves[1])) + f(leaves[2])) + f(leaves[3])
    assert count == 4 and got.item() == tree.item() != running.item()


def test_exact_totals_are_the_exact_sums_rounded_once():
    """Over 60 decades, cut anywhere, counted twice or once each piece:
    the exact sum of squares (and of the losses), rounded once."""
    g = torch.randn(4_001) * torch.logspace(-30, 30, 4_001)
    exact = sum(Fraction(x) ** 2 for x in g.tolist())
    pieces = [(p, 2) for p in g.split([3, 2000, 1998])]
    assert det.exact_totals([], [(g, 1)])[1] == float(exact)
    assert det.exact_totals([], pieces[::-1])[1] == float(2 * exact)
    losses = list(g[:50])
    assert det.exact_totals(losses, [])[0] == math.fsum(g[:50].tolist())
    assert math.isnan(det.exact_totals([torch.tensor(float("inf"))], [])[0])


@pytest.mark.parametrize(
    "kw,says",
    [
        (dict(tp=2), "tp 2 is refused"),
        (dict(cp=2), "cp 2 is refused"),
        (dict(dp=3), "dp = 3 is not a power of two"),
        (dict(microbatches=3), "microbatches x accumulation = 3"),
        (dict(pp=2, schedule="zb1"), "schedule zb1"),
        (dict(compression="fp16"), "compression 'fp16'"),
        (dict(sync="diloco"), "sync 'diloco'"),
    ],
)
def test_what_cannot_be_bitwise_is_refused_with_the_reason(kw, says):
    cfg = TrainConfig(**{**dict(model="gpt", deterministic=True), **kw})
    with pytest.raises(ValueError, match=says):
        det.check(cfg)


def _needs_the_engine_mode(rank, world):
    with pytest.raises(ValueError, match=det.ENV):
        det.enter(world)
    return True


def test_ranks_without_the_engines_deterministic_reductions_are_refused():
    assert run_ranks(_needs_the_engine_mode, 2) == [True, True]


def test_the_command_line_sets_the_engine_and_matches_one_rank(tmp_path):
    """``clawcomm train --deterministic`` at dp 2, ZeRO-2 gives the losses
    of one rank over the same global batch."""
    losses = []
    for flags in (["--nproc", "1", "--microbatches", "4"],
                  ["--nproc", "2", "--dp", "2", "--zero", "2", "--microbatches", "2"]):  # fmt: skip
        out = tmp_path / f"{len(losses)}.jsonl"
        subprocess.run(
            [sys.executable, "-m", "clawcomm.cli", "train", *flags, "--dim", "32", "--heads", "2",
             "--layers", "2", "--seq-len", "16", "--steps", "2", "--micro-batch-size", "2",
             "--deterministic", "--quiet", "--metrics", str(out)],
            check=True, timeout=300,
        )  # fmt: skip
        losses.append([json.loads(line)["loss"] for line in out.read_text().splitlines()])
    assert losses[0] == losses[1] and len(losses[0]) == 2
