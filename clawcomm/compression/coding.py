"""When ``+ec`` codes a message, how coded messages travel, and what coding
did (``coding_stats``).

``+ec`` is entropy-aware: before coding a message its sender estimates the
coded size from the message's empirical entropy (the index gaps' from the
density, the values' top byte plane and the quantiser codes' from their
byte histograms, one pass each), and codes only where the wire time that
saves exceeds the time coding takes: the bytes saved times the message's
receivers times the seconds per byte of the slowest link it crosses (the
network's where a peer is over TCP, else shared memory's, from the cost
model: ``CLAWCOMM_COST_MODEL``, else the engine's defaults), against the
bytes times the encoding and decoding seconds per byte, measured on the
messages coded so far (from this machine's figures before the first).
On a 1 Gbit/s link that usually pays, inside shared memory it does not.
``+ec:always`` codes every message. Each message carries a tag or flag
saying whether it is coded, so ranks decide on their own.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single
from clawcomm.compression import entropy

__all__ = [
    "coding_stats",
    "exchange_codes",
    "exchange_pairs",
    "gather_codes",
    "gather_pairs",
    "reset_coding_stats",
]

MODES = ("auto", "always")

# Seconds per raw byte to encode and to decode, per kind of message; the
# starting figures were measured on the 2-core reference machine
# (bench/coding_speed.py: pairs 810 and 975 MB/s, quantiser codes 240 and
# 700), then each coded message moves them a fifth of the way to what it
# took.
_SPEED = {"pairs": [1 / 810e6, 1 / 975e6], "codes": [1 / 240e6, 1 / 700e6]}

_STATS = dict.fromkeys(("messages", "coded", "elements", "raw_bytes", "sent_bytes"), 0)
_STATS["coding_s"] = 0.0
_LINKS: dict = {}  # group -> seconds per byte of its slowest link


def coding_stats() -> dict:
    """What ``+ec`` did in this process so far: messages sent and coded,
    elements, bytes before and after, seconds spent coding, and the bits
    per element on the wire."""
    out = dict(_STATS)
    out["bits_per_element"] = 8 * out["sent_bytes"] / out["elements"] if out["elements"] else 0.0
    return out


def reset_coding_stats() -> None:
    for key in _STATS:
        _STATS[key] = 0.0 if key == "coding_s" else 0


def _link_seconds_per_byte(group) -> float:
    key = group if group is not None else dist.group.WORLD
    if key not in _LINKS:
        from clawcomm import backend_of
        from clawcomm.cost_model import CostModel

        path = os.environ.get("CLAWCOMM_COST_MODEL")
        model = CostModel.load(path) if path else CostModel()
        backend = backend_of(group)
        network = any(backend.transport_of(p) == "tcp" for p in range(dist.get_world_size(group)))
        _LINKS[key] = model.net_beta if network else model.shm_beta
    return _LINKS[key]


def _pays(kind: str, raw: float, predicted: float, receivers: int, group) -> bool:
    encode, decode = _SPEED[kind]
    saved = (raw - predicted) * receivers * _link_seconds_per_byte(group)
    return saved > raw * (encode + receivers * decode)


def _histogram_bits(data: np.ndarray) -> float:
    counts = np.bincount(data, minlength=256)
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / data.size)).sum()) if data.size else 0.0


def _gap_bits(k: int, numel: int) -> float:
    """A Rice-coded gap's bits where k of numel positions are taken at
    random: the geometric distribution's entropy."""
    p = min(max(k / max(numel, 1), 1e-12), 1 - 1e-12)
    return (-(1 - p) * math.log2(1 - p) - p * math.log2(p)) / p


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    took = time.perf_counter() - start
    _STATS["coding_s"] += took
    return out, took


def _count(elements: int, raw: int, sent: int, coded: bool) -> None:
    _STATS["messages"] += 1
    _STATS["coded"] += int(coded)
    _STATS["elements"] += elements
    _STATS["raw_bytes"] += raw
    _STATS["sent_bytes"] += sent


def _learn(kind: str, which: int, raw: int, seconds: float) -> None:
    if raw >= 4096:  # a small message's time is mostly the call's
        _SPEED[kind][which] = 0.8 * _SPEED[kind][which] + 0.2 * seconds / raw


def gather_messages(message: np.ndarray, group) -> list[np.ndarray]:
    """Every rank's ``message`` (uint8, any length): the lengths are
    all-gathered, then the messages, padded to the longest."""
    n = dist.get_world_size(group)
    sizes = torch.zeros(n, dtype=torch.int64)
    all_gather_single(sizes, torch.tensor([message.size], dtype=torch.int64), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: message.size] = torch.from_numpy(np.array(message, np.uint8))  # a writable copy
    gathered = torch.empty(n * longest, dtype=torch.uint8)
    all_gather_single(gathered, padded, group=group)
    flat = gathered.numpy()
    return [flat[r * longest : r * longest + int(sizes[r])] for r in range(n)]


def exchange_messages(parts: list[np.ndarray], group) -> list[np.ndarray]:
    """``parts[q]`` (uint8, any length) to rank q; returns the part each
    rank sent to this one: the lengths go first, in an all-to-all."""
    send = torch.tensor([p.size for p in parts], dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out = torch.empty(int(recv.sum()), dtype=torch.uint8)
    flat = torch.from_numpy(np.concatenate([np.ascontiguousarray(p, np.uint8) for p in parts]))
    dist.all_to_all_single(out, flat, recv.tolist(), send.tolist(), group=group)
    cuts = np.cumsum([0] + recv.tolist())
    got = out.numpy()
    return [got[cuts[q] : cuts[q + 1]] for q in range(len(parts))]


def _encode_pairs(idx: np.ndarray, values: np.ndarray, numel: int, receivers: int, group, mode):
    """One message of pairs, coded where ``mode`` says (``auto``: where it
    pays), counted."""
    k = idx.size
    raw = k * (4 + values.dtype.itemsize)
    code = mode == "always"
    if mode == "auto" and k:
        predicted = (k * _gap_bits(k, numel) + _histogram_bits(entropy.top_plane(values))) / 8
        predicted += k * (values.dtype.itemsize - 1)
        code = _pays("pairs", raw, predicted, receivers, group)
    message, took = _timed(lambda: entropy.encode_pairs(idx, values, code))
    if code:
        _learn("pairs", 0, raw, took)
    _count(k, raw, message.size, code)
    return message, code


def _decode_pairs(messages: list[np.ndarray], dtype, learn: bool) -> list:
    out = []
    for m in messages:
        pair, took = _timed(lambda m=m: entropy.decode_pairs(m, dtype))
        if learn:
            _learn("pairs", 1, pair[0].size * (4 + np.dtype(dtype).itemsize), took)
        out.append(pair)
    return out


def gather_pairs(idx: np.ndarray, values: np.ndarray, numel: int, group, mode: str):
    """Every rank's (indices, values): strictly ascending int32 ``idx`` of
    a tensor of ``numel`` and ``values`` in their wire type (bfloat16 as
    int16 bits), coded where ``mode`` says."""
    receivers = dist.get_world_size(group) - 1
    message, code = _encode_pairs(idx, values, numel, receivers, group, mode)
    return _decode_pairs(gather_messages(message, group), values.dtype, code)


def exchange_pairs(parts: list, sizes: list[int], group, mode: str):
    """``parts[q]``, (indices, values) in rank q's slice of ``sizes[q]``
    positions, to rank q; returns the pairs every rank sent to this one,
    coded where ``mode`` says."""
    messages, coded = [], False
    for (idx, values), size in zip(parts, sizes, strict=True):
        message, code = _encode_pairs(idx, values, size, 1, group, mode)
        messages.append(message)
        coded |= code
    return _decode_pairs(exchange_messages(messages, group), parts[0][1].dtype, coded)


def _code_codes(data: np.ndarray, receivers: int, group, mode: str) -> bool:
    if mode == "always":
        return True
    return data.size > 0 and _pays("codes", data.size, _histogram_bits(data) / 8, receivers, group)


def gather_codes(codes: np.ndarray, elements: int, group, mode: str) -> np.ndarray:
    """Every rank's quantiser ``codes`` (uint8, as many on every rank, for
    ``elements`` values), one after another, coded where ``mode`` says."""
    code = _code_codes(codes, dist.get_world_size(group) - 1, group, mode)
    message, took = _timed(lambda: entropy.encode_bytes(codes, code))
    if code:
        _learn("codes", 0, codes.size, took)
    _count(elements, codes.size, message.size, code)
    received = gather_messages(message, group)  # (the wait is not coding time)
    got, took = _timed(lambda: [entropy.decode_bytes(m, codes.size) for m in received])
    if code:
        _learn("codes", 1, codes.size * len(got), took)
    return np.concatenate(got)


def exchange_codes(rows: np.ndarray, elements: int, group, mode: str) -> np.ndarray:
    """Row q of ``rows`` (uint8, one per rank, ``elements`` values in all)
    to rank q; returns the rows every rank sent to this one, in rank order,
    coded where ``mode`` says."""
    code = _code_codes(rows.reshape(-1), 1, group, mode)
    messages, took = _timed(lambda: [entropy.encode_bytes(r, code) for r in rows])
    if code:
        _learn("codes", 0, rows.size, took)
    _count(elements, rows.size, sum(m.size for m in messages), code)
    width = rows.shape[1]
    received = exchange_messages(messages, group)  # (the wait is not coding time)
    got, took = _timed(lambda: [entropy.decode_bytes(m, width) for m in received])
    if code:
        _learn("codes", 1, rows.size, took)
    return np.concatenate(got)
