"""A selected subset of PyTorch's own distributed test suite, run against
clawcomm the way torch's test_distributed_spawn.py runs it.

The full suite takes about 6 minutes at WORLD_SIZE=2; the README gives the
command, and docs/torch_suite.md the counts for clawcomm and gloo.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SELECTED = [
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_max",
    "test_all_reduce_product",
    "test_all_reduce_sum_complex",
    "test_reduce_sum",
    "test_broadcast",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_gather",
    "test_scatter",
    "test_barrier",
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_send_recv_any_source",
    "test_irecv",
    "test_isend",
    "test_destroy_group",
    "test_DistributedDataParallelCPU",
]

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "torch_suite", "torch_distributed_suite.py")


@pytest.mark.torchsuite
def test_selected_torch_distributed_tests_pass(tmp_path):
    pytest.importorskip("expecttest")
    # Forked ranks: a spawned one spends ~7 s importing torch's test modules.
    env = dict(os.environ, BACKEND="clawcomm", WORLD_SIZE="2", TEMP_DIR=str(tmp_path),
               CLAWCOMM_SUITE_START="fork")  # fmt: skip
    ids = [f"{SUITE}::TestDistBackendRanks::{name}" for name in SELECTED]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ids],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and int(summary.group(1)) == len(SELECTED), tail
