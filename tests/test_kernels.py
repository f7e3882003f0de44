"""The element-wise kernels at every SIMD level this CPU has, against numpy
and torch: reductions bit-identical to the portable build, conversions
identical to torch's round-to-nearest-even."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clawcomm import _C
from clawcomm.launch import run_ranks

K = _C.kernels
ORDER = ["portable", "avx2", "avx512"]
LEVELS = ORDER[: ORDER.index(K.best_simd_level()) + 1]
# Lengths that leave tails after 8- and 16-lane vectors and 512-element blocks.
LENGTHS = [0, 1, 7, 8, 15, 17, 511, 513, 1500]

NUMPY_OPS = {
    "sum": np.add,
    "product": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def _values(dtype, n, seed):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        x = rng.standard_normal(n) * 100
        x[::7] = 0.0
        if n > 3:
            x[3] = -x[3]
        return x.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "dtype,op",
    [
        (dtype, op)
        for dtype in ["float32", "float64", "int8", "uint8", "int32", "int64"]
        for op in NUMPY_OPS
        if not (dtype.startswith("float") and op.startswith("b"))  # bitwise: integers only
    ],
)
def test_reduce_matches_numpy(level, dtype, op):
    for n in LENGTHS:
        a, b = _values(np.dtype(dtype), n, 1), _values(np.dtype(dtype), n, 2)
        with np.errstate(over="ignore"):
            want = NUMPY_OPS[op](a, b)
        got = a.copy()
        K.reduce(got, b, op, level)
        np.testing.assert_array_equal(got, want, err_msg=f"{op} {dtype} n={n} at {level}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "product", "min", "max"])
def test_16_bit_reduce_accumulates_in_float32_once(level, dtype, op):
    """One rounding per call: the result is float32(a) op float32(b) rounded."""
    tdtype = getattr(torch, dtype)
    torch_op = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}[
        op
    ]
    for n in LENGTHS:
        a = torch.from_numpy(_values(np.float32, n, 3) / 50).to(tdtype)
        b = torch.from_numpy(_values(np.float32, n, 4) / 50).to(tdtype)
        want = torch_op(a.float(), b.float()).to(tdtype)
        got = a.clone()
        K.reduce(
            got.view(torch.uint16).numpy(), b.view(torch.uint16).numpy(), op, level, dtype=dtype
        )
        assert torch.equal(got.view(torch.uint16), want.view(torch.uint16)), (dtype, op, n, level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_conversions_match_torch(level, dtype):
    tdtype = getattr(torch, dtype)
    for n in LENGTHS:
        x = torch.from_numpy(_values(np.float32, n, 5))
        x[::5] *= 1e-6  # subnormals in float16
        if n > 2:
            x[1] = float("inf")
            x[2] = 1e6  # overflows float16
        want16 = x.to(tdtype)
        got16 = np.zeros(n, np.uint16)
        K.from_float32(x.numpy(), got16, dtype, level)
        np.testing.assert_array_equal(got16, want16.view(torch.uint16).numpy(), err_msg=f"{n}")
        back = np.zeros(n, np.float32)
        K.to_float32(got16, back, dtype, level)
        np.testing.assert_array_equal(back, want16.float().numpy())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scaled_conversions_round_each_operation_once(level, dtype):
    """The 16-bit ring's kernels with their scale factors: a float32 product
    (and sum) rounded on its own, never a fused multiply-add, at every level."""
    tdtype = getattr(torch, dtype)
    for n in LENGTHS:
        x = torch.from_numpy(_values(np.float32, n, 6))
        h = torch.from_numpy(_values(np.float32, n, 7)).to(tdtype)
        acc = torch.from_numpy(_values(np.float32, n, 8) / 3)
        for scale in (np.float32(1 / 3), np.float32(7.0)):
            s = torch.tensor(scale)
            got16 = np.zeros(n, np.uint16)
            K.from_float32(x.numpy(), got16, dtype, level, scale=scale)
            np.testing.assert_array_equal(got16, (x * s).to(tdtype).view(torch.uint16).numpy())
            back = np.zeros(n, np.float32)
            K.to_float32(h.view(torch.uint16).numpy(), back, dtype, level, scale=scale)
            np.testing.assert_array_equal(back, (h.float() * s).numpy())
            got = acc.clone()
            K.add_from16(got.numpy(), h.view(torch.uint16).numpy(), dtype, level, dst_scale=scale)
            assert torch.equal(got, acc * s + h.float()), (n, scale, level)
            got, out = acc.clone(), np.zeros(n, np.uint16)
            K.add_from16_and_round(
                got.numpy(), h.view(torch.uint16).numpy(), out, dtype, level,
                dst_scale=scale, out_scale=np.float32(4.0),
            )  # fmt: skip
            want16 = (acc * s + h.float()).to(tdtype)
            np.testing.assert_array_equal(out, want16.view(torch.uint16).numpy())
            assert torch.equal(got, want16.float() * 4), (n, scale, level)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="kernels.reduce: dst has 3 elements, src 4"):
        K.reduce(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        K.reduce(np.zeros(3, np.float32), np.zeros(3, np.float32), "mean")
    with pytest.raises(ValueError, match="band is not defined on float32"):
        K.reduce(np.zeros(3, np.float32), np.zeros(3, np.float32), "band")
    with pytest.raises(ValueError, match="kernels.add_from16_and_round: dst has 3 elements, out 4"):
        K.add_from16_and_round(
            np.zeros(3, np.float32), np.zeros(3, np.uint16), np.zeros(4, np.uint16)
        )
    with pytest.raises(ValueError, match="kernels.to_float32: dtype float32 is not float16 or bf"):
        K.to_float32(np.zeros(3, np.float32), np.zeros(3, np.float32), "float32")
    with pytest.raises(ValueError, match="unknown SIMD level 'sse9'"):
        K.reduce(np.zeros(3, np.float32), np.zeros(3, np.float32), "sum", "sse9")
    with pytest.raises(ValueError, match="input is float32 but output is float64"):
        K.reduce(np.zeros(3, np.float64), np.zeros(3, np.float32))


def _simd_level(rank, world_size):
    return K.simd_level()


def test_clawcomm_simd_caps_the_level_in_each_rank():
    assert run_ranks(_simd_level, 2, env={"CLAWCOMM_SIMD": "portable"}) == ["portable"] * 2
    capped = "avx2" if "avx2" in LEVELS else "portable"
    assert run_ranks(_simd_level, 1, env={"CLAWCOMM_SIMD": "avx2"}) == [capped]
    assert run_ranks(_simd_level, 1, env={"CLAWCOMM_SIMD": "auto"}) == [LEVELS[-1]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [0, 1, 17, 1500])
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_16_bit_error_feedback_pass(dtype, n, scale):
    """encode16_feedback (the math the CUDA kernel shares): payload is torch's
    rounding of (grad + residual) * scale, and payload / scale + new residual
    gives back grad + residual."""
    rng = np.random.default_rng(n)
    grad = rng.standard_normal(n).astype(np.float32) * 100
    residual = rng.standard_normal(n).astype(np.float32)
    grad[:3] = [np.inf, -0.0, 1e-30][: min(3, n)]
    acc = grad + residual
    payload = np.empty(n, np.uint16)
    _C.compress.encode16_feedback(grad, residual, payload, dtype, scale)
    tdt = getattr(torch, dtype)
    want = (torch.from_numpy(acc) * scale).to(tdt).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(payload, want)
    sent = torch.from_numpy(payload.view(np.int16)).view(tdt).float().numpy()
    back = acc - sent * np.float32(1 / scale)
    assert np.array_equal(residual, back, equal_nan=True)
    finite = np.isfinite(acc)
    assert np.allclose((sent / scale + residual)[finite], acc[finite], rtol=1e-6, atol=1e-30)


def test_16_bit_error_feedback_rejects_bad_arguments():
    g = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="encode16_feedback: the wire format"):
        _C.compress.encode16_feedback(g, g.copy(), np.empty(4, np.uint16), "int8")
    with pytest.raises(ValueError, match="encode16_feedback: scale 0"):
        _C.compress.encode16_feedback(g, g.copy(), np.empty(4, np.uint16), "float16", 0.0)
    with pytest.raises(ValueError, match="encode16_feedback: grad has 4 elements, residual 3"):
        _C.compress.encode16_feedback(g, g[:3].copy(), np.empty(4, np.uint16))
