"""Gradient compression's kernels: top-k selection (exact and sampled) and
its error-feedback invariant, the threshold scan at every SIMD level, block
quantisation, and their argument checks, against numpy and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _cases import normal_grad as _grad

from clawcomm import _C


@pytest.mark.parametrize("method", ["exact", "sampled"])
@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (300_000, 3000), (50, 80)])
def test_topk_keeps_error_feedback_invariant(method, n, k):
    x = _grad(n, n)
    acc = x.clone()
    idx, val = _C.compress.topk(acc.numpy(), k, method, 7)
    assert len(idx) <= min(k, n) and np.all(np.diff(idx) > 0)
    sent = torch.zeros(n)
    sent[torch.from_numpy(idx).long()] = torch.from_numpy(val)
    # What was sent plus the residual is exactly what was accumulated.
    assert torch.equal(sent + acc, x)
    assert torch.all(acc[torch.from_numpy(idx).long()] == 0)
    if method == "exact":
        assert len(idx) == min(k, n)
    else:
        assert len(idx) >= 0.5 * min(k, n)
        # Everything sent is at least as large as everything kept back.
        if len(idx) and len(idx) < n:
            assert np.abs(val).min() >= acc.abs().max() - 1e-6 or len(idx) < k


def test_exact_topk_matches_torch_topk():
    x = _grad(3, 100_000)
    for k in (1, 17, 1000):
        acc = x.clone()
        idx, val = _C.compress.topk(acc.numpy(), k, "exact")
        ref = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(torch.from_numpy(idx).long(), ref)
        assert torch.equal(torch.from_numpy(val), x[ref])


def test_sampled_topk_is_one_pass_cheap():
    """Not a timing assertion: the sampled selection reads the tensor once,
    so on 16M values it picks within 10% of k entries."""
    x = _grad(4, 1 << 24)
    idx, _ = _C.compress.topk(x.numpy(), 1 << 17, "sampled", 1)
    assert 0.9 * (1 << 17) <= len(idx) <= 1 << 17


_LEVELS = ["portable", "avx2", "avx512"]
_LEVELS = _LEVELS[: _LEVELS.index(_C.kernels.best_simd_level()) + 1]


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 72, 264, 1000, 100_003])
@pytest.mark.parametrize("threshold", [0.0, 1.0, 2.5, float("inf")])
def test_threshold_scan_matches_numpy_at_every_level(level, fold, n, threshold):
    """The pass behind top-k, at every SIMD level: the entries that reach the
    threshold, in order, zeroed where they were (threshold 0 takes all of
    them, which outgrows the first candidate buffer several times; at 72
    and 264 the last full block fills the buffer exactly, and the tail
    after it must still find room)."""
    rng = np.random.default_rng(n)
    acc = rng.standard_normal(n).astype(np.float32)
    if n >= 17:
        acc[[3, 16]] = [np.inf, np.nan]  # NaN is always sent, never hidden
    grad = rng.standard_normal(n).astype(np.float32) if fold else None
    a = acc + grad if fold else acc.copy()
    hit = ~(np.abs(a) < threshold)
    idx, val = _C.compress.threshold_scan(acc, threshold, grad, level)
    np.testing.assert_array_equal(idx, np.flatnonzero(hit))
    np.testing.assert_array_equal(val, a[hit])
    np.testing.assert_array_equal(acc, np.where(hit, 0, a))
    if fold:
        np.testing.assert_array_equal(grad, np.zeros(n, np.float32))


@pytest.mark.parametrize("method", ["exact", "sampled"])
@pytest.mark.parametrize("n,k", [(1, 1), (10, 0), (1000, 10), (300_001, 3000), (50, 80)])
def test_topk_feedback_sends_the_top_of_grad_plus_residual(method, n, k):
    """The fused pass: sent + new residual == grad + old residual bit for bit,
    the gradient is left zeroed, and exact selection picks what torch.topk
    picks from the sum."""
    g, r = _grad(n, n).numpy(), _grad(n + 1, n).numpy()
    total = g + r
    idx, val = _C.compress.topk_feedback(g, r, k, method, 3)
    sent = np.zeros(n, np.float32)
    sent[idx] = val
    np.testing.assert_array_equal(sent + r, total)
    np.testing.assert_array_equal(g, np.zeros(n, np.float32))
    assert np.all(r[idx] == 0) and np.all(np.diff(idx) > 0)
    if method == "exact":
        ref = torch.topk(torch.from_numpy(total).abs(), min(k, n)).indices.sort().values
        np.testing.assert_array_equal(idx, ref.numpy())
    else:
        assert 0.5 * min(k, n) <= len(idx) <= min(k, n)


def test_topk_feedback_argument_errors():
    buf = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="grad and residual overlap"):
        _C.compress.topk_feedback(buf[:6], buf[2:], 1)
    with pytest.raises(ValueError, match="grad has 4 elements but residual has 8"):
        _C.compress.topk_feedback(np.zeros(4, np.float32), buf, 1)
    with pytest.raises(ValueError, match="negative threshold -1"):
        _C.compress.threshold_scan(buf, -1.0)


def test_kernel_argument_errors():
    with pytest.raises(ValueError, match="method 'fast' is not 'exact' or 'sampled'"):
        _C.compress.topk(np.zeros(4, np.float32), 2, "fast")
    with pytest.raises(ValueError, match="index 9 is outside a tensor of 4 elements"):
        _C.compress.scatter_add(np.zeros(4, np.float32), np.array([9], np.int32),
                                np.ones(1, np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="2 indices but 1 values"):
        _C.compress.scatter_add(np.zeros(4, np.float32), np.zeros(2, np.int32),
                                np.ones(1, np.float32))  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantisation_is_within_a_step_and_unbiased(bits):
    """Rounded to nearest: within half a step of each block's scale (its
    largest magnitude over 127 or 7, which itself comes back exactly);
    rounded stochastically: within one step, and the mean of many draws
    converges on the value. int4 packs two to a byte; a zero block stays
    zero."""
    from clawcomm.compression.quantized import dequantize, quantize

    q = (1 << (bits - 1)) - 1
    x = _grad(7, 4 * 64)
    x[64:128] = 0.0
    ints, scales = quantize(x, bits, 64)
    assert ints.dtype == torch.uint8 and ints.numel() == x.numel() * bits // 8
    step = (x.view(-1, 64).abs().amax(1) / q).repeat_interleave(64)
    y = dequantize(ints, scales, bits, 64)
    assert torch.all((y - x).abs() <= step / 2 + 1e-7)
    assert torch.equal(y[64:128], torch.zeros(64))
    peaks = x.view(-1, 64).abs().argmax(1) + torch.arange(4) * 64
    torch.testing.assert_close(y[peaks].abs(), x[peaks].abs())
    draws = [dequantize(*quantize(x, bits, 64, seed), bits, 64) for seed in range(4000)]
    assert all(torch.all((d - x).abs() <= step + 1e-6) for d in draws[:10])
    mean = torch.stack(draws).mean(0)
    assert torch.all((mean - x).abs() <= step * 0.06)  # 4000 draws: a few % of a step


@pytest.mark.parametrize("grad", ["strided", "float64"])
def test_threshold_scan_refuses_a_grad_it_would_copy(grad):
    """grad is zeroed in place: a strided or float64 one used to be copied
    silently, and the copy zeroed, leaving the caller's array as it was."""
    acc = np.ones(8, dtype=np.float32)
    g = np.ones(16, dtype=np.float32)[::2] if grad == "strided" else np.ones(8)
    with pytest.raises(ValueError, match="grad must be a C-contiguous float32 array"):
        _C.compress.threshold_scan(acc, 0.5, g)
