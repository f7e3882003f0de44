"""Hostile input on the wire: the frame parser (csrc/messenger/) fed streams
no clawcomm peer would send, through the test hook ``_C._feed_frames``. A
bad stream is an error that says what was wrong; it never crashes the rank,
and it never makes it allocate more than the bytes that actually arrived."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from clawcomm import _C
from clawcomm.testing.frames import fuzz_frames, make_frame

COLLECTIVE, POINT_TO_POINT, ABORT = 1, 2, 4


def test_a_well_formed_message_is_received():
    assert _C._feed_frames(make_frame(POINT_TO_POINT, b"12345678"), recv_bytes=8) == ""


def test_a_short_stream_is_an_error_not_a_hang():
    frame = make_frame(POINT_TO_POINT, b"12345678")
    assert "stream ended" in _C._feed_frames(frame[:70], recv_bytes=8)


def test_bad_magic_unknown_kind_and_a_malformed_abort_are_named():
    assert "frame magic" in _C._feed_frames(make_frame(POINT_TO_POINT, b"", magic=0xDEADBEEF))
    # A frame of another group (a rebuilt group's predecessor) is refused.
    assert "a frame of another group (epoch 7, this group's is 0)" in _C._feed_frames(
        make_frame(POINT_TO_POINT, b"12345678", epoch=7), recv_bytes=8
    )
    assert "unknown kind 9" in _C._feed_frames(make_frame(9, b""))
    assert "malformed abort frame" in _C._feed_frames(make_frame(ABORT, b"x" * 8))
    reason = b"rank 1 gave up".ljust(448, b"\0")
    assert "rank 1 aborted: rank 1 gave up" in _C._feed_frames(make_frame(ABORT, reason))


def test_an_unknown_op_type_is_named_before_it_indexes_anything():
    """The op type indexes the per-op traffic counters: an unknown one used
    to write past them."""
    for kind in (COLLECTIVE, POINT_TO_POINT):
        frame = make_frame(kind, b"12345678", fields=(250, 0, 0, 2, 0, 0, 0))
        assert "op type 250 is not one of clawcomm's 11" in _C._feed_frames(frame, recv_bytes=8)


def test_a_size_that_differs_from_the_receive_is_a_mismatch():
    error = _C._feed_frames(make_frame(POINT_TO_POINT, b"x" * 16), recv_bytes=8)
    assert "sent 16 bytes with tag 0" in error and "expected 8" in error, error


def _peak_rss_mb(claimed: int) -> float:
    code = textwrap.dedent(f"""
        import resource
        from clawcomm import _C
        from clawcomm.testing.frames import make_frame
        _C._feed_frames(make_frame(2, b"x" * 64, claimed={claimed}))
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    """)
    return float(subprocess.check_output([sys.executable, "-c", code], text=True))


def test_a_header_claiming_a_gigabyte_allocates_only_what_arrives():
    """One 64-byte header used to make the receiver allocate (and zero) all
    the bytes it claimed before any arrived."""
    baseline = _peak_rss_mb(64)
    claimed = _peak_rss_mb(1 << 30)
    assert claimed - baseline < 32, (baseline, claimed)


def test_random_streams_never_crash_the_parser():
    """A bounded fuzz run (bench/fuzz_frames.py runs longer), in a child
    process, so that a crash is a failure and not the end of the suite."""
    code = "from clawcomm.testing.frames import fuzz_frames; print(fuzz_frames(seed=1, cases=3000))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cases" in out.stdout
    assert fuzz_frames(seed=2, cases=50).startswith("50 cases")
