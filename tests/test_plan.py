"""The planner (``clawcomm plan``, ``clawcomm train --layout auto``;
clawcomm/plan/search.py): every candidate is a layout the trainer accepts,
the predictions' terms move the way the layouts say, nothing over the
memory limit is chosen, the report explains the choice and prints a
command that runs, and ``--check`` and ``--layout auto`` train."""

from __future__ import annotations

import dataclasses

import pytest

from clawcomm.plan import cli as plan_cli
from clawcomm.plan import search as plan
from clawcomm.plan import step
from clawcomm.train.config import TrainConfig

MLP = dict(model="mlp", hidden=32, quiet=True)


def test_every_candidate_is_a_layout_the_trainer_accepts():
    cfg = TrainConfig(model="gpt", dim=32, heads=2, layers=2, seq_len=16, global_batch=16)
    cands = list(plan.candidates(4, 4, 16))
    assert {(c.dp, c.pp) for c in cands} == {(4, 1), (2, 2), (1, 4)}
    assert {c.schedule for c in cands if c.pp > 1} == {"gpipe", "1f1b", "zb1", "interleaved"}
    for c in cands:
        assert c.dp * c.microbatches * c.micro_batch_size == 16
        assert c.zero == 0 or c.dp > 1
        plan.apply(cfg, c).check(4)  # raises if the trainer would refuse it
    # micro-batch counts beyond pp, 2 pp and 4 pp where none of those divides
    # the batch: 32 samples on 3 ranks train at pp 3 in 4 or 8 micro-batches
    three = {(c.pp, c.microbatches) for c in plan.candidates(3, 3, 32) if c.pp == 3}
    assert (3, 4) in three and (3, 8) in three and not any(m % 3 == 0 for _, m in three)
    assert not list(plan.candidates(4, 2, 5))  # 5 samples: no dp of 4 or 2 divides them


@pytest.fixture(scope="module")
def gpt_plan():
    cfg = TrainConfig(model="gpt", dim=32, heads=2, layers=2, seq_len=16, global_batch=16)
    return cfg, *plan.plan(cfg, 4, cores=4)


def test_predictions_follow_the_layouts(gpt_plan):
    cfg, preds, over, prof = gpt_plan
    assert not over and prof.seconds < 15
    by = {p.cand: p for p in preds}
    assert [p.step_ms for p in preds] == sorted(p.step_ms for p in preds)
    for c, p in by.items():
        assert p.compute_ms > 0 and p.bubble_ms >= 0 and p.comm_ms >= 0 and p.opt_ms > 0
        if c.pp == 1:
            assert p.bubble_ms == pytest.approx(0, abs=1e-6)
        if c.averaged_over == 1:  # (at cp > 1 the cp ranks reduce, at dp 1 too)
            assert p.comm_ms == 0
        if c.zero:  # ZeRO divides what a rank holds at its peak (never more), and costs gathers
            plain = by[dataclasses.replace(c, zero=0)]
            assert p.memory_mb <= plain.memory_mb and p.comm_ms > 0
            # stage 3 keeping its layers gathered (pp > 1) holds the model's
            # bytes at its peak, as stage 0 does at dp 2; every other stage less
            assert p.memory_mb < plain.memory_mb or (c.zero == 3 and c.pp > 1 and c.dp == 2)
            if c.zero == 3:  # resharding after forward gathers more than keeping the layers
                again, kept = (plan.predict(c, prof, 4, reshard=r).comm_ms for r in (True, False))
                assert again >= kept > 0
    # gpipe holds every micro-batch's activations, 1f1b at most pp of them
    gpipe = next(c for c in by if c.schedule == "gpipe" and c.microbatches == 4 * c.pp)
    one_f = dataclasses.replace(gpipe, schedule="1f1b")
    assert by[gpipe].memory_mb > by[one_f].memory_mb


def test_nothing_over_the_memory_limit_is_chosen(gpt_plan):
    cfg, preds, _, _ = gpt_plan
    limit = sorted(p.memory_mb for p in preds)[len(preds) // 3]
    fits, over, _ = plan.plan(cfg, 4, memory_mb=limit, cores=4)
    assert fits and over and all(p.memory_mb <= limit for p in fits)
    assert all(p.memory_mb > limit for p in over)
    # (under a limit each layout is also tried with each recomputation mode)
    assert len(fits) + len(over) == 3 * len(preds)


def test_the_report_explains_and_its_command_runs(gpt_plan, capsys):
    cfg, preds, over, prof = gpt_plan
    text = plan.report(preds, over, prof, ["--nproc", "4", *plan.model_flags(cfg)], 3)
    assert "faster than #" in text or "predicted equal" in text
    command = text.splitlines()[-1].split("clawcomm train ")[1].split()
    assert command[:2] == ["--nproc", "4"] and "--global-batch" not in command
    from clawcomm.train import cli
    from clawcomm.train import flags as config

    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    chosen = plan.apply(cfg, preds[0].cand)
    got = config.from_args(parser.parse_args(command))
    for f in ("dp", "pp", "schedule", "microbatches", "micro_batch_size", "zero", "dim", "model"):
        assert getattr(got, f) == getattr(chosen, f), f
    got.check(4)


def test_the_profile_times_layers_with_a_ranks_threads(gpt_plan):
    # CPU ranks run one intra-op thread; timing the layers on every core of
    # the planning process predicted CPU steps at about half their time.
    import torch

    from clawcomm.plan import profile as profiling

    _, _, _, prof = gpt_plan
    assert prof.threads == profiling.RANK_THREADS == 1
    before = torch.get_num_threads()
    seen = []
    with profiling.rank_threads(gpu=False):
        seen.append(torch.get_num_threads())
    with profiling.rank_threads(gpu=True):
        seen.append(torch.get_num_threads())
    assert seen == [1, before] and torch.get_num_threads() == before


def test_the_profile_times_zero_bubbles_split_backward(gpt_plan):
    _, preds, _, prof = gpt_plan
    assert any(p.cand.schedule == "zb1" for p in preds)
    for mbs, back in prof.backward.items():
        i_pass, w_pass = prof.input_grad[mbs], prof.weight_grad[mbs]
        assert len(i_pass) == len(w_pass) == len(back)
        assert 0.4 < (sum(i_pass) + sum(w_pass)) / sum(back) < 2.5


def test_only_the_time_on_a_core_slows_when_ranks_outnumber_cores():
    # Waiting layers (as on an accelerator) hold no core: 4 ranks on 2 cores
    # do not take twice their time, where CPU-bound layers do.
    from clawcomm.plan import profile as profiling

    wait = TrainConfig(model="wait", layers=4, quiet=True)
    prof = profiling.profile(wait, [2])
    assert max(prof.cpu_share[2]) < 0.5
    mlp = profiling.profile(TrainConfig(**MLP), [2])
    assert min(mlp.cpu_share[2]) > 0.5
    c = plan.Candidate(4, 1, "1f1b", 1, 1, 2, 0)
    for p, most in ((prof, 1.5), (mlp, None)):
        alone, shared = plan.predict(c, p, cores=4), plan.predict(c, p, cores=2)
        ratio = shared.compute_ms / alone.compute_ms
        assert ratio < most if most else ratio > 1.5


def test_the_reduction_gets_a_cores_share_where_computing_ranks_outnumber_cores():
    # Where the layers compute on the CPU, 4 ranks on 2 cores reduce at
    # half a core each (the cost model prices a rank with a core of its
    # own), as they compute at half: the exposed reduction doubles; where
    # they wait, as on an accelerator, the reduction keeps its price.
    from clawcomm.plan.profile import Profile

    def prof(share: float) -> Profile:
        two = [1e-3, 1e-3]
        return Profile([1e6, 1e6], {4: two}, {4: two}, {4: [0.0, 0.0]}, {4: [4e3, 4e3]},
                       1e-9, cpu_share={4: [share, share]})  # fmt: skip

    c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0)
    for share, stretch in ((1.0, 2.0), (0.0, 1.0)):
        alone, shared = (plan.predict(c, prof(share), cores=n) for n in (4, 2))
        assert alone.comm_ms > 0
        assert shared.comm_ms == pytest.approx(stretch * alone.comm_ms)


def test_the_reduction_and_zeros_gathers_hide_where_the_trainers_buckets_let_them():
    # 4 layers of 1 MiB of gradients, 1 ms a pass each. The trainer's first
    # bucket holds at most 1 MiB: the last layer's, reduced while the other
    # three compute their backward; the rest launch as the backward ends.
    # ZeRO-2 gathers the updated shards in forward order after the
    # optimizer: the first forward waits for the first 3 layers' bucket,
    # and the last layer's lands while those compute.
    from clawcomm.cost_model import Topology
    from clawcomm.cost_model import predict as comm_time
    from clawcomm.plan.profile import Profile

    ms, mib = [1e-3] * 4, 2**18
    prof = Profile([mib] * 4, {4: ms}, {4: ms}, {4: [0.0] * 4}, {4: [4e3] * 4}, 1e-12,
                   tensors=[[(mib,)]] * 4)  # fmt: skip
    slow, layout = plan.cost_model(None, "100mbit"), Topology(2, 2)

    def op(name, nbytes):
        return comm_time(name, "auto", nbytes, layout, slow)

    end = 8e-3  # the forward's 4 ms, then the backward's
    rs = max(5e-3 + op("all_reduce", 4 * mib), end) + op("all_reduce", 12 * mib) - end
    flat = plan.predict(plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0), prof, 4, slow, hosts=2)
    assert flat.comm_ms == pytest.approx(1e3 * rs)
    rs = max(5e-3 + op("reduce_scatter", 4 * mib), end) + op("reduce_scatter", 12 * mib) - end
    first, last = op("all_gather", 12 * mib), op("all_gather", 4 * mib)
    gathers = first + max(0.0, last - 3e-3)
    zero2 = plan.predict(plan.Candidate(4, 1, "1f1b", 1, 1, 4, 2), prof, 4, slow, hosts=2)
    assert zero2.comm_ms == pytest.approx(1e3 * (rs + gathers))
    assert gathers < first + last  # the second bucket's gather hid behind the forward


def test_zero3s_gathers_are_as_many_as_zero3_says_each_behind_the_layer_before():
    from clawcomm.parallel.zero3 import gathers_per_round
    from clawcomm.plan.dp_timeline import exposed_unit_gathers

    assert gathers_per_round(4, True) == (4, 4) and gathers_per_round(4, False) == (1, 0)
    # a stage of 3 layers, 1 s a pass each but the last forward (0.5 s); its
    # layers' gathers 0.3, 1.5 and 0.2 s: a pass waits for its first layer's
    # gather and what each later one takes beyond the layer before it
    passes = [([(0, 1.0), (1, 1.0), (2, 0.5)], [(2, 1.0), (1, 1.0), (0, 1.0)])]
    gather = {0: 0.3, 1: 1.5, 2: 0.2}.get
    forward, backward = 0.3 + 0.5 + 0.0, 0.2 + 0.5 + 0.0
    assert exposed_unit_gathers(passes, gather, (1, 0)) == pytest.approx(forward)
    assert exposed_unit_gathers(passes, gather, (4, 4)) == pytest.approx(4 * (forward + backward))


def test_hosts_put_the_links_where_the_ranks_are(gpt_plan):
    # Ranks are numbered host by host and the trainer's rank is
    # pp_rank * dp + dp_rank: at dp 2 x pp 2 on 2 hosts each dp group stays
    # on a host and every pipeline boundary crosses the link; at dp 4 the
    # dp group spans both hosts.
    _, _, _, prof = gpt_plan
    slow = plan.cost_model(None, "100mbit")
    assert slow.net_beta == pytest.approx(8 / 100e6)
    pipe = plan.Candidate(2, 2, "1f1b", 1, 2, 4, 0)
    one, two = (plan.predict(pipe, prof, 4, slow, hosts=h) for h in (1, 2))
    assert two.bubble_ms > one.bubble_ms and two.comm_ms == pytest.approx(one.comm_ms)
    flat = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0)
    one, two = (plan.predict(flat, prof, 4, slow, hosts=h) for h in (1, 2))
    assert two.comm_ms > 10 * one.comm_ms and two.bubble_ms == one.bubble_ms == 0


def test_plan_refuses_hosts_that_do_not_divide_the_world(capsys, monkeypatch):
    from clawcomm.cli import main

    assert main(["plan", "--nproc", "4", "--hosts", "3", "--model", "mlp"]) == 2
    assert "--hosts 3 does not divide the world of 4 ranks" in capsys.readouterr().err
    # --check across hosts trains on namespace hosts of this machine, or says why it cannot
    monkeypatch.setattr(plan_cli, "netns_unavailable", lambda: "network namespaces need root")
    assert main(["plan", "--nproc", "4", "--hosts", "2", "--model", "mlp", "--check", "2"]) == 2
    out = capsys.readouterr().err
    assert "--check with --hosts 2 trains on namespace hosts" in out and "need root" in out
    assert main(["plan", "--nproc", "2", "--model", "mlp", "--check", "1",
                 "--check-rounds", "0"]) == 2  # fmt: skip
    assert "--check-rounds 0: must be >= 1" in capsys.readouterr().err
    # a world of no rank is refused as such, on stderr
    assert main(["plan", "--nproc", "0", "--model", "mlp", "--global-batch", "32"]) == 2
    err = capsys.readouterr().err
    assert "--nproc 0: a world needs at least 1 rank" in err and "global batch" not in err


def test_the_report_says_how_it_prices_ranks_that_outnumber_cores(capsys):
    # where they do, a trial (a real one, on a machine of fewer than 4 cores) or
    # the reason none ran; where they do not, nothing
    import os

    from clawcomm.cli import main

    for cores, said in ((2, True), (4, False)):
        assert main(["plan", "--nproc", "4", "--cores", str(cores), "--model", "mlp",
                     "--hidden", "32", "--global-batch", "16", "--top", "2"]) == 0  # fmt: skip
        out = capsys.readouterr().out
        assert ("4 ranks a host share 2 core(s): each layout's step is at least" in out) is said
        if said and (os.cpu_count() or 1) < 4:
            assert "ms a compute action beyond its profile (a trial: 6 steps of dp 1 x pp 4" in out
        elif said:
            assert "the profiled compute alone (no trial: 4 ranks" in out, out


def test_searched_compression_is_costed_on_the_wire(gpt_plan):
    cfg, _, _, prof = gpt_plan
    wires = plan.check_wires(["none", "bf16", "int8"])
    assert wires == ["", "bf16", "int8"]
    with pytest.raises(ValueError, match="cannot price from the gradient's size"):
        plan.check_wires(["dgc:0.01"])
    cands = list(plan.candidates(4, 4, 16, wires))
    assert {c.compression for c in cands if c.dp > 1} == set(wires)
    assert {c.compression for c in cands if c.dp == 1} == {""}
    slow = plan.cost_model(None, "100mbit")
    params = int(sum(prof.params))
    codec = plan.codec_seconds([w for w in wires if w], params, [4])
    assert codec["bf16", 4] == 0 and codec["int8", 4] > 0
    comm = {}
    for w in wires:
        c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0, w)
        comm[w] = plan.predict(c, prof, 4, slow, hosts=2, codec=codec).comm_ms
        chosen = plan.apply(cfg, c)
        assert chosen.compression == w and ("--compression" in c.flags()) == bool(w)
        chosen.check(4)
    assert comm["int8"] < comm["bf16"] < comm[""]


def test_the_plan_prices_what_the_compressor_says_it_sends():
    # The compressor owns its wire; the plan adds the cost model's time of
    # each collective it names and the codec's passes.
    from clawcomm.cost_model import Topology, predict_sequence

    lay, n, slow = Topology(2, 2), 1 << 20, plan.cost_model(None, "100mbit")
    for spec, sharded in [("", False), ("", True), ("bf16", False), ("int8", False),
                          ("int8", True), ("topk:0.01", False), ("randomk:0.01", True),
                          ("qsgd:4", False)]:  # fmt: skip
        comp = plan.compressor(spec)
        wire = comp.wire(n, lay.size, sharded)
        want = 2.0 * predict_sequence(wire.collectives, lay, slow) + wire.codec_passes * 1e-3
        got = step.reduction_seconds(comp, int(sharded), 4 * n, lay, slow, 1e-3, stretch=2.0)
        assert got == pytest.approx(want), spec
    assert plan.compressor("").wire(n, 4).collectives == (("all_reduce", 4.0 * n),)
    assert plan.compressor("").wire(n, 4, sharded=True).collectives == (
        ("reduce_scatter", 4.0 * n),
    )
    assert plan.compressor("bf16").wire(n, 4).collectives == (("all_reduce", 2.0 * n),)
    # int8 at 4 ranks: the codes (one byte a value) and one float32 scale per
    # 256 values, all-to-all then all-gathered; one codec pass each way
    int8 = plan.compressor("int8").wire(n, 4)
    assert [c for c, _ in int8.collectives] == ["all_to_all", "all_to_all", "all_gather",
                                                "all_gather"]  # fmt: skip
    assert [b for _, b in int8.collectives] == [n, 4 * n / 256] * 2 and int8.codec_passes == 2
    assert plan.compressor("int8").wire(n, 4, sharded=True).codec_passes == 1
    # what the values decide is not priced
    assert plan.compressor("dgc:0.01").wire(n, 4) is None
    assert plan.compressor("topk:0.01+ec").wire(n, 4) is None


def test_the_memory_counts_what_the_commands_own_wire_keeps(gpt_plan):
    # a compressor with error feedback keeps a residual of the gradient's
    # size, whether searched or the command's own; replicas that only meet
    # every H steps keep none
    _, _, _, prof = gpt_plan
    c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0)
    dense = plan.predict(c, prof, 4).memory_mb
    own = plan.predict(c, prof, 4, compression="topk:0.01").memory_mb
    assert own == pytest.approx(dense + 4 * sum(prof.params) / 2**20)
    meeting = plan.predict(c, prof, 4, sync=("diloco", 8), compression="topk:0.01").memory_mb
    assert meeting == pytest.approx(dense)
    assert plan.compressor("dgc:0.01").state_bytes(10) == 80  # a residual and a momentum


def test_searched_top_k_and_random_k_are_costed_by_their_bytes(gpt_plan):
    from clawcomm.cost_model import Topology
    from clawcomm.cost_model import predict as comm_time

    cfg, _, _, prof = gpt_plan
    wires = plan.check_wires(["none", "int8", "topk:0.01", "randomk:0.01"])
    with pytest.raises(ValueError, match="coded wire"):
        plan.check_wires(["topk:0.01+ec"])
    with pytest.raises(ValueError, match="topk"):
        plan.check_wires(["topk:2.0"])
    params = int(sum(prof.params))
    codec = plan.codec_seconds([w for w in wires if w], params, [4])
    assert codec["topk:0.01", 4] > 0 and codec["randomk:0.01", 4] > 0
    slow = plan.cost_model(None, "100mbit")
    comm, memory = {}, {}
    for w in wires:
        c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0, w)
        pred = plan.predict(c, prof, 4, slow, hosts=2, codec=codec)
        comm[w], memory[w] = pred.comm_ms, pred.memory_mb
        plan.apply(cfg, c).check(4)
    assert comm["topk:0.01"] < comm["int8"] < comm[""] and comm["randomk:0.01"] < comm["int8"]
    # top-k keeps a residual of the gradient's size; random-k keeps none
    assert memory["topk:0.01"] == pytest.approx(memory[""] + 4 * params / 2**20)
    assert memory["randomk:0.01"] == pytest.approx(memory[""])
    # the wire: 4 ranks all-gather each one's k pairs (int32 index, float32 value)
    lay, n = Topology(2, 2), 1 << 20
    k = round(0.01 * n)
    pairs = comm_time("all_gather", "auto", 32, lay, slow) + comm_time(
        "all_gather", "auto", 4 * k * 8, lay, slow
    )
    topk = plan.compressor("topk:0.01")
    assert step.reduction_seconds(topk, 0, 4 * n, lay, slow, 0.0) == pytest.approx(pairs)
    half = step.reduction_seconds(plan.compressor("randomk:0.01+bf16"), 0, 4 * n, lay, slow, 0.0)
    assert half == pytest.approx(comm_time("all_reduce", "auto", 2 * k, lay, slow))


def test_searched_powersgd_is_costed_by_its_factors(gpt_plan):
    # PowerSGD's bytes follow from the parameters' shapes: per bucket, the
    # non-matrix values densely, then the P's and the Q's, one all-reduce
    # each (16-bit with +bf16); it keeps a residual of the gradient's size.
    import math

    from clawcomm.cost_model import Topology
    from clawcomm.cost_model import predict as comm_time

    cfg, _, _, prof = gpt_plan
    shapes = [s for layer in prof.tensors for s in layer]
    assert [sum(math.prod(s) for s in layer) + 1 for layer in prof.tensors] == prof.params
    assert plan.check_wires(["none", "powersgd:4"]) == ["", "powersgd:4"]
    params = int(sum(prof.params))
    codec = plan.codec_seconds(["powersgd:4"], params, [4], shapes)
    assert codec["powersgd:4", 4] > 0
    slow, lay = plan.cost_model(None, "100mbit"), Topology(2, 2)

    def ar(nbytes):
        return comm_time("all_reduce", "auto", nbytes, lay, slow)

    bucket = [(256, 1024), (1024,)]  # a 256 x 1024 matrix and a bias
    nbytes = 4 * (256 * 1024 + 1024)
    want = ar(4 * 1024) + ar(4 * 256 * 2) + ar(4 * 1024 * 2)
    two = plan.compressor("powersgd:2")
    got = step.reduction_seconds(two, 0, nbytes, lay, slow, 0.0, shapes=bucket)
    assert got == pytest.approx(want)
    half = step.reduction_seconds(plan.compressor("powersgd:2+bf16"), 2, nbytes, lay, slow, 0.0,
                                  shapes=bucket)  # fmt: skip
    assert half == pytest.approx(ar(4 * 1024) + ar(2 * 256 * 2) + ar(2 * 1024 * 2))
    preds = {}
    fixed = dict.fromkeys(codec, 1e-5)  # (the measured codec time follows the machine's load)
    for w in ("", "powersgd:4"):
        c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0, w)
        preds[w] = plan.predict(c, prof, 4, slow, hosts=2, codec=fixed)
        plan.apply(cfg, c).check(4)
    assert preds["powersgd:4"].comm_ms < preds[""].comm_ms
    assert preds["powersgd:4"].memory_mb == pytest.approx(preds[""].memory_mb + 4 * params / 2**20)


def test_local_sgd_meets_every_h_steps(gpt_plan):
    # The plan keeps the command's --sync: replicas that meet every H steps
    # exchange parameters once in H, and with --sync-delay behind the steps.
    _, _, _, prof = gpt_plan
    slow = plan.cost_model(None, "100mbit")
    c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0)
    every = plan.predict(c, prof, 4, slow, hosts=2).comm_ms
    eight = plan.predict(c, prof, 4, slow, hosts=2, sync=("local-sgd", 8)).comm_ms
    delayed = plan.predict(c, prof, 4, slow, hosts=2, sync=("diloco", 8), sync_delay=2).comm_ms
    assert 0 < eight < every / 4 and delayed == 0


def test_searched_sync_method_is_costed_and_kept_apart_from_zero(gpt_plan):
    cfg, _, _, prof = gpt_plan
    assert plan.check_syncs(["every-step", "local-sgd:8", "local-sgd:8"]) == [
        "every-step", "local-sgd:8"]  # fmt: skip
    with pytest.raises(ValueError, match="--search-sync: sync 'hourly'"):
        plan.check_syncs(["hourly"])
    syncs = ["every-step", "local-sgd:8"]
    cands = list(plan.candidates(4, 4, 16, syncs=syncs))
    assert {c.sync for c in cands if c.dp > 1} == set(syncs)
    assert {c.sync for c in cands if c.dp == 1} == {None}  # one replica: nothing to sync
    preds, _, _ = plan.plan(cfg, 4, cores=4, syncs=syncs)
    # the trainer refuses ZeRO beside local SGD, so the plan never offers it
    assert all(p.cand.zero == 0 for p in preds if p.cand.sync == "local-sgd:8")
    assert any(p.cand.sync == "local-sgd:8" for p in preds)
    slow = plan.cost_model(None, "100mbit")
    comm = {}
    for sync in syncs:
        c = plan.Candidate(4, 1, "1f1b", 1, 1, 4, 0, None, sync)
        comm[sync] = plan.predict(c, prof, 4, slow, hosts=2).comm_ms
        assert c.flags()[-2:] == ["--sync", sync] and c.name().endswith(sync)
        plan.apply(cfg, c).check(4)
    assert 0 < comm["local-sgd:8"] < comm["every-step"] / 4


def test_train_with_layout_auto(capsys):
    from clawcomm.train import cli

    rc = cli.main(["--nproc", "2", "--layout", "auto", "--model", "mlp", "--hidden", "32",
                   "--global-batch", "16", "--steps", "3", "--quiet"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "run it: clawcomm train --nproc 2" in out and "final loss" in out


def test_layout_auto_refuses_what_it_cannot_plan(capsys):
    # one sample cannot be split over 2 replicas or 2 micro-batches, nor 3
    # heads over 2 tensor-parallel ranks, nor 18 tokens in 2 x cp 2 chunks;
    # a memory limit nothing fits is refused in one line, before any rank starts
    from clawcomm.train import cli

    assert cli.main(["--nproc", "2", "--layout", "auto", "--model", "gpt", "--heads", "3",
                     "--dim", "48", "--layers", "2", "--seq-len", "18",
                     "--global-batch", "1", "--steps", "1", "--quiet"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "no layout runs a global batch of 1 on 2 ranks" in err and "Traceback" not in err
    assert cli.main(["--nproc", "2", "--layout", "auto", "--model", "mlp", "--max-memory-mb", "1",
                     "--global-batch", "8", "--steps", "1", "--quiet"]) == 2  # fmt: skip
    out = capsys.readouterr()
    assert "every layout needs more than --max-memory-mb 1" in out.err
    assert "Traceback" not in out.err + out.out


def test_the_plan_searches_tp_and_says_what_each_split_layer_sends():
    """tp is a dimension of the search (dp x tp x pp = the world), and the
    TP room says what each layer sends: a sequence-parallel GPT block
    gathers and reduce-scatters twice in forward, gathers four times and
    reduce-scatters twice in backward; without sequence parallelism it
    all-reduces twice each way; the head all-reduces the loss's statistics."""
    from clawcomm.parallel.tensor.parallelize import traffic
    from clawcomm.train import models as train_models

    cands = list(plan.candidates(4, 8, 32, tps=(1, 2, 4)))
    assert {c.tp for c in cands} == {1, 2, 4}
    assert all(c.dp * c.tp * c.pp == 4 for c in cands)
    assert plan.Candidate(1, 2, "zb1", 1, 2, 16, 0, tp=2).flags()[:4] == ["--dp", "1", "--tp", "2"]
    model = train_models.gpt(50, 32, 2, 4, 16)
    act = 4.0 * 4 * 16 * 32  # float32 [micro-batch 4, 16 tokens, width 32]
    sp = traffic(model, 4, 16, True)
    assert sp[1]["F"] == [("all_gather", act), ("reduce_scatter", act)] * 2
    assert sorted(sp[1]["B"]) == [("all_gather", act)] * 4 + [("reduce_scatter", act)] * 2
    assert sp[0] == {"F": [("reduce_scatter", act)], "B": [("all_gather", act)]}
    assert ("all_reduce", 4.0 * 4 * 16) in sp[-1]["F"]
    plain = traffic(model, 4, 16, False)
    assert plain[1] == {"F": [("all_reduce", act)] * 2, "B": [("all_reduce", act)] * 2}
    mlp = traffic(train_models.mlp(64, 32, 4, 10), 4, 1, False)
    assert [len(x["F"]) + len(x["B"]) for x in mlp] == [0, 1, 1, 1]  # col (data in), row, ...


def test_a_tp_layout_holds_a_tp_th_of_the_state(gpt_plan):
    cfg, _, _, prof = gpt_plan
    prof = dataclasses.replace(prof, tp_traffic={**prof.tp_traffic, 4: traffic_of(cfg, 4)})
    one = plan.predict(plan.Candidate(1, 1, "1f1b", 1, 1, 4, 0), prof, 2)
    two = plan.predict(plan.Candidate(1, 1, "1f1b", 1, 1, 4, 0, tp=2), prof, 2)
    assert two.memory_mb == pytest.approx(one.memory_mb / 2, rel=1e-6)


def traffic_of(cfg, mbs):
    from clawcomm.parallel.tensor.parallelize import traffic
    from clawcomm.train import models as train_models

    return traffic(train_models.build(cfg)[0], mbs, cfg.seq_len, True)


def test_under_a_memory_limit_the_plan_recomputes_activations():
    """With --max-memory-mb, --activation-checkpoint is searched: full keeps
    less than selective, which keeps less than none (measured per layer,
    profile.recompute_profile), and where no layout fits without
    recomputation the plan's first recomputes."""
    cfg = TrainConfig(model="gpt", dim=64, heads=2, layers=2, seq_len=64, global_batch=8)
    preds, over, _ = plan.plan(cfg, 2, memory_mb=1e6, cores=2, trial_steps=0, tps=[1])
    by = {}
    for p in preds:
        c = p.cand
        by.setdefault(dataclasses.replace(c, activation_checkpoint=None), {})[
            c.activation_checkpoint
        ] = p.memory_mb
    for modes in by.values():
        assert modes["full"] < modes["selective"] < modes["none"], modes
    least_plain = min(p.memory_mb for p in preds if p.cand.activation_checkpoint == "none")
    fits, _, _ = plan.plan(cfg, 2, memory_mb=least_plain * 0.99, cores=2, trial_steps=0, tps=[1])
    assert fits and fits[0].cand.activation_checkpoint in ("selective", "full")
    flags = fits[0].cand.flags()
    assert flags[flags.index("--activation-checkpoint") + 1] == fits[0].cand.activation_checkpoint
