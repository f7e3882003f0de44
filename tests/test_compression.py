"""Gradient compression: error feedback across ranks, the 16-bit wire, the
sparse all-reduce, the compressor registry, DDP hooks and the
experiment, against values computed locally and single-process references."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _cases import normal_grad as _grad

import clawcomm
from clawcomm.compression import (
    Compressor,
    CompressorState,
    compressed_all_reduce,
    get_compressor,
    register_compressor,
    sparse_all_reduce,
)
from clawcomm.launch import run_ranks


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "is empty"),
        ("topk", "write topk:K"),
        ("topk:0", "count 0 is not at least 1"),
        ("topk:1.5", "ratio 1.5 is not in (0, 1]"),
        ("topk:lots", "k 'lots' is not a ratio or a count"),
        ("topk:0.1:fast", "selection 'fast' is not exact or sampled"),
        ("zip", "unknown compressor 'zip'"),
        ("fp16:3", "fp16 takes no arguments"),
        ("topk:0.1+fp8", "may come '+fp16' or '+bf16', then '+ec'"),
        ("fp16+fp16", "fp16 has no values to send as fp16"),
        ("int8:3", "block 3 is not a positive multiple of 8"),
        ("int4:big", "block 'big' is not an integer"),
        ("int8:64:2", "write int8 or int8:BLOCK"),
    ],
)
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        get_compressor(spec)


def test_specs_round_trip():
    for spec in ["none", "fp16", "bf16", "topk:0.01", "topk:100:exact", "topk:0.01+fp16",
                 "randomk:0.01", "randomk:0.5+bf16", "int8", "int4", "int8:64"]:  # fmt: skip
        assert get_compressor(spec).spec == spec


def _every_compressor(rank, n, numel):
    xs = [_grad(100 + r, numel) for r in range(n)]
    dense = sum(xs)
    out = {}
    for spec in ["none", "fp16", "bf16", "int8", "int4", "topk:0.05", "topk:0.05:exact+fp16",
                 "randomk:0.5"]:  # fmt: skip
        t = xs[rank].clone()
        compressed_all_reduce(t, spec, CompressorState(), key="w")
        out[spec] = t
    return dense, out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_compressed_all_reduce_agrees_across_ranks(world_size):
    results = run_ranks(_every_compressor, world_size, 5000)
    dense = results[0][0]
    for spec in results[0][1]:
        outs = [r[1][spec] for r in results]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), spec  # every rank ends with the same bits
    assert torch.allclose(results[0][1]["none"], dense, atol=1e-5)
    assert torch.allclose(results[0][1]["fp16"], dense, atol=1e-2)


def _half_reduce_scatter(rank, n, numels):
    """Each count's part of the mean through the engine's 16-bit ring, with
    the dense float32 mean and what a count that n ranks cannot divide
    says."""
    out = []
    for numel in numels:
        xs = [_grad(200 + r, numel) for r in range(n)]
        mean = sum(xs) / n
        for spec in ("fp16", "bf16", "int8", "int4"):
            part = torch.full((numel // n,), float("nan"))
            get_compressor(spec).reduce_scatter_mean(
                xs[rank].clone(), part, None, "w", dist.group.WORLD
            )
            out.append((spec, numel, part, mean[rank * (numel // n) : (rank + 1) * (numel // n)]))
    engine = clawcomm.engine_of(None)
    try:
        engine.reduce_scatter_16bit_wire(torch.zeros(n * 3 + 1).numpy(), torch.zeros(3).numpy())
        error = ""
    except ValueError as e:
        error = str(e)
    return out, error


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_compressed_reduce_scatter_gives_each_rank_its_part_of_the_mean(world_size):
    """ZeRO's compressed reduction, float32 accumulation: 16 bits on the
    wire only (within one 16-bit rounding of the mean per hop, several
    segments included), or int8/int4 blocks through one all-to-all (within
    one quantisation step of each rank's block); any count a multiple of
    the world size."""
    n = world_size
    numels = [0, n, 1001 * n, (1 << 18) * n + 4 * n]
    for got, error in run_ranks(_half_reduce_scatter, n, numels):
        for spec, numel, part, want in got:
            # fp16/bf16: one rounding per hop of values no larger than the
            # inputs' (|x| < 6 for these draws); int8/int4: one step of a
            # block's scale (its largest |x| over 127 or 7) from each rank,
            # averaged over the ranks.
            if spec in ("fp16", "bf16"):
                bound = n * (2.0**-11 if spec == "fp16" else 2.0**-8) * 6.0
            else:
                bound = 6.0 / (127 if spec == "int8" else 7)
            err = (part - want).abs().max().item() if numel else 0.0
            assert err <= bound, (spec, numel, err, bound)
        if n > 1:  # (one rank divides any count)
            assert "divide evenly" in error and str(n * 3 + 1) in error, error


def _sparse_reduce_scatter(rank, n, numel):
    """Each sparse compressor's reduce-scatter against its own all-reduce's
    slice, from the same inputs and the same (fresh) state, twice in a row
    (the second call starts from the residual the first left)."""
    out = []
    for spec in ("topk:0.05", "topk:0.05:exact", "topk:0.05+fp16", "randomk:0.1", "none"):
        c = get_compressor(spec)
        states = CompressorState(), CompressorState()
        for call in range(2):
            x = _grad(300 + 7 * rank + call, numel)
            whole = x.clone()
            c.all_reduce_mean(whole, states[0], "w", dist.group.WORLD)
            part = torch.full((numel // n,), float("nan"))
            c.reduce_scatter_mean(x.clone(), part, states[1], "w", dist.group.WORLD)
            want = whole[rank * (numel // n) : (rank + 1) * (numel // n)]
            residuals = (s.residuals.values() for s in states)
            same = [torch.equal(a, b) for a, b in zip(*residuals, strict=True)]
            out.append((spec, call, part, want, all(same)))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sparse_reduce_scatter_is_its_all_reduce_s_part(world_size):
    """Top-k (sampled, exact, fp16 values) and random-k send each selected
    pair only to the rank whose part holds it: that part equals the
    all-reduce's, and the error-feedback residuals are the same."""
    n = world_size
    for got in run_ranks(_sparse_reduce_scatter, n, 4000 * n):
        for spec, call, part, want, same_residual in got:
            torch.testing.assert_close(part, want, atol=1e-6, rtol=1e-5, msg=(spec, call))
            assert same_residual, (spec, call)


def _sparse(rank, n, numel, values, form):
    rng = np.random.default_rng(rank)
    k = 10 + 7 * rank  # ranks send different numbers of pairs
    idx = torch.from_numpy(np.sort(rng.choice(numel, k, replace=False)).astype(np.int32))
    val = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    out = torch.empty(numel)
    sparse_all_reduce(idx, val, out, values=values, form=form)
    return idx, val, out


@pytest.mark.parametrize("form", ["gather", "reduce_scatter"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sparse_all_reduce_is_the_dense_sum_of_the_sparse_inputs(world_size, form):
    for numel, values in [(1000, "fp32"), (200_000, "fp32"), (70_000, "fp16")]:
        results = run_ranks(_sparse, world_size, numel, values, form)
        want = torch.zeros(numel)
        for idx, val, _ in results:
            v = val.to(torch.float16).float() if values == "fp16" else val
            want.index_add_(0, idx.long(), v)
        for _, _, out in results:
            if values == "fp32":
                assert torch.equal(out, want), (numel, form)
            else:
                assert torch.allclose(out, want, atol=2e-3), (numel, form)


def _error_feedback(rank, n):
    state = CompressorState()
    x = _grad(rank, 1000)
    sums = []
    for _ in range(3):
        before = state.residual("g", x).clone()
        t = x.clone()
        compressed_all_reduce(t, "topk:10:exact", state, key="g")
        sums.append((before, state.residuals["g"].clone(), t))
    return x, sums


def test_error_feedback_over_steps_and_world():
    """Each step sends the top entries of grad + residual and keeps the rest:
    over steps, sent + kept = everything accumulated."""
    results = run_ranks(_error_feedback, 2)
    x0, x1 = results[0][0], results[1][0]
    total_sent = torch.zeros(1000)
    for step in range(3):
        out = results[0][1][step][2]
        total_sent += out
    residual = results[0][1][2][1] + results[1][1][2][1]
    assert torch.allclose(total_sent + residual, 3 * (x0 + x1), atol=1e-5)


def _fp16_error(rank, n, xs):
    t = xs[rank].clone()
    compressed_all_reduce(t, "fp16", average=False)
    return t


def test_16_bit_wire_beats_summing_in_16_bits():
    n, numel = 4, 20_000
    xs = [_grad(7 + r, numel) * 50 + 0.001 * r for r in range(n)]
    exact = sum(x.double() for x in xs)
    wire = run_ranks(_fp16_error, n, xs)[0].double()
    # What summing in float16 gives: every input and partial sum rounded.
    s = xs[0].half()
    for x in xs[1:]:
        s = (s + x.half()).half()
    err_wire = (wire - exact).abs().mean()
    err_half = (s.double() - exact).abs().mean()
    assert err_wire < err_half, (err_wire, err_half)


def _bytes(rank, n):
    out = {}
    for spec in ["none", "fp16", "topk:0.01"]:
        before = clawcomm.comm_stats()
        compressed_all_reduce(_grad(rank, 1 << 18), spec, CompressorState())
        after = clawcomm.comm_stats()
        out[spec] = sum(after[k]["bytes_sent"] - before[k]["bytes_sent"] for k in after)
    return out


def test_wire_bytes_are_measured():
    sent = run_ranks(_bytes, 2)[0]
    assert 0.49 < sent["fp16"] / sent["none"] < 0.51
    assert sent["topk:0.01"] / sent["none"] < 0.03


def test_random_k_is_unbiased():
    """World size 1: the estimate averaged over many draws approaches x."""

    def body(rank, n):
        x = _grad(5, 2000)
        state, total = CompressorState(), torch.zeros(2000)
        for _ in range(400):
            t = x.clone()
            compressed_all_reduce(t, "randomk:0.25", state, key=0)
            total += t
        return x, total / 400

    x, mean = run_ranks(body, 1)[0]
    assert (mean - x).abs().mean() < 0.25 * x.abs().mean()


class _Sign(Compressor):
    """A researcher's compressor: the sign of each entry times the mean
    magnitude, summed densely (here through a plain all-reduce)."""

    spec = "sign"

    def all_reduce(self, tensor, state, key, group):
        scale = tensor.abs().mean()
        tensor.copy_(tensor.sign() * scale)
        dist.all_reduce(tensor, group=group)


def test_register_a_python_compressor():
    register_compressor("sign_test", lambda *args, spec: _Sign())
    with pytest.raises(ValueError, match="already registered"):
        register_compressor("sign_test", lambda *args, spec: _Sign())

    def body(rank, n):
        t = torch.tensor([2.0, -4.0])
        return compressed_all_reduce(t, "sign_test")

    assert torch.equal(run_ranks(body, 2)[0], torch.tensor([6.0, -6.0]))


def test_state_dict_round_trip():
    s = CompressorState()
    t = _grad(1, 100)
    compressed_all_reduce_local = get_compressor("topk:5:exact")
    s.residual(0, t).add_(t)
    s.step = 3
    s2 = CompressorState()
    s2.load_state_dict(s.state_dict())
    assert s2.step == 3 and torch.equal(s2.residuals[0], s.residuals[0])
    assert compressed_all_reduce_local.uses_error_feedback


def _ddp(rank, n, spec, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clawcomm.hooks import CompressionHookState, compression_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    state = CompressionHookState("none" if spec == "ddp" else spec, warmup_steps=3)
    if spec != "ddp":  # "ddp": DDP's own all-reduce, the reference
        ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(20, 1, generator=torch.Generator().manual_seed(9))
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 20, generator=gen)
        loss = ((ddp(x) - x @ w) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    saved = state.state_dict()
    return [p.detach().clone() for p in model.parameters()], losses, saved, state.step


def test_hooks_match_ddp_when_lossless_and_converge_when_sparse():
    dense, dense_losses, _, _ = run_ranks(_ddp, 2, "ddp", 60)[0]
    fp32, _, _, steps = run_ranks(_ddp, 2, "none", 60)[0]
    assert steps == 60
    for a, b in zip(dense, fp32, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    fp16, _, _, _ = run_ranks(_ddp, 2, "fp16", 60)[0]
    for a, b in zip(dense, fp16, strict=True):
        assert torch.allclose(a, b, atol=2e-2)
    results = run_ranks(_ddp, 2, "topk:0.1", 150)
    params, losses, saved, _ = results[0]
    assert np.mean(losses[-20:]) < 0.2 * np.mean(losses[:5])
    # Both ranks ended with the same model, and residuals are in the state dict.
    for a, b in zip(params, results[1][0], strict=True):
        assert torch.equal(a, b)
    assert saved["spec"] == "topk:0.1" and saved["compression"]["residuals"]


def test_hook_state_checks():
    from clawcomm.hooks import CompressionHookState

    with pytest.raises(ValueError, match="warmup_steps -1 must be >= 0"):
        CompressionHookState("fp16", warmup_steps=-1)
    s = CompressionHookState("topk:0.1")
    with pytest.raises(ValueError, match="checkpoint was made with 'fp16'"):
        s.load_state_dict(CompressionHookState("fp16").state_dict())


def test_non_float32_tensors_are_refused():
    def body(rank, n):
        with pytest.raises(ValueError, match="needs a contiguous float32 CPU or CUDA tensor"):
            compressed_all_reduce(torch.zeros(4, dtype=torch.float64), "topk:0.5")
        return True

    assert run_ranks(body, 1) == [True]


def test_experiment_runs_and_writes_results(tmp_path, capsys):
    """In this process (the command line as typed; its ranks are forked)."""
    from clawcomm.cli import main

    out = tmp_path / "e.json"
    argv = ["experiment", "compression", "--methods", "none,fp16,topk:0.05,diloco:8+int8",
            "--steps", "40", "--warmup", "5", "--json", str(out), "--plot",
            str(tmp_path / "e.png"), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    data = json.loads(out.read_text())["links"]["one host"]
    by = {r["compressor"]: r for r in data["results"]}
    assert 0.49 < by["fp16"]["bytes_per_step"] / by["none"]["bytes_per_step"] < 0.52
    assert by["topk:0.05"]["bytes_per_step"] < 0.15 * by["none"]["bytes_per_step"]
    # DiLoCo meets 5 times in 40 steps with int8 codes: about 1/32 of dense's bytes.
    assert by["diloco:8+int8"]["bytes_per_step"] < 0.05 * by["none"]["bytes_per_step"]
    assert by["compute"]["bytes_per_step"] < 200  # the bound: nothing exchanged
    assert data["target_loss"] == pytest.approx(1.05 * by["none"]["final_loss"], abs=1e-4)
    assert by["none"]["steps_to_target"] and by["none"]["gap_closed"] == 0.0
    assert set(by["none"]["projected_step_ms"]) == {"8", "64", "512"}
    assert "gap closed" in stdout and (tmp_path / "e.png").stat().st_size > 5000
    assert f"wrote results {out}" in stdout
    assert main(["experiment", "compression", "-c", "topk:2.0"]) == 2
    assert "ratio 2.0 is not in (0, 1]" in capsys.readouterr().err
    assert main(["experiment", "compression", "-c", "diloco:0"]) == 2
    assert "H must be >= 1" in capsys.readouterr().err


def test_the_lab_times_methods_to_a_target_and_projects_them():
    from clawcomm.experiments import lab

    def run(name, step_ms, curve, nbytes):
        return {"compressor": name, "step_ms": step_ms, "curve": curve, "bytes_per_step": nbytes,
                "final_loss": curve[-1][1], "test_accuracy": 0.9}  # fmt: skip

    def curve(step_ms, nbytes, *points):  # (step, loss) -> (step, loss, bytes, seconds)
        return [(s, loss, s * nbytes, s * step_ms / 1e3) for s, loss in points]

    results = [
        run("none", 100.0, curve(100.0, 4e6, (0, 2.0), (10, 1.0), (20, 0.5)), 4e6),
        run("int8", 40.0, curve(40.0, 1e6, (0, 2.0), (10, 1.2), (20, 0.51)), 1e6),
        run("topk:0.01", 30.0, curve(30.0, 1e5, (0, 2.0), (20, 0.9)), 1e5),
        run("compute", 20.0, curve(20.0, 0, (0, 2.0), (20, 0.6)), 0),
    ]
    got = lab.analyse(results, None, "1gbit")
    assert got["target_loss"] == pytest.approx(0.525)
    none, int8, topk, compute = results
    assert none["steps_to_target"] == 20 and none["seconds_to_target"] == pytest.approx(2.0)
    assert int8["steps_to_target"] == 20 and topk["steps_to_target"] is None
    # The gap between dense (2.0 s) and compute alone (20 steps x 20 ms):
    assert int8["gap_closed"] == pytest.approx((2.0 - 0.8) / (2.0 - 0.4))
    assert compute["gap_closed"] is None and topk["gap_closed"] is None
    # At 1 Gbit/s a 4 MB all-reduce's time grows with the hosts; nothing sent, nothing grows.
    p = none["projected_step_ms"]
    assert p[8] < p[64] < p[512] and p[8] > 100.0
    assert compute["projected_step_ms"] == {8: 20.0, 64: 20.0, 512: 20.0}
    # Gathered pairs grow with the hosts faster than an all-reduce.
    assert topk["projected_step_ms"][512] - 30.0 > int8["projected_step_ms"][512] - 40.0
    assert "never" in lab.table(results)
    # A loaded machine timed dense no slower than compute alone: the gap has
    # no width; dense still closes none of it, the others' share is undefined.
    compute["step_ms"] = 100.0
    lab.analyse(results, None, "1gbit")
    assert none["gap_closed"] == 0.0 and int8["gap_closed"] is None


WIRE_SIZES = [0, 1, 5, 10_007]  # empty, one element, fewer than ranks, odd


def _ring16_reference(xs, wire, prescale, postscale):
    """What the 16-bit-wire ring must give, bit for bit: chunk c is summed
    in float32 starting at rank c+1, each rank adding its pre-scaled input to
    the partial sum decoded from 16 bits; the owner rounds the result once
    more for everyone, and every rank multiplies it by the post-scale."""
    n, dt = len(xs), getattr(torch, wire)
    xs = [x * torch.tensor(prescale, dtype=torch.float32) for x in xs]
    base, extra = divmod(xs[0].numel(), n)
    bounds = np.cumsum([0] + [base + (c < extra) for c in range(n)])
    out = torch.empty_like(xs[0])
    for c in range(n):
        part = slice(bounds[c], bounds[c + 1])
        acc = xs[(c + 1) % n][part]
        for k in range(2, n + 1):
            acc = xs[(c + k) % n][part] + acc.to(dt).float()
        out[part] = acc.to(dt).float() * torch.tensor(postscale, dtype=torch.float32)
    return out


def _wire_runs(rank, n):
    results = []
    for wire, spec in (("float16", "fp16"), ("bfloat16", "bf16")):
        for numel in WIRE_SIZES:
            xs = [_grad(300 + r, numel) * 3 for r in range(n)]
            for mean in (True, False):  # 1/n before; and for the sum, n after
                t = xs[rank].clone()
                compressed_all_reduce(t, spec, average=mean)
                post = np.float32(1.0 if mean else n)
                results.append((t, _ring16_reference(xs, wire, np.float32(1.0 / n), post)))
    return results


@pytest.mark.parametrize(
    "env",
    [
        None,
        {"CLAWCOMM_SEGMENT_BYTES": "256"},
        {"CLAWCOMM_SEGMENT_BYTES": "256", "CLAWCOMM_SIMD": "portable"},
    ],
    ids=["default", "small-segments", "small-segments-portable"],
)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_16_bit_wire_matches_the_ring_bit_for_bit(world_size, env):
    """Against a local replay of the algorithm, on every rank, for both
    wires, means and sums, and awkward sizes; with 256-byte segments every
    chunk crosses the wire in dozens of pieces, which the pipeline overlaps
    (and forwards, at 3 and 4 ranks)."""
    for rank_results in run_ranks(_wire_runs, world_size, env=env):
        for got, want in rank_results:
            assert torch.equal(got, want)
