"""Frames as a peer puts them on the wire, and a fuzzer that feeds random
and mutated streams of them to the engine's frame parser (tests/test_wire.py,
bench/fuzz_frames.py)."""

from __future__ import annotations

FRAME_MAGIC = 0x434C4D46  # "CLMF" (csrc/messenger/messenger.cc)


def make_frame(
    kind: int,
    payload: bytes,
    tag: int = 0,
    magic: int = FRAME_MAGIC,
    claimed: int | None = None,
    fields: tuple[int, int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0, 0),
    epoch: int = 0,
) -> bytes:
    """One frame as a clawcomm peer puts it on the wire: the 64-byte header
    (csrc/messenger/messenger.h, FrameHeader) and the payload padded to 8
    bytes. ``claimed`` overrides the payload length the header states;
    ``fields`` are (opType, dtype, redop, count, root, step, algo); ``epoch``
    is the group's (0 in the ``_feed_frames`` hook)."""
    import struct

    op, dtype, redop, count, root, step, algo = fields
    length = len(payload) if claimed is None else claimed
    header = struct.pack(
        "<IBBBBQQQiIB3xI16x",
        magic, kind, op, dtype, redop, tag, count, length, root, step, algo, epoch,
    )  # fmt: skip
    return header + payload + b"\0" * (-len(payload) % 8)


def fuzz_frames(seed: int = 0, cases: int = 1000, seconds: float | None = None) -> str:
    """Feeds ``cases`` random streams (or as many as fit in ``seconds``) to
    the frame parser: well-formed frames of every kind, then mutated (bytes
    flipped, cut short, spliced, absurd lengths, unknown kinds). Returns a
    one-line summary; a crash ends the process, which is the finding."""
    import random
    import time

    from clawcomm import _C

    rng = random.Random(seed)
    huge = [1 << 30, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    done = 0
    while done < cases and (seconds is None or time.monotonic() - start < seconds):
        frames = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice([1, 2, 2, 3, 4])
            payload = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 8, 13, 64, 256])))
            if kind == 4:
                payload = b"why".ljust(448, b"\0")
            fields = tuple(rng.randint(0, 12) for _ in range(7))
            claimed = rng.choice(huge) if rng.random() < 0.15 else None
            frames.append(
                make_frame(kind, payload, rng.randint(0, 2), claimed=claimed, fields=fields)
            )
        data = bytearray(b"".join(frames))
        for _ in range(rng.randint(0, 4)):
            what = rng.random()
            if what < 0.4 and data:
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            elif what < 0.6 and data:
                del data[rng.randrange(len(data)) :]
            elif what < 0.8 and data:
                i = rng.randrange(len(data))
                data[i:i] = data[i : i + rng.randint(1, 80)]
            else:
                data[rng.randrange(len(data) + 1) : 0] = bytes(rng.getrandbits(8) for _ in range(8))
        error = _C._feed_frames(bytes(data), rng.choice([-1, 0, 8, 64]))
        key = "clean" if not error else " ".join(error.split()[:3])
        outcomes[key] = outcomes.get(key, 0) + 1
        done += 1
    top = sorted(outcomes.items(), key=lambda kv: -kv[1])[:6]
    return f"{done} cases in {time.monotonic() - start:.1f} s: " + ", ".join(
        f"{k!r} x{v}" for k, v in top
    )
