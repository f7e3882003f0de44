"""Communicating less often (``--sync local-sgd:H|diloco:H``, ``--fragments``,
``--sync-delay``): against single-process training where the two must agree,
bytes against every-step averaging, replicas apart between meetings and
equal after them, delayed meetings against the algorithm written out in one
process and not waiting for a late peer, checkpoints resumed bit for bit
(with exchanges in flight too), and the settings refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _training import _ckpt_config, _config, _reference, _run, _train

from clawcomm.launch import RankFailure, run_ranks
from clawcomm.train import TrainConfig
from clawcomm.train.outer import parse_sync

SGD = dict(optimizer="sgd", momentum=0.0, lr=0.5, clip=0)


@pytest.mark.parametrize("sync", ["local-sgd:1", "diloco:1"])
@pytest.mark.parametrize("pp", [1, 2])
def test_meeting_every_step_with_plain_sgd_is_single_process_training(sync, pp):
    """Averaging parameters after every plain SGD step is averaging the
    gradients (and DiLoCo with outer learning rate 1 and no momentum is
    parameter averaging): the losses and weights of one process's training."""
    cfg = _config(dp=2, pp=pp, microbatches=2, micro_batch_size=2, steps=5, sync=sync,
                  outer_lr=1.0, outer_momentum=0.0, **SGD)  # fmt: skip
    losses, _, want = _reference(dataclasses.replace(cfg, sync="every-step"))
    for metrics, params in run_ranks(_train, 2 * pp, cfg):
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], atol=2e-6, rtol=0, msg=n)


def _dp_bytes(metrics) -> int:
    return sum(m["bytes_sent_dp"] for m in metrics)


@pytest.mark.parametrize("compression,share", [("", 1 / 4), ("int8", 1 / 16)])
def test_diloco_sends_a_period_s_share_of_every_step_s_bytes(compression, share):
    """DiLoCo every 4 steps sends a quarter of what averaging gradients every
    step sends (the same parameters, once per 4 steps), and a sixteenth with
    int8 (INTELLECT-1's recipe; plus a scale per block of 256)."""
    cfg = _config(dp=2, microbatches=2, micro_batch_size=2, steps=9)
    dense = run_ranks(_train, 2, cfg)[0][0]
    diloco = run_ranks(_train, 2, dataclasses.replace(cfg, sync="diloco:4",
                                                      compression=compression))[0][0]  # fmt: skip
    # The meetings after steps 4 and 8 are counted in steps 5 and 9.
    assert [m["bytes_sent_dp"] > 0 for m in diloco] == [False] * 4 + [True] + [False] * 3 + [True]
    ratio = _dp_bytes(diloco) / (_dp_bytes(dense) * 8 / 9)
    assert ratio == pytest.approx(share, rel=0.1), ratio
    assert diloco[-1]["loss"] < diloco[0]["loss"]


def _replicas(rank, n, cfg, steps):
    from clawcomm.train import models as train_models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    after = []
    batches = global_batches(ds, cfg.effective_batch, cfg.seed)
    for _ in range(steps):
        trainer.step(next(batches))
        after.append([p.detach().clone() for p in trainer.params])
    trainer.close()
    return after


def test_fragments_meet_in_turn_and_replicas_drift_in_between():
    """diloco:4 in 2 fragments: the first fragment meets after steps 2 and
    6, the second after 4 and 8; a fragment is the same on both replicas
    right after its meeting and differs otherwise."""
    cfg = _config(dp=2, microbatches=2, micro_batch_size=2, steps=8, sync="diloco:4", fragments=2)
    a, b = run_ranks(_replicas, 2, cfg, 8)
    from clawcomm.train.outer import _split

    runs = _split(a[0], 2)
    assert runs[0] and runs[1] and runs[0][-1] < runs[1][0]
    for step in range(8):
        for f, run in enumerate(runs):
            met = (step + 1) % 4 == (2 if f == 0 else 0)
            same = all(torch.equal(a[step][i], b[step][i]) for i in run)
            assert same == met, (step + 1, f)


def _inner(params, rank, step):
    """A deterministic inner step that differs between replicas."""
    for i, p in enumerate(params):
        p.sub_(0.01 * (rank + 1) * (step + i) + 0.003 * torch.arange(p.numel()).view_as(p))


def _delayed(rank, n, settings, steps):
    import torch.distributed as dist

    from clawcomm.train.outer import OuterSync

    params = [torch.linspace(-1, 1, 6).view(2, 3), torch.linspace(0, 2, 4)]
    outer = OuterSync(params, None, settings, dist.new_group(list(range(n))))
    after = []
    for step in range(1, steps + 1):
        _inner(params, rank, step)
        outer.after_step(step)
        after.append([p.clone() for p in params])
    outer.close()
    return after


def _delayed_reference(settings, n, steps):
    """Streaming DiLoCo with delay and mix, written out for n replicas in
    one process: fragment 0 is the first tensor, fragment 1 the second."""
    from clawcomm.train.outer import parse_sync

    _, period = parse_sync(settings.sync)
    every = period // settings.fragments
    reps = [[torch.linspace(-1, 1, 6).view(2, 3), torch.linspace(0, 2, 4)] for _ in range(n)]
    anchor = [t.clone() for t in reps[0]]
    momentum = [torch.zeros_like(t) for t in anchor]
    flying, history = {}, []
    for step in range(1, steps + 1):
        for r in range(n):
            _inner(reps[r], r, step)
        if step % every == 0:
            f = (step // every - 1) % settings.fragments
            mean = sum(anchor[f] - reps[r][f] for r in range(n)) / n
            flying[f] = (step + settings.sync_delay if step < steps else step, mean)
        for f, (at, mean) in sorted(flying.items()):
            if at <= step or step >= steps:
                del flying[f]
                momentum[f] = momentum[f] * settings.outer_momentum + mean
                anchor[f] = anchor[f] - settings.outer_lr * (
                    mean + settings.outer_momentum * momentum[f]
                )
                for r in range(n):
                    reps[r][f] = (
                        settings.sync_mix * reps[r][f] + (1 - settings.sync_mix) * anchor[f]
                    )
        history.append([[t.clone() for t in rep] for rep in reps])
    return history


@pytest.mark.parametrize("delay,mix", [(1, 0.0), (3, 0.5)])
def test_delayed_meetings_land_as_streaming_diloco_writes_them(delay, mix):
    """diloco:4 in 2 fragments, each exchange landing ``delay`` steps after
    it was taken and mixed with the replica's own progress: the parameters
    of the algorithm written out in one process, at every step (the last
    step lands what is still in flight)."""
    from types import SimpleNamespace

    settings = SimpleNamespace(
        sync="diloco:4", fragments=2, sync_delay=delay, sync_mix=mix, outer_lr=0.7,
        outer_momentum=0.9, compression="", steps=9,
    )  # fmt: skip
    want = _delayed_reference(settings, 2, 9)
    for rank, got in enumerate(run_ranks(_delayed, 2, settings, 9)):
        for step in range(9):
            for f in range(2):
                where = f"rank {rank}, step {step + 1}, fragment {f}"
                torch.testing.assert_close(got[step][f], want[step][rank][f], atol=1e-6, rtol=0,
                                           msg=where)  # fmt: skip


def _late_peer(rank, n):
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from clawcomm.train.outer import OuterSync

    settings = SimpleNamespace(
        sync="diloco:2", fragments=1, sync_delay=1, sync_mix=0.0, outer_lr=0.7,
        outer_momentum=0.9, compression="int8", steps=4,
    )  # fmt: skip
    params = [torch.randn(4096, generator=torch.Generator().manual_seed(rank))]
    outer = OuterSync(params, None, settings, dist.new_group(list(range(n))))
    if rank == 1:
        time.sleep(1.5)  # the peer is late to the meeting
    t0 = time.perf_counter()
    outer.after_step(2)  # due: the exchange starts on its thread
    took = time.perf_counter() - t0
    outer.after_step(3)  # lands: waits for the late peer
    outer.close()
    return took


def test_a_delayed_meeting_does_not_wait_for_a_late_peer():
    took = run_ranks(_late_peer, 2)
    assert took[0] < 0.5, took


@pytest.mark.parametrize(
    "pp,sync,fragments,compression,delay",
    [(2, "diloco:2", 1, "int8", 0), (1, "diloco:4", 2, "sign", 0), (1, "local-sgd:2", 1, "", 0),
     (1, "diloco:4", 2, "int8", 2), (2, "diloco:4", 1, "sign", 3)],
)  # fmt: skip
def test_a_resumed_sync_run_reproduces_the_uninterrupted_one_bit_for_bit(
    tmp_path, pp, sync, fragments, compression, delay
):
    """Saved between meetings (replicas apart, each with its own weights and
    inner optimizer state), with the anchor, outer momentum and the
    compressor's residuals, and with delay an exchange in flight (taken
    after step 2, landing after 4 or 5): the resumed run repeats the
    uninterrupted one."""
    cfg = _ckpt_config(
        dp=2, pp=pp, sync=sync, fragments=fragments, compression=compression, microbatches=2,
        sync_delay=delay, sync_mix=0.5 if delay else 0.0,
    )  # fmt: skip
    n = 2 * pp
    whole = run_ranks(_run, n, cfg, 6, False, timeout=300)
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    first = run_ranks(_run, n, cfg, 3, False, timeout=300)  # saved at 3: between meetings
    second = run_ranks(_run, n, cfg, 6, True, timeout=300)
    assert first[0][0] + second[0][0] == whole[0][0]
    for r in range(n):
        for name, t in whole[r][1].items():
            assert torch.equal(second[r][1][name], t), (r, name)


def test_a_sync_checkpoint_refuses_another_sync_or_width(tmp_path):
    cfg = _ckpt_config(dp=2, sync="diloco:2", checkpoint_dir=str(tmp_path), checkpoint_every=2)
    run_ranks(_run, 2, cfg, 2, False, timeout=300)
    every = dataclasses.replace(cfg, sync="every-step")
    with pytest.raises(RankFailure, match="made with sync 'diloco:2', this run uses 'every-step'"):
        run_ranks(_run, 2, every, 2, True, timeout=300)
    one = dataclasses.replace(cfg, dp=1)
    with pytest.raises(RankFailure, match="holds 2 replicas that meet every few steps"):
        run_ranks(_run, 1, one, 2, True, timeout=300)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"sync": "diloco"}, "sync 'diloco' is not every-step, local-sgd:H or diloco:H"),
        ({"sync": "diloco:0"}, "H must be >= 1"),
        ({"sync": "diloco:4", "zero": 1}, "keeps a whole replica .* needs zero 0, not zero 1"),
        ({"sync": "diloco:4", "fragments": 3}, "fragments 3 must be >= 1 and divide"),
        ({"sync": "diloco:4", "outer_lr": 0.0}, "outer_lr must be > 0"),
        ({"sync": "diloco:4", "outer_momentum": 1.0}, "outer_momentum in \\[0, 1\\)"),
        ({"sync": "diloco:4", "sync_delay": 4}, "sync_delay must be in \\[0, H\\) \\(H 4\\)"),
        ({"sync": "diloco:4", "sync_mix": 1.5}, "sync_mix in \\[0, 1\\], got 0 and 1.5"),
    ],
)
def test_bad_sync_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw).check()


def test_parse_sync():
    assert parse_sync("every-step") == ("every-step", 1)
    assert parse_sync("diloco:32") == ("diloco", 32)
    assert parse_sync("local-sgd:8") == ("local-sgd", 8)
