"""Sparse all-reduce: every rank contributes (index, value) pairs, every rank
gets the dense sum. Two forms:

* ``gather``: all-gather every rank's k pairs, then scatter-add them all.
  One collective; each rank receives (p-1) k pairs: O(k p).
* ``reduce_scatter``: each rank sends the pairs that fall in rank q's slice of
  the index space to rank q (all-to-all), q sums them into its slice, and
  the slices' non-zero entries are all-gathered. Each rank sends about k
  pairs and receives about k, plus the union of non-zeros it gathers: O(k)
  per rank when the ranks' choices overlap, at the price of four more
  (small) collectives.

``auto`` takes ``gather`` up to 4 ranks and ``reduce_scatter`` beyond, where
the (p-1) k term dominates. Indices travel as uint16 when the tensor has at
most 65536 elements, else int32; values as float32, float16 or bfloat16.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from clawcomm import _C
from clawcomm._torch_names import all_gather_single

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int16 if numel <= 1 << 16 else torch.int32  # int16 holds uint16 bits


def _pack(idx: torch.Tensor, val: torch.Tensor, numel: int, values: str) -> torch.Tensor:
    """One byte buffer: indices, then values."""
    itype = _index_dtype(numel)
    i = idx.to(torch.int32)
    if itype == torch.int16:  # store 0..65535 as the int16 with the same bits
        i = torch.where(i >= 1 << 15, i - (1 << 16), i)
    v = val.to(VALUE_DTYPES[values])
    # Each section starts 8-byte aligned, so the receiver can view it in place.
    ib, vb = _section_bytes(idx.numel(), numel, values)
    out = torch.zeros(ib + vb, dtype=torch.uint8)
    out[: i.numel() * i.to(itype).element_size()] = i.to(itype).view(torch.uint8)
    out[ib : ib + v.numel() * v.element_size()] = v.view(torch.uint8)
    return out


def _section_bytes(k: int, numel: int, values: str) -> tuple[int, int]:
    isz = torch.tensor([], dtype=_index_dtype(numel)).element_size()
    vsz = torch.tensor([], dtype=VALUE_DTYPES[values]).element_size()
    return -(-k * isz // 8) * 8, -(-k * vsz // 8) * 8


def _unpack(buf: torch.Tensor, k: int, numel: int, values: str):
    itype = _index_dtype(numel)
    ib, _ = _section_bytes(k, numel, values)
    idx = buf[:ib].view(itype)[:k].to(torch.int32)
    if itype == torch.int16:
        idx = idx & 0xFFFF
    val = buf[ib:].view(VALUE_DTYPES[values])[:k].to(torch.float32)
    return idx, val


def _scatter_add(out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, scale=1.0) -> None:
    _C.compress.scatter_add(
        out.numpy(), idx.numpy().astype(np.int32, copy=False), val.numpy(), scale
    )


def sparse_all_reduce(
    idx: torch.Tensor,
    val: torch.Tensor,
    out: torch.Tensor,
    group=None,
    values: str = "fp32",
    form: str = "auto",
    *,
    scale: float = 1.0,
    out_zeroed: bool = False,
    coded: str = "",
) -> None:
    """``out`` (float32) becomes ``scale`` times the sum over the group of
    every rank's sparse tensor (idx, val); ``scale=1/world_size`` gives the
    mean at no extra pass. Ranks may pass different numbers of pairs.
    ``out`` is zeroed first, unless the caller says it already holds zeros
    (``out_zeroed``: a 64 MiB memset costs more than the rest of the call).
    ``coded`` (``auto`` or ``always``, coding.py): the gathered pairs travel
    coded losslessly where it pays, or always (CPU tensors): the same sum bit
    for bit in fewer bytes."""
    if form not in ("auto", "gather", "reduce_scatter"):
        raise ValueError(f"sparse_all_reduce: form {form!r} is not auto, gather or reduce_scatter")
    if values not in VALUE_DTYPES:
        raise ValueError(f"sparse_all_reduce: values {values!r} is not one of fp32, fp16, bf16")
    n = dist.get_world_size(group)
    if form == "auto":
        form = "gather" if n <= 4 else "reduce_scatter"
    if not out_zeroed:
        out.zero_()
    if form == "gather":
        _gather_form(idx, val, out, group, values, n, scale, coded)
    else:
        _reduce_scatter_form(idx, val, out, group, values, n, scale, coded)


def wire(k: int, numel: int, n: int, values: str = "fp32", form: str = "auto",
         sharded: bool = False) -> tuple[tuple[str, float], ...]:  # fmt: skip
    """What ``sparse_all_reduce`` (``sharded``: ``sparse_reduce_scatter``)
    of ``k`` pairs a rank over ``n`` ranks sends, as (collective, bytes per
    rank) pairs: the counts, then the pairs. Beyond the gather form, each
    summed slice's non-zeros are counted as if no two ranks' pairs were
    alike and they fell evenly over the slices: k a slice (at most its
    ``numel / n`` entries), all-gathered padded to the largest count."""
    value = VALUE_DTYPES[values].itemsize
    counts = 8.0 * n  # one int64 a rank
    scatter = (("all_to_all", counts), ("all_to_all", 4.0 * k), ("all_to_all", float(k * value)))
    if sharded:
        return scatter
    if form == "auto":
        form = "gather" if n <= 4 else "reduce_scatter"

    def gathered(pairs: int) -> tuple[tuple[str, float], ...]:
        packed = sum(_section_bytes(pairs, numel, values))  # a rank's indices and values
        return ("all_gather", counts), ("all_gather", float(n * packed))

    if form == "gather":
        return gathered(k)
    return scatter + gathered(min(k, -(-numel // n)))


def _all_counts(count: int, group, n: int) -> list[int]:
    counts = torch.zeros(n, dtype=torch.int64)
    all_gather_single(counts, torch.tensor([count], dtype=torch.int64), group=group)
    return counts.tolist()


def _gather_form(idx, val, out, group, values, n, scale, coded=""):
    if coded:
        _coded_gather_form(idx, val, out, group, values, n, scale, coded)
        return
    numel = out.numel()
    k = max(_all_counts(idx.numel(), group, n))
    if k == 0:
        return
    # Pad to the largest k with (index 0, value 0): adding zero changes nothing.
    pad = k - idx.numel()
    idx = torch.cat([idx.to(torch.int32), torch.zeros(pad, dtype=torch.int32)])
    val = torch.cat([val, torch.zeros(pad, dtype=val.dtype)])
    mine = _pack(idx, val, numel, values)
    gathered = torch.empty(n * mine.numel(), dtype=torch.uint8)
    all_gather_single(gathered, mine, group=group)
    for r in range(n):
        i, v = _unpack(gathered[r * mine.numel() : (r + 1) * mine.numel()], k, numel, values)
        _scatter_add(out, i, v, scale)


def sparse_reduce_scatter(
    idx: torch.Tensor,
    val: torch.Tensor,
    out: torch.Tensor,
    numel: int,
    group=None,
    values: str = "fp32",
    *,
    scale: float = 1.0,
    coded: str = "",
) -> None:
    """Adds to ``out`` (float32: this rank's slice of an index space of
    ``numel``, rank q's being [numel q / n, numel (q + 1) / n)) ``scale``
    times every rank's pairs (idx, val) that fall in it: each rank sends
    each other rank the pairs of its slice (one all-to-all of counts, one of
    indices, one of values in the wire type ``values``; ``coded``: each
    slice's pairs as one coded message, coding.py). Ranks may pass
    different numbers of pairs."""
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    bounds = [numel * q // n for q in range(n + 1)]
    order = torch.argsort(idx)
    idx, val = idx[order].to(torch.int32), val[order]
    cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=torch.int32, device=idx.device))
    if coded:
        _coded_reduce_scatter(idx, val, cuts.tolist(), bounds, out, group, values, scale, coded)
        return
    send = [int(cuts[q + 1] - cuts[q]) for q in range(n)]
    recv_t = torch.empty(n, dtype=torch.int64, device=idx.device)
    dist.all_to_all_single(
        recv_t, torch.tensor(send, dtype=torch.int64, device=idx.device), group=group
    )
    recv = recv_t.tolist()
    got_idx = idx.new_empty(sum(recv))
    dist.all_to_all_single(got_idx, idx, recv, send, group=group)
    wire = VALUE_DTYPES[values]
    got_val = val.new_empty(sum(recv), dtype=wire)
    dist.all_to_all_single(got_val, val.to(wire), recv, send, group=group)
    local = got_idx - bounds[rank]
    if out.is_cuda:
        out.index_add_(0, local.long(), got_val.to(torch.float32), alpha=scale)
    else:
        _scatter_add(out, local, got_val.to(torch.float32), scale)


def _reduce_scatter_form(idx, val, out, group, values, n, scale, coded=""):
    numel = out.numel()
    rank = dist.get_rank(group)
    lo, hi = numel * rank // n, numel * (rank + 1) // n
    # Pairs to the rank that owns their slice, summed there; the slices'
    # non-zeros are the result, all-gathered (padded to the largest).
    piece = torch.zeros(hi - lo, dtype=torch.float32)
    sparse_reduce_scatter(idx, val, piece, numel, group, values)
    nz = torch.nonzero(piece).flatten().to(torch.int32)
    _gather_form(nz + lo, piece[nz.long()], out, group, values, n, scale, coded)


def _coded_gather_form(idx, val, out, group, values, n, scale, mode):
    """The gather form with each rank's pairs sorted by index, coded where
    ``mode`` says (coding.py)."""
    from clawcomm.compression.coding import gather_pairs

    idx, val = _summed_pairs(idx, val)
    for i, v in gather_pairs(idx.numpy(), _wire_numpy(val, values), out.numel(), group, mode):
        _scatter_add(out, torch.from_numpy(i), _from_wire(v, values), scale)


def _summed_pairs(idx, val):
    """The pairs sorted by index, those with one index summed (what the
    scatter-add would do): strictly ascending, as the coder needs."""
    idx, order = torch.sort(idx.to(torch.int32))
    val = val[order]
    if idx.numel() > 1 and bool((idx[1:] == idx[:-1]).any()):
        idx, inverse = torch.unique_consecutive(idx, return_inverse=True)
        val = torch.zeros(idx.numel(), dtype=val.dtype).index_add_(0, inverse, val)
    return idx, val


def _wire_numpy(val, values):
    wire = val.to(VALUE_DTYPES[values])
    return (wire.view(torch.int16) if values == "bf16" else wire).numpy()


def _from_wire(v, values):
    v = torch.from_numpy(v)
    return (v.view(torch.bfloat16) if values == "bf16" else v).to(torch.float32)


def _coded_reduce_scatter(idx, val, cuts, bounds, out, group, values, scale, mode):
    """sparse_reduce_scatter with each slice's pairs (indices relative to
    the slice) one coded message to its owner."""
    from clawcomm.compression.coding import exchange_pairs

    n = len(bounds) - 1
    idx, val = _summed_pairs(idx[cuts[0] : cuts[-1]], val[cuts[0] : cuts[-1]])
    cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=torch.int32)).tolist()
    parts = [
        (
            (idx[cuts[q] : cuts[q + 1]] - bounds[q]).numpy(),
            _wire_numpy(val[cuts[q] : cuts[q + 1]], values),
        )
        for q in range(n)
    ]
    sizes = [bounds[q + 1] - bounds[q] for q in range(n)]
    for i, v in exchange_pairs(parts, sizes, group, mode):
        _scatter_add(out, torch.from_numpy(i), _from_wire(v, values), scale)
