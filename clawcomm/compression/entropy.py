"""Lossless coding on the wire (``+ec``): the same messages, in fewer bytes.

Sparse methods (``topk:0.01+ec``, threshold, dgc) send (index, value)
pairs; block quantisers (``int4+ec``, ``qsgd:4+ec``, int8, terngrad, sign)
send packed codes, whose levels carry fewer bits of information than their
width (most fall near the middle of the scale), coded by a static rANS coder
with a frequency table per message (``encode_bytes``, ``_C.compress.
encode_rans``, C++: within about 1% of the bytes' order-0 entropy, and below
a bit per byte where one byte value dominates, where a Huffman code such as
zlib's spends a whole bit). When a message is coded, and how messages of
different lengths travel, is ``coding.py``'s.

What a top-k message spends its bytes on, and what coding does with it:

* **Indices**, sorted: the gaps between them are close to geometric (about
  8.1 bits of entropy at 1% density), so a Golomb-Rice code with the
  parameter fitted to the message (``_C.compress.encode_rice``, C++) takes
  within 1-2% of that, against 32 bits raw.
* **Values**: the selected entries of a gradient have similar magnitudes,
  so the most significant byte of each (its sign and the top of its
  exponent) holds a few bits of information in 8. That byte plane goes
  through the rANS coder; the other planes, mostly mantissa bits that no
  lossless coder shrinks, travel raw. A plane whose code is not smaller
  travels raw as well.

A message: a 16-byte header (pairs, index bytes, top-plane bytes, value
width, flags), the Rice stream, the top plane, the other planes one after
another. Decoding gives back the exact pairs, bit for bit.
"""

from __future__ import annotations

import struct

import numpy as np

from clawcomm import _C

__all__ = [
    "decode_bytes",
    "decode_pairs",
    "encode_bytes",
    "encode_pairs",
    "entropy_bits",
    "top_plane",
]

_HEADER = struct.Struct("<IIIBBxx")  # pairs, index bytes, top-plane bytes, width, flags
_TOP_CODED = 1
_INDICES_RAW = 2  # int32 indices as they are: a message sent uncoded


def entropy_bits(symbols: np.ndarray) -> float:
    """The empirical (order-0) entropy of ``symbols``, in bits for all of
    them: the floor of any code that codes them one at a time."""
    if symbols.size == 0:
        return 0.0
    _, counts = np.unique(symbols, return_counts=True)
    p = counts / symbols.size
    return float(-(counts * np.log2(p)).sum())


def _code(plane: np.ndarray) -> bytes:
    return _C.compress.encode_rans(np.ascontiguousarray(plane, np.uint8))


def _decode(data: np.ndarray, size: int, what: str) -> np.ndarray:
    try:
        return _C.compress.decode_rans(np.ascontiguousarray(data, np.uint8), size)
    except ValueError as e:
        raise ValueError(f"{what}: the coded bytes do not decode: {e}") from None


def encode_bytes(data: np.ndarray, code: bool = True) -> np.ndarray:
    """``data`` (uint8) coded: a tag byte, then its rANS code, or the
    bytes themselves where the code is not shorter (or ``code`` is off)."""
    raw = np.ascontiguousarray(data, np.uint8)
    coded = _code(raw) if raw.size and code else None
    if coded is not None and len(coded) < raw.size:
        return np.frombuffer(bytes([1]) + coded, np.uint8)
    return np.concatenate([np.zeros(1, np.uint8), raw])


def decode_bytes(message: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` bytes ``encode_bytes`` coded."""
    data = np.ascontiguousarray(message, np.uint8)
    if data.size == 0 or data[0] > 1:
        raise ValueError("decode_bytes: no tag byte, or an unknown one")
    if data[0] == 1:
        return _decode(data[1:], size, "decode_bytes")
    if data.size - 1 != size:
        raise ValueError(f"decode_bytes: {data.size - 1} bytes, not {size}")
    return data[1:]


# Per value width: the unsigned view, and the planes below the top byte
# (shift, type), least significant first.
_BYTE_PLANES = {
    2: (np.uint16, [(0, np.uint8)]),
    4: (np.uint32, [(0, np.uint16), (16, np.uint8)]),
}


def _byte_planes(width: int, what: str):
    try:
        return _BYTE_PLANES[width]
    except KeyError:
        raise ValueError(f"{what}: {width}-byte values; 2 or 4 bytes are coded") from None


def top_plane(values: np.ndarray) -> np.ndarray:
    """Each value's most significant byte (its sign and the top of its
    exponent): the plane ``encode_pairs`` codes."""
    width = values.dtype.itemsize
    unsigned, _ = _byte_planes(width, "top_plane")
    return (np.ascontiguousarray(values).view(unsigned) >> (8 * width - 8)).astype(np.uint8)


def encode_pairs(idx: np.ndarray, values: np.ndarray, code: bool = True) -> np.ndarray:
    """One message (uint8) for strictly ascending int32 ``idx`` and their
    ``values`` (2 or 4 bytes each: float32, float16, or bfloat16 as its
    uint16 bits); with ``code`` off, the same layout uncoded. Raises
    ValueError if the indices are not strictly ascending."""
    k = idx.size
    if values.size != k:
        raise ValueError(f"encode_pairs: {k} indices but {values.size} values")
    width = values.dtype.itemsize
    unsigned, lower = _byte_planes(width, "encode_pairs")
    idx = np.ascontiguousarray(idx, np.int32)
    if code:
        index_bytes = _C.compress.encode_rice(idx)
    else:
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("encode_pairs: the indices are not above the previous one")
        index_bytes = idx.tobytes()
    u = np.ascontiguousarray(values).view(unsigned)
    top = top_plane(values)
    coded = _code(top) if k and code else None
    flags = (_TOP_CODED if coded is not None and len(coded) < k else 0) | (
        0 if code else _INDICES_RAW
    )
    top_bytes = coded if flags & _TOP_CODED else top.tobytes()
    rest = b"".join((u >> shift).astype(t).tobytes() for shift, t in lower)
    header = _HEADER.pack(k, len(index_bytes), len(top_bytes), width, flags)
    return np.frombuffer(header + index_bytes + top_bytes + rest, np.uint8)


def decode_pairs(message: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The (indices, values) ``encode_pairs`` coded, values as ``dtype``.
    Raises ValueError on a message that is cut short or malformed."""
    data = np.ascontiguousarray(message, np.uint8)
    if data.size < _HEADER.size:
        raise ValueError(f"decode_pairs: {data.size} bytes, shorter than the header")
    k, index_bytes, top_bytes, width, flags = _HEADER.unpack_from(data)
    dtype = np.dtype(dtype)
    if width != dtype.itemsize:
        raise ValueError(f"decode_pairs: {width}-byte values in the message, {dtype} expected")
    unsigned, lower = _byte_planes(width, "decode_pairs")
    at = _HEADER.size
    need = at + index_bytes + top_bytes + k * (width - 1)
    if data.size < need:
        raise ValueError(f"decode_pairs: {data.size} bytes, the header says {need}")
    if flags & _INDICES_RAW:
        if index_bytes != 4 * k:
            raise ValueError(f"decode_pairs: {index_bytes} bytes of raw indices for {k}")
        idx = data[at : at + index_bytes].view(np.int32).copy()
    else:
        idx = _C.compress.decode_rice(data[at : at + index_bytes].tobytes(), k)
    at += index_bytes
    top = data[at : at + top_bytes]
    if flags & _TOP_CODED:
        top = _decode(top, k, "decode_pairs: the value plane")
    if top.size != k:
        raise ValueError(f"decode_pairs: the value plane has {top.size} bytes, not {k}")
    at += top_bytes
    u = top.astype(unsigned) << unsigned(8 * width - 8)
    for shift, t in lower:
        size = k * np.dtype(t).itemsize
        u |= data[at : at + size].view(t).astype(unsigned) << unsigned(shift)
        at += size
    return idx, u.view(dtype)
