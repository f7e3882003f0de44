"""The index codec in numba (clawcomm.compression.codecs) against the same
codec in C++ (clawcomm._C.compress), on the indices of a 1% top-k of 16M
values. Outside the default run:

    python3 -m pytest bench/test_codecs.py --benchmark-columns=median,ops --benchmark-group-by=group
"""

from __future__ import annotations

import numpy as np
import pytest

from clawcomm import _C
from clawcomm.compression import codecs

IDX = np.sort(np.random.default_rng(0).choice(1 << 24, 1 << 17, replace=False)).astype(np.int32)
DATA = _C.compress.encode_indices(IDX)


@pytest.mark.parametrize("impl", ["numba", "cpp"])
def test_encode(benchmark, impl):
    benchmark.group = "encode 131072 indices"
    fn = codecs.encode_indices if impl == "numba" else _C.compress.encode_indices
    fn(IDX)  # compile
    out = benchmark(fn, IDX)
    benchmark.extra_info["bytes"] = len(out)
    benchmark.extra_info["vs int32"] = round(len(out) / IDX.nbytes, 3)


@pytest.mark.parametrize("impl", ["numba", "cpp"])
def test_decode(benchmark, impl):
    benchmark.group = "decode 131072 indices"
    fn = codecs.decode_indices if impl == "numba" else _C.compress.decode_indices
    fn(DATA, IDX.size)
    benchmark(fn, DATA, IDX.size)
