"""Settings refused when a group is created, on every rank and before any
byte is sent: the error names the variable, the value and what it may be."""

from __future__ import annotations

import re

import pytest

from clawcomm.launch import RankFailure, run_ranks


def _nothing(rank, ws):
    return None


def test_inconsistent_settings_are_reported():
    with pytest.raises(RankFailure, match="CLAWCOMM_TRANSPORT"):
        # Only rank 1 asks for TCP: rendezvous refuses rather than hanging.
        run_ranks(
            _nothing, 2, rank_env=[{}, {"CLAWCOMM_TRANSPORT": "tcp"}], timeout=60, pg_timeout=10
        )


@pytest.mark.parametrize(
    "env,message",
    [
        ({"CLAWCOMM_TRANSPORT": "rdma"}, r"CLAWCOMM_TRANSPORT=rdma is not one of auto, shm, tcp"),
        ({"CLAWCOMM_ALGO": "butterfly"}, r"CLAWCOMM_ALGO=butterfly is not one of auto, oneshot,"),
    ],
)
def test_unknown_transport_or_algorithm_names_the_choices(env, message):
    # The names come from the transport registry and the algorithm table.
    with pytest.raises(RankFailure, match=message):
        run_ranks(_nothing, 2, env=env, timeout=60, pg_timeout=10)


def test_forced_shared_memory_across_hosts_is_refused():
    with pytest.raises(RankFailure, match=r"CLAWCOMM_TRANSPORT=shm cannot connect rank \d"):
        run_ranks(
            _nothing,
            2,
            env={"CLAWCOMM_TRANSPORT": "shm"},
            rank_env=[{"CLAWCOMM_HOST_ID": "a"}, {"CLAWCOMM_HOST_ID": "b"}],
            timeout=60,
            pg_timeout=10,
        )


@pytest.mark.parametrize(
    "var,value",
    [
        ("CLAWCOMM_SHM_RING_BYTES", "-1"),
        ("CLAWCOMM_SHM_RING_BYTES", "18446744073709551615"),
        ("CLAWCOMM_SEGMENT_BYTES", "1k"),
        ("CLAWCOMM_SPIN_US", "99999999"),
        ("CLAWCOMM_INLINE_BYTES", " 5"),
        ("CLAWCOMM_RECORDER_ENTRIES", "99999999999999999999999"),
    ],
)
def test_numeric_settings_are_parsed_strictly_and_range_checked(var, value):
    with pytest.raises(RankFailure, match=re.escape(f"{var}={value} is not a whole number in [")):
        run_ranks(_nothing, 2, env={var: value}, timeout=60, pg_timeout=10)


def test_a_bad_simd_setting_is_refused_at_setup():
    with pytest.raises(RankFailure, match=r"CLAWCOMM_SIMD=bogus is not one of auto, avx512"):
        run_ranks(_nothing, 2, env={"CLAWCOMM_SIMD": "bogus"}, timeout=60, pg_timeout=10)


def test_sockets_per_peer_must_match():
    """CLAWCOMM_SOCKETS_PER_PEER differs between ranks: setup fails on both,
    naming the setting, instead of pairing sockets wrongly."""
    envs = [{"CLAWCOMM_SOCKETS_PER_PEER": "2"}, {"CLAWCOMM_SOCKETS_PER_PEER": "1"}]
    results = run_ranks(
        _nothing,
        2,
        env={"CLAWCOMM_TRANSPORT": "tcp"},
        rank_env=envs,
        allow_failures=True,
        pg_timeout=10,
        timeout=60,
    )
    for result in results:
        assert isinstance(result, RankFailure), f"expected this rank to fail: {result!r}"
        text = next(iter(result.errors.values()))
        assert "CLAWCOMM_SOCKETS_PER_PEER=" in text and "must match" in text, text
