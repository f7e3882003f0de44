"""The CUDA kernels (csrc/cuda/, ``clawcomm._C.cuda``) against the CPU kernels
they share their math with: reductions for every dtype and operator,
16-bit conversions, the 16-bit error-feedback pass, top-k with error feedback
(exact and sampled: the same entries, values and residual as the CPU), the
scatter-add (deterministic: the CPU's bits), and block quantisation (the
CPU's codes, scales and residuals for the same seed). Runs on a GPU machine with a
CUDA build of clawcomm; skips cleanly elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clawcomm import _C

HAVE_GPU = torch.backends.cuda.is_built() and torch.cuda.device_count() > 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU"),
    pytest.mark.skipif(not getattr(_C, "cuda_built", False), reason="clawcomm built without CUDA"),
]

K = _C.kernels
DTYPES = {
    "float32": np.float32,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
    "float16": np.float16,
    "bfloat16": np.uint16,  # bit patterns
}
FLOAT_OPS = ["sum", "product", "min", "max"]
INT_OPS = FLOAT_OPS + ["band", "bor", "bxor"]
LENGTHS = [0, 1, 7, 33, 1000, 100_003]


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _gpu(a: np.ndarray, offset: int = 0) -> torch.Tensor:
    """`a` on the GPU, starting `offset` elements into a larger buffer (to
    test unaligned pointers)."""
    flat = torch.from_numpy(a.view(np.uint8).copy())
    buf = torch.zeros(flat.numel() + offset * a.itemsize, dtype=torch.uint8, device="cuda")
    view = buf[offset * a.itemsize :]
    view.copy_(flat)
    return view


def _cpu(t: torch.Tensor, dtype) -> np.ndarray:
    torch.cuda.synchronize()
    return t.cpu().numpy().view(dtype)


def _values(dtype, n, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(np.bool_)
    if dtype == "bfloat16":
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 4)
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if dtype in ("float32", "float64", "float16"):
        return (rng.standard_normal(n) * 4).astype(DTYPES[dtype])
    info = np.iinfo(DTYPES[dtype])
    return rng.integers(max(info.min, -50), min(info.max, 50), n).astype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("offset", [0, 1])
def test_reduce_matches_the_cpu_kernel(dtype, n, offset):
    ops = FLOAT_OPS if dtype in ("float32", "float64", "float16", "bfloat16") else INT_OPS
    for op in ops:
        a, b = _values(dtype, n, 1), _values(dtype, n, 2)
        want = a.copy()
        K.reduce(want, b, op=op, dtype="bfloat16" if dtype == "bfloat16" else None)
        da, db = _gpu(a, offset), _gpu(b, 0)
        _C.cuda.reduce(da.data_ptr(), db.data_ptr(), n, dtype, op, _stream())
        assert np.array_equal(_cpu(da, a.dtype), want), (dtype, op, n)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", LENGTHS)
def test_16_bit_wire_kernels_match_the_cpu(dtype, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32) * 100
    h = np.empty(n, np.uint16)
    K.from_float32(x, h, dtype=dtype, scale=0.5)
    dx, dh = _gpu(x), torch.empty(n * 2, dtype=torch.uint8, device="cuda")
    _C.cuda.from_float32(dx.data_ptr(), dh.data_ptr(), n, dtype, 0.5, _stream())
    assert np.array_equal(_cpu(dh, np.uint16), h)

    back = np.empty(n, np.float32)
    K.to_float32(h, back, dtype=dtype, scale=3.0)
    dback = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
    _C.cuda.to_float32(dh.data_ptr(), dback.data_ptr(), n, dtype, 3.0, _stream())
    assert np.array_equal(_cpu(dback, np.float32), back)

    acc = x.copy()
    K.add_from16(acc, h, dtype=dtype, dst_scale=0.25)
    dacc = _gpu(x)
    _C.cuda.add_from16(dacc.data_ptr(), dh.data_ptr(), n, dtype, 0.25, _stream())
    assert np.array_equal(_cpu(dacc, np.float32), acc)

    acc, out = x.copy(), np.empty(n, np.uint16)
    K.add_from16_and_round(acc, h, out, dtype=dtype, dst_scale=0.5, out_scale=2.0)
    dacc, dout = _gpu(x), torch.empty(n * 2, dtype=torch.uint8, device="cuda")
    _C.cuda.add_from16_and_round(
        dacc.data_ptr(), dh.data_ptr(), dout.data_ptr(), n, dtype, 0.5, 2.0, _stream()
    )
    assert np.array_equal(_cpu(dacc, np.float32), acc)
    assert np.array_equal(_cpu(dout, np.uint16), out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", LENGTHS)
def test_16_bit_error_feedback_matches_the_cpu(dtype, n):
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32) * 0.01
    want_r, want_p = r.copy(), np.empty(n, np.uint16)
    _C.compress.encode16_feedback(g, want_r, want_p, dtype, 0.25)
    dg, dr = _gpu(g), _gpu(r)
    dp = torch.empty(n * 2, dtype=torch.uint8, device="cuda")
    _C.cuda.encode16_feedback(
        dg.data_ptr(), dr.data_ptr(), dp.data_ptr(), n, dtype, 0.25, _stream()
    )
    assert np.array_equal(_cpu(dp, np.uint16), want_p)
    assert np.array_equal(_cpu(dr, np.float32), want_r)


@pytest.mark.parametrize("method", ["exact", "sampled"])
@pytest.mark.parametrize(
    "n,k", [(1, 1), (100, 7), (5000, 50), (300_000, 3000), (2_000_003, 20_000)]
)
@pytest.mark.parametrize("ties", [False, True])
def test_topk_with_feedback_matches_the_cpu(method, n, k, ties):
    rng = np.random.default_rng(n + k)
    g = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32) * 0.1
    if ties:  # many equal magnitudes: the tie rule (lower index first) decides
        g = np.round(g * 2) / 2
        r[:] = 0
    want_g, want_r = g.copy(), r.copy()
    want_idx, want_val = _C.compress.topk_feedback(want_g, want_r, k, method, 11)
    dg, dr = _gpu(g), _gpu(r)
    idx = torch.empty(k, dtype=torch.int32, device="cuda")
    val = torch.empty(k, dtype=torch.float32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    ws = torch.empty(_C.cuda.topk_workspace_bytes(n), dtype=torch.uint8, device="cuda")
    _C.cuda.topk_feedback(
        dg.data_ptr(), dr.data_ptr(), n, k,
        idx.data_ptr(), val.data_ptr(), count.data_ptr(), ws.data_ptr(), method, 11, _stream(),
    )  # fmt: skip
    torch.cuda.synchronize()
    m = int(count.item())
    assert m == len(want_idx)
    assert np.array_equal(idx[:m].cpu().numpy(), want_idx)
    assert np.array_equal(val[:m].cpu().numpy(), want_val)
    assert np.array_equal(_cpu(dr, np.float32), want_r)
    assert not _cpu(dg, np.float32).any()


@pytest.mark.parametrize("m", [0, 1, 1000, 200_000])
def test_scatter_add_deterministic_gives_the_cpu_bits(m):
    n = 5000
    rng = np.random.default_rng(m)
    idx = rng.integers(0, n, m).astype(np.int32)  # many collisions
    val = rng.standard_normal(m).astype(np.float32)
    dense = rng.standard_normal(n).astype(np.float32)
    want = dense.copy()
    _C.compress.scatter_add(want, idx, val, 0.5)
    dd, di, dv = _gpu(dense), _gpu(idx), _gpu(val)
    ws = torch.empty(
        max(1, _C.cuda.scatter_add_workspace_bytes(m)), dtype=torch.uint8, device="cuda"
    )
    _C.cuda.scatter_add(
        dd.data_ptr(), n, di.data_ptr(), dv.data_ptr(), m, 0.5, True, ws.data_ptr(), _stream()
    )
    assert np.array_equal(_cpu(dd, np.float32), want)
    da = _gpu(dense)
    _C.cuda.scatter_add(da.data_ptr(), n, di.data_ptr(), dv.data_ptr(), m, 0.5, False, 0, _stream())
    assert np.allclose(_cpu(da, np.float32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bits,scale,block",
    [(8, "max", 256), (4, "max", 64), (2, "max", 256), (2, "l2", 128), (8, "l2", 512),
     (1, "mean_abs", 1024)],
)  # fmt: skip
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("feedback", [False, True])
def test_block_quantisation_gives_the_cpu_bits(bits, scale, block, stochastic, feedback):
    n = block * 37
    rng = np.random.default_rng(bits * block)
    x = rng.standard_normal(n).astype(np.float32) * np.linspace(0.01, 10, n, dtype=np.float32)
    x[block : 2 * block] = 0  # a zero block: scale 0, codes of zero
    r = (rng.standard_normal(n) * 0.1).astype(np.float32) if feedback else None
    codes, scales = np.empty(n * bits // 8, np.uint8), np.empty(n // block, np.float32)
    want_r = None if r is None else r.copy()
    _C.compress.quantize(x, codes, scales, bits, block, scale, stochastic, 12345, want_r)
    dx, dr = _gpu(x), None if r is None else _gpu(r)
    dc = torch.empty(codes.size, dtype=torch.uint8, device="cuda")
    ds = torch.empty(scales.size, dtype=torch.float32, device="cuda")
    _C.cuda.quantize(
        dx.data_ptr(), dc.data_ptr(), ds.data_ptr(), n, bits, block, scale, stochastic, 12345,
        0 if dr is None else dr.data_ptr(), _stream(),
    )  # fmt: skip
    assert np.array_equal(_cpu(ds, np.float32), scales)
    assert np.array_equal(_cpu(dc, np.uint8), codes)
    if feedback:
        assert np.array_equal(_cpu(dr, np.float32), want_r)
    out = rng.standard_normal(n).astype(np.float32)
    want = out.copy()
    _C.compress.dequantize(codes, scales, want, bits, block, scale, 0.5, True)
    do = _gpu(out)
    _C.cuda.dequantize(dc.data_ptr(), ds.data_ptr(), do.data_ptr(), n, bits, block, scale, 0.5,
                       True, _stream())  # fmt: skip
    assert np.array_equal(_cpu(do, np.float32), want)
