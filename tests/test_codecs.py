"""The delta + varint index codec: the numba (Python) and C++ versions give
the same bytes, round-trip, and refuse bad input."""

from __future__ import annotations

import numpy as np
import pytest

from clawcomm import _C
from clawcomm.compression import codecs
from clawcomm.launch import run_ranks

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


# --- Golomb-Rice (compress/rice.h) ------------------------------------------


def _gap_entropy_bits(idx: np.ndarray) -> float:
    """The empirical entropy of the stream's gaps, in bits for all of them."""
    gaps = np.diff(idx.astype(np.int64), prepend=-1) - 1
    _, counts = np.unique(gaps, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


RICE_CASES = CASES + [
    np.arange(1000, dtype=np.int32),  # every gap 0: k = 0, one bit each
    np.array([0, 2**31 - 1], np.int32),  # an escaped gap
    np.array([7, 10_000_000, 10_000_001], np.int32),
    np.sort(np.random.default_rng(1).choice(10_000_000, 100_000, replace=False)).astype(np.int32),
]


@pytest.mark.parametrize("idx", RICE_CASES, ids=lambda a: f"{a.size}")
def test_rice_round_trips(idx):
    data = _C.compress.encode_rice(idx)
    np.testing.assert_array_equal(_C.compress.decode_rice(data, idx.size), idx)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.5])
def test_rice_codes_gaps_near_their_entropy(density):
    """Within 1.2x of the gaps' empirical entropy (the issue's bound); at 1%
    about 8.1 bits an index, where varints spend 10-11 and raw int32 32."""
    n = 4_000_000
    rng = np.random.default_rng(2)
    idx = np.sort(rng.choice(n, int(n * density), replace=False)).astype(np.int32)
    coded_bits = 8 * len(_C.compress.encode_rice(idx))
    assert coded_bits <= 1.2 * _gap_entropy_bits(idx) + 64
    assert len(_C.compress.encode_rice(idx)) < len(_C.compress.encode_indices(idx))
    if density == 0.01:
        assert coded_bits / idx.size < 8.5


def test_rice_refuses_bad_input():
    with pytest.raises(ValueError, match="index 3 at position 1 is not above"):
        _C.compress.encode_rice(np.array([5, 3], np.int32))
    with pytest.raises(ValueError, match="index 5 at position 1 is not above"):
        _C.compress.encode_rice(np.array([5, 5], np.int32))
    data = _C.compress.encode_rice(np.arange(0, 4000, 7, dtype=np.int32))
    with pytest.raises(ValueError, match="ends before its last index"):
        _C.compress.decode_rice(data[: len(data) // 2], 572)
    with pytest.raises(ValueError, match="parameter byte out of range"):
        _C.compress.decode_rice(b"\x40\x00", 1)
    with pytest.raises(ValueError, match="empty stream"):
        _C.compress.decode_rice(b"", 1)


def _rans_cases():
    rng = np.random.default_rng(5)
    normal = np.clip(np.rint(rng.standard_normal(200_000) * 20), -127, 127).astype(np.int8)
    return {
        "empty": np.zeros(0, np.uint8),
        "one": np.array([7], np.uint8),
        "odd": rng.integers(0, 256, 4099, dtype=np.uint8),  # not a multiple of the states
        "constant": np.full(10_000, 3, np.uint8),  # one value: no words at all
        "few-values": rng.integers(0, 5, 3001, dtype=np.uint8),  # a listed table
        "every-value": np.arange(256, dtype=np.uint8),  # a bitmap, each value once
        "skewed": (rng.random(100_000) < 0.02).astype(np.uint8) * 200,
        "normal": normal.view(np.uint8),
    }


@pytest.mark.parametrize("case", list(_rans_cases()))
def test_rans_round_trips(case):
    data = _rans_cases()[case]
    coded = np.frombuffer(_C.compress.encode_rans(data), np.uint8)
    np.testing.assert_array_equal(_C.compress.decode_rans(coded, data.size), data)


@pytest.mark.parametrize("case", ["skewed", "normal", "few-values"])
def test_rans_codes_within_one_percent_of_the_entropy_and_below_zlibs_huffman(case):
    """Against the bytes' order-0 entropy, and against a well-kept coder
    (zlib's Huffman, Z_HUFFMAN_ONLY): never larger, and where one value
    dominates far smaller (a Huffman code spends at least a bit a byte)."""
    import zlib

    data = _rans_cases()[case]
    _, counts = np.unique(data, return_counts=True)
    entropy = float(-(counts * np.log2(counts / data.size)).sum())
    coded = 8 * len(_C.compress.encode_rans(data))
    assert coded <= 1.01 * entropy + 8 * 600, (coded, entropy)
    z = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    huffman = 8 * len(z.compress(data.tobytes()) + z.flush())
    assert coded <= huffman
    if case == "skewed":  # 0.14 bits a byte of information
        assert coded < 0.25 * huffman


def test_rans_refuses_damaged_streams():
    data = _rans_cases()["normal"]
    coded = np.frombuffer(_C.compress.encode_rans(data), np.uint8)
    with pytest.raises(ValueError, match="holds 200000 bytes, not 200001"):
        _C.compress.decode_rans(coded, data.size + 1)
    with pytest.raises(ValueError, match="bytes left after"):
        _C.compress.decode_rans(np.concatenate([coded, np.zeros(4, np.uint8)]), data.size)
    with pytest.raises(ValueError, match="ends"):
        _C.compress.decode_rans(coded[:-4], data.size)
    with pytest.raises(ValueError, match="ends in its table"):
        _C.compress.decode_rans(coded[:5], data.size)
    with pytest.raises(ValueError, match="bytes for an empty output"):
        _C.compress.decode_rans(coded, 0)
    # A flipped bit anywhere: an error or other bytes, never a crash; the
    # final states catch nearly all of them.
    rng = np.random.default_rng(0)
    errors = 0
    for _ in range(300):
        damaged = coded.copy()
        damaged[rng.integers(damaged.size)] ^= np.uint8(1 << rng.integers(8))
        try:
            _C.compress.decode_rans(damaged, data.size)
        except ValueError:
            errors += 1
    assert errors >= 290


def _decode_rans(rank, world, coded, n):
    return _C.kernels.simd_level(), _C.compress.decode_rans(coded, n)


def test_rans_decodes_the_same_bytes_with_and_without_avx2():
    """The vector decoder (AVX2: 16 states as two vectors of 8) and the
    symbol-by-symbol one (CLAWCOMM_SIMD=portable) on every case above."""
    for case, data in _rans_cases().items():
        coded = np.frombuffer(_C.compress.encode_rans(data), np.uint8)
        [(level, got)] = run_ranks(
            _decode_rans, 1, coded, data.size, env={"CLAWCOMM_SIMD": "portable"}, init=False
        )
        assert level == "portable"
        np.testing.assert_array_equal(got, data, err_msg=case)
        np.testing.assert_array_equal(_C.compress.decode_rans(coded, data.size), data)
