"""Codecs written in Python and JIT-compiled with numba: the extension point
for element-by-element coding that numpy cannot vectorise.

``encode_indices`` / ``decode_indices`` code ascending int32 indices as
deltas in LEB128 varints (one byte per gap below 128, two below 16384), the
same format as the engine's C++ codec (``clawcomm._C.compress``), so either
side can decode the other's bytes. ``bench/test_codecs.py`` times the two.

Write your own the same way: a ``@numba.njit`` function over numpy arrays,
called from your compressor's ``all_reduce`` (docs/compression.md). Without
numba installed the functions run as plain Python (slowly, but correctly).
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is an optional speed-up

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


@njit(cache=True)
def _encode(idx, out):
    n = 0
    prev = 0
    for i in range(idx.shape[0]):
        v = idx[i]
        if v < prev or (i > 0 and v == prev):
            return -1 - i
        gap = v - prev
        prev = v
        while gap >= 0x80:
            out[n] = (gap & 0x7F) | 0x80
            n += 1
            gap >>= 7
        out[n] = gap
        n += 1
    return n


@njit(cache=True)
def _decode(data, out):
    p = 0
    value = 0
    for i in range(out.shape[0]):
        gap = 0
        shift = 0
        while True:
            if p >= data.shape[0] or shift >= 35:
                return -1 - i
            b = data[p]
            p += 1
            gap |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        value += gap
        out[i] = value
    return p


def encode_indices(idx: np.ndarray) -> bytes:
    """Delta + varint bytes of ascending, non-negative int32 indices."""
    idx = np.ascontiguousarray(idx, dtype=np.int32)
    out = np.empty(idx.size * 5, np.uint8)
    n = _encode(idx.astype(np.int64), out)
    if n < 0:
        i = -1 - n
        raise ValueError(f"encode_indices: index {idx[i]} at position {i} is not ascending")
    return out[:n].tobytes()


def decode_indices(data: bytes, count: int) -> np.ndarray:
    out = np.empty(count, np.int64)
    n = _decode(np.frombuffer(data, np.uint8), out)
    if n < 0:
        raise ValueError(f"decode_indices: the stream ends or overflows at index {-1 - n}")
    return out.astype(np.int32)
