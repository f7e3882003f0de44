"""The lossless coding stage (``+ec``, clawcomm/compression/entropy.py and
coding.py): messages round-trip bit for bit, a top-k message at 1% takes at
most 60% of its raw bytes, a coded all-reduce gives the uncoded one's result
bit for bit in fewer bytes on the wire, ``+ec`` codes where the link makes
it pay and not in shared memory, and bad messages and specs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import clawcomm
import clawcomm.cost_model
from clawcomm.compression import CompressorState, compressed_all_reduce, get_compressor
from clawcomm.compression.entropy import (
    decode_bytes,
    decode_pairs,
    encode_bytes,
    encode_pairs,
    entropy_bits,
)
from clawcomm.launch import run_ranks


def _top(n: int, density: float, seed: int = 0):
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    k = max(1, int(n * density))
    idx = np.sort(np.argpartition(np.abs(g), -k)[-k:]).astype(np.int32)
    return idx, g[idx]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("k", [0, 1, 7, 5000])
def test_pairs_round_trip_bit_for_bit(dtype, k):
    rng = np.random.default_rng(k)
    idx = np.sort(rng.choice(1 << 20, k, replace=False)).astype(np.int32)
    # Random bits as values: NaNs, infinities and denormals come back too,
    # and the top plane, incompressible here, travels raw.
    values = rng.integers(0, 256, k * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    for code in (True, False):  # coded, and sent as it is
        got_idx, got = decode_pairs(encode_pairs(idx, values, code), dtype)
        np.testing.assert_array_equal(got_idx, idx)
        np.testing.assert_array_equal(got.view(np.uint8), values.view(np.uint8))
    plain = encode_bytes(values.view(np.uint8), code=False)
    assert plain[0] == 0 and plain.size == values.nbytes + 1
    np.testing.assert_array_equal(decode_bytes(plain, values.nbytes), values.view(np.uint8))


def test_a_top_k_message_at_one_percent_takes_at_most_60_percent():
    """Against today's bytes (float32 values and int32 indices): the indices
    within 1.2x of their gaps' entropy, and the top value plane coded."""
    idx, val = _top(2_000_000, 0.01)
    message = encode_pairs(idx, val)
    raw = idx.nbytes + val.nbytes
    assert message.size <= 0.6 * raw, message.size / raw
    gaps = np.diff(idx.astype(np.int64), prepend=-1) - 1
    rice_bytes = int(np.frombuffer(message[4:8].tobytes(), np.uint32)[0])
    assert 8 * rice_bytes <= 1.2 * entropy_bits(gaps) + 64
    half = encode_pairs(idx, val.astype(np.float16))  # fp16 values: smaller still
    assert half.size <= 0.5 * (idx.nbytes + 2 * idx.size)


def _levels(codes: np.ndarray, bits: int) -> np.ndarray:
    shifts = range(0, 8, bits)
    return np.stack([(codes >> s) & ((1 << bits) - 1) for s in shifts], 1).ravel()


@pytest.mark.parametrize("spec", ["int8", "int4", "qsgd:4", "qsgd:2", "terngrad"])
def test_quantised_levels_are_coded_within_5_percent_of_their_entropy(spec):
    codec = get_compressor(spec).codec
    codes, _ = codec.encode(torch.from_numpy(np.random.default_rng(3).standard_normal(1 << 20))
                            .float(), seed=1)  # fmt: skip
    codes = codes.numpy()
    message = encode_bytes(codes)
    np.testing.assert_array_equal(decode_bytes(message, codes.size), codes)
    assert 8 * message.size <= 1.05 * entropy_bits(_levels(codes, codec.bits)) + 64


def test_bad_messages_are_refused():
    idx, val = _top(100_000, 0.01)
    message = encode_pairs(idx, val)
    with pytest.raises(ValueError, match="shorter than the header"):
        decode_pairs(message[:10], np.float32)
    with pytest.raises(ValueError, match="the header says"):
        decode_pairs(message[:-1], np.float32)
    with pytest.raises(ValueError, match="4-byte values in the message, float16 expected"):
        decode_pairs(message, np.float16)
    with pytest.raises(ValueError, match="not above the previous one"):
        encode_pairs(np.array([3, 3], np.int32), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="8-byte values; 2 or 4 bytes are coded"):
        encode_pairs(np.array([3], np.int32), np.zeros(1, np.float64))
    coded = encode_bytes(np.zeros(1000, np.uint8))
    assert coded[0] == 1  # rANS
    with pytest.raises(ValueError, match="do not decode: .*holds 1000 bytes, not 1001"):
        decode_bytes(coded, 1001)
    with pytest.raises(ValueError, match="do not decode"):
        decode_bytes(np.frombuffer(b"\x01\xff\xff\xff", np.uint8), 10)
    with pytest.raises(ValueError, match="999 bytes, not 1000"):
        decode_bytes(encode_bytes(np.zeros(999, np.uint8), code=False), 1000)
    with pytest.raises(ValueError, match="unknown one"):
        decode_bytes(np.frombuffer(b"\x07", np.uint8), 0)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("fp16+ec", "fp16 has no coded wire"),
        ("powersgd:2+ec", "has no coded wire"),
        ("randomk:0.01+ec", "has no coded wire"),
        ("topk:0.01+ec+fp16", r"may come '\+fp16' or '\+bf16', then '\+ec'"),
        ("topk:0.01+ec+ec", "then '\\+ec'"),
        ("topk:0.01+ec:sometimes", "or '\\+ec:always'"),
    ],
)
def test_bad_coded_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        get_compressor(spec)


def test_coded_specs_round_trip():
    for spec in ["topk:0.01+ec", "topk:0.01+fp16+ec:always", "dgc:0.01+ec", "int4+ec:always"]:
        assert get_compressor(spec).spec == spec
    assert get_compressor("qsgd:4+ec:auto").spec == "qsgd:4+ec"


# Each spec, and the most its coded all-reduce may send against the plain
# one (a sign bit is a fair coin: raw, plus the lengths sent first).
SPECS = {
    "topk:0.01": 0.8,
    "topk:0.02+fp16": 0.8,
    "topk:0.02+bf16": 0.8,
    "threshold:1.5": 0.8,
    "dgc:0.01": 0.8,
    "int4": 0.95,
    "qsgd:4": 0.6,
    "terngrad": 0.8,
    "int8": 1.0,
    "sign": 1.05,
}


def _steps(name, steps, seed, rank, numel, reduce):
    """``steps`` calls of ``reduce(compressor, gradient, state)`` (which
    returns the result) from a fresh state: the results, the residual left
    for key 0, and the bytes this rank sent."""
    c, state = get_compressor(name), CompressorState()
    before = clawcomm.comm_stats()
    results = []
    for step in range(steps):
        g = torch.from_numpy(np.random.default_rng(seed * step + rank).standard_normal(numel))
        results.append(reduce(c, g.float(), state))
    after = clawcomm.comm_stats()
    sent = sum(after[k]["bytes_sent"] - before[k]["bytes_sent"] for k in after)
    return torch.stack(results), state.residuals.get(0, torch.zeros(0)).clone(), sent


def _coded_against_plain(rank, ws, numel):
    """Three steps with error feedback, each spec plain and coded: the
    results, and the bytes each sent."""
    out = {}
    for spec in SPECS:
        for name in (spec, f"{spec}+ec:always"):
            out[name] = _steps(
                name, 3, 100, rank, numel, lambda c, g, st: compressed_all_reduce(g, c, st)
            )
    return out


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_a_coded_all_reduce_is_the_plain_one_in_fewer_bytes(world_size):
    # 5 ranks: sparse_all_reduce's reduce-scatter form, whose final
    # all-gather of the non-zeros is the coded part.
    numel = 200_000 + world_size
    for rank, out in enumerate(run_ranks(_coded_against_plain, world_size, numel)):
        for spec in SPECS:
            plain, coded = out[spec], out[f"{spec}+ec:always"]
            assert torch.equal(plain[0], coded[0]), (rank, spec)
            assert torch.equal(plain[1], coded[1]), (rank, spec)
            assert coded[2] < SPECS[spec] * plain[2], (rank, spec, coded[2] / plain[2])


def test_coding_is_refused_on_cuda_tensors():
    class OnCuda:  # what check_coded_device reads of a CUDA tensor
        is_cuda = True
        device = "cuda:0"

    with pytest.raises(ValueError, match="codes CPU tensors' messages; this one is on cuda:0"):
        get_compressor("topk:0.01+ec").check_coded_device(OnCuda())
    get_compressor("topk:0.01").check_coded_device(OnCuda())  # uncoded: nothing to refuse


def _auto(rank, ws, spec):
    from clawcomm.compression.coding import coding_stats, reset_coding_stats

    reset_coding_stats()
    g = torch.from_numpy(np.random.default_rng(rank).standard_normal(400_000)).float()
    compressed_all_reduce(g, spec, CompressorState())
    return coding_stats()


@pytest.mark.parametrize("spec", ["topk:0.01+ec", "qsgd:4+ec"])
def test_ec_codes_where_the_link_makes_it_pay(tmp_path, spec):
    """Shared memory at the model's 5 GB/s: coding costs more than it
    saves, so nothing is coded; a model whose link moves 10 MB/s: every
    message is, and the bits per element on the wire drop."""
    fast = run_ranks(_auto, 2, spec)[0]
    assert fast["messages"] > 0 and fast["coded"] == 0, fast
    slow_model = tmp_path / "slow.json"
    clawcomm.cost_model.CostModel(shm_beta=1 / 10e6).save(str(slow_model))
    slow = run_ranks(_auto, 2, spec, env={"CLAWCOMM_COST_MODEL": str(slow_model)})[0]
    assert slow["coded"] == slow["messages"] > 0, slow
    assert slow["bits_per_element"] < fast["bits_per_element"], (slow, fast)


def _reduce_scatter_coded_against_plain(rank, ws, numel):
    """ZeRO's sharded reduction, each spec plain and coded: this rank's
    part, the residual, and the bytes sent."""

    def reduce_scatter(c, g, state):
        part = torch.empty(numel // ws)
        c.reduce_scatter_mean(g, part, state, 0, dist.group.WORLD)
        return part

    out = {}
    for spec in ("topk:0.01", "topk:0.02+bf16", "dgc:0.01", "int4", "qsgd:4"):
        for name in (spec, f"{spec}+ec:always"):
            out[name] = _steps(name, 2, 10, rank, numel, reduce_scatter)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_coded_reduce_scatter_is_the_plain_one_in_fewer_bytes(world_size):
    numel = 3 * 2**16 * world_size
    for rank, out in enumerate(run_ranks(_reduce_scatter_coded_against_plain, world_size, numel)):
        for name, coded in out.items():
            if "+ec" not in name:
                continue
            plain = out[name.removesuffix("+ec:always")]
            assert torch.equal(plain[0], coded[0]), (rank, name)
            assert torch.equal(plain[1], coded[1]), (rank, name)
            assert coded[2] < plain[2], (rank, name, coded[2] / plain[2])
