"""The delta + varint index codec: the numba (Python) and C++ versions give
the same bytes, round-trip, and refuse bad input."""

from __future__ import annotations

import numpy as np
import pytest

from clawcomm import _C
from clawcomm.compression import codecs

CASES = [
    np.array([], np.int32),
    np.array([0], np.int32),
    np.array([5, 127, 128, 16383, 16384, 2**31 - 1], np.int32),
    np.sort(np.random.default_rng(0).choice(1 << 24, 10_000, replace=False)).astype(np.int32),
]


@pytest.mark.parametrize("idx", CASES, ids=["empty", "zero", "edges", "sparse"])
def test_numba_and_cpp_agree_and_round_trip(idx):
    py_bytes = codecs.encode_indices(idx)
    cpp_bytes = _C.compress.encode_indices(idx)
    assert py_bytes == cpp_bytes
    np.testing.assert_array_equal(codecs.decode_indices(cpp_bytes, idx.size), idx)
    np.testing.assert_array_equal(_C.compress.decode_indices(py_bytes, idx.size), idx)


def test_sparse_indices_shrink():
    idx = CASES[3]  # about 1 in 1700: gaps need two bytes
    assert len(codecs.encode_indices(idx)) < 0.6 * idx.nbytes


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="index 3 at position 1 is not ascending"):
        codecs.encode_indices(np.array([5, 3], np.int32))
    with pytest.raises(ValueError, match="index 3 at position 1 is not above"):
        _C.compress.encode_indices(np.array([5, 3], np.int32))
    with pytest.raises(ValueError, match="ends or overflows at index 1"):
        codecs.decode_indices(b"\x05", 2)
    with pytest.raises(ValueError, match="stream ends or overflows at index 1"):
        _C.compress.decode_indices(b"\x05", 2)
