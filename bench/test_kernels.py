"""Micro-benchmarks of the engine's element-wise kernels, against memcpy.

Not part of the default test run (pytest only collects tests/). Run:

    python3 -m pytest bench/test_kernels.py --benchmark-columns=median,ops \
        --benchmark-group-by=group

Each benchmark reports GB/s in its ``extra_info`` (bytes touched per call /
median time) and the table groups every kernel with the memcpy of the same
bytes, so the ratio to the machine's copy bandwidth reads straight off it.
Kernels run at every SIMD level this CPU supports (portable, avx2, avx512).
"""

from __future__ import annotations

import numpy as np
import pytest

from clawcomm import _C

K = _C.kernels
N = 4 << 20  # elements: 16 MiB of float32, well past the caches
LEVELS = [
    lvl
    for lvl in ("portable", "avx2", "avx512")
    if ["portable", "avx2", "avx512"].index(lvl)
    <= ["portable", "avx2", "avx512"].index(K.best_simd_level())
]


def _report(benchmark, nbytes: int) -> None:
    median = benchmark.stats.stats.median
    benchmark.extra_info["GB/s"] = round(nbytes / median / 1e9, 2)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_memcpy(benchmark, dtype):
    src = np.ones(N, dtype)
    dst = np.zeros_like(src)
    benchmark.group = f"reduce {dtype}"
    benchmark(np.copyto, dst, src)
    _report(benchmark, src.nbytes)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reduce_sum(benchmark, level, dtype):
    np_dtype = np.uint16 if dtype == "bfloat16" else dtype
    dst = np.ones(N, np_dtype)
    src = np.ones(N, np_dtype)
    benchmark.group = f"reduce {'float16' if dtype != 'float32' else 'float32'}"
    kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    benchmark(K.reduce, dst, src, "sum", level, **kw)
    # Bytes of the output written (what a copy of the same data moves).
    _report(benchmark, dst.nbytes)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_to_float32(benchmark, level, dtype):
    src = np.ones(N, np.uint16)
    dst = np.zeros(N, np.float32)
    benchmark.group = "convert"
    benchmark(K.to_float32, src, dst, dtype, level)
    _report(benchmark, src.nbytes)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_from_float32(benchmark, level, dtype):
    src = np.ones(N, np.float32)
    dst = np.zeros(N, np.uint16)
    benchmark.group = "convert"
    benchmark(K.from_float32, src, dst, dtype, level)
    _report(benchmark, dst.nbytes)


def test_memcpy_convert(benchmark):
    src = np.ones(N, np.uint16)
    dst = np.zeros_like(src)
    benchmark.group = "convert"
    benchmark(np.copyto, dst, src)
    _report(benchmark, src.nbytes)
