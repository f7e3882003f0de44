"""Speed and size of the ``+ec`` coders on one core: the quantisers' codes
(rANS, ``_C.compress.encode_rans``, against zlib's Huffman coder, the
well-kept coder it replaced, in the same run) and top-k pairs
(``entropy.encode_pairs``), on the codes of a Gaussian gradient of 2^20
values. MB/s are of the raw bytes (the codes, or the pairs' 8 bytes each),
the best of ``--repeats`` timings of a few calls each, through Python as
``+ec`` calls them; "x entropy" is the coded size over the order-0 entropy
of the bytes.

    python3 bench/coding_speed.py > bench/results/coding_speed.txt
"""

from __future__ import annotations

import argparse
import platform
import time
import zlib

import numpy as np
import torch

from clawcomm import _C
from clawcomm.compression import get_compressor
from clawcomm.compression.entropy import decode_pairs, encode_pairs, entropy_bits

SPECS = ["int8", "int4", "qsgd:4", "qsgd:2", "terngrad"]


def _best(fn, repeats: int, calls: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _zlib_huffman(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush()


def _code_rows(codes: np.ndarray, repeats: int):
    """(coder, coded bytes, encode s, decode s) for rANS and zlib's Huffman."""
    raw = codes.tobytes()
    rans = np.frombuffer(_C.compress.encode_rans(codes), np.uint8)
    huff = _zlib_huffman(raw)
    return [
        ("rANS", rans.size,
         _best(lambda: _C.compress.encode_rans(codes), repeats),
         _best(lambda: _C.compress.decode_rans(rans, codes.size), repeats)),
        ("zlib", len(huff),
         _best(lambda: _zlib_huffman(raw), repeats),
         _best(lambda: zlib.decompress(huff, -15, codes.size), repeats)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    grad = torch.from_numpy(np.random.default_rng(3).standard_normal(1 << 20)).float()
    print(f"# +ec coders, one core, {platform.processor() or platform.machine()}, "
          f"best of {args.repeats}; MB/s of raw bytes")  # fmt: skip
    print(f"# {'message':<14} {'bytes':>9} {'coder':<8} {'x entropy':>9} "
          f"{'encode MB/s':>11} {'decode MB/s':>11}")  # fmt: skip
    for spec in SPECS:
        codes, _ = get_compressor(spec).codec.encode(grad, seed=1)
        codes = codes.numpy()
        entropy = entropy_bits(codes)
        for coder, size, enc, dec in _code_rows(codes, args.repeats):
            print(f"  {spec:<14} {codes.size:>9} {coder:<8} {8 * size / entropy:>9.3f} "
                  f"{codes.size / enc / 1e6:>11.0f} {codes.size / dec / 1e6:>11.0f}")  # fmt: skip
    g = grad.numpy()
    k = g.size // 100
    idx = np.sort(np.argpartition(np.abs(g), -k)[-k:]).astype(np.int32)
    for name, values in (("topk:0.01", g[idx]), ("topk:0.01+fp16", g[idx].astype(np.float16))):
        message = encode_pairs(idx, values)
        raw_bytes = idx.nbytes + values.nbytes
        enc = _best(lambda v=values: encode_pairs(idx, v), args.repeats)
        dec = _best(lambda m=message, v=values: decode_pairs(m, v.dtype), args.repeats)
        print(f"  {name:<14} {raw_bytes:>9} {'pairs':<8} {message.size / raw_bytes:>8.3f}r "
              f"{raw_bytes / enc / 1e6:>11.0f} {raw_bytes / dec / 1e6:>11.0f}")  # fmt: skip
    print("# pairs: the 'x entropy' column is the message over its raw bytes (r)")


if __name__ == "__main__":
    main()
