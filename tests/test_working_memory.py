"""Collectives reuse their working memory (csrc/common/scratch.h) instead of
allocating a message-sized buffer per call: above glibc's 32 MiB mmap
threshold such a buffer is a fresh mapping every call, and its page faults
made a 64 MiB reduce-scatter several times the whole all-reduce. Checked by
counting page faults, not by timing."""

from __future__ import annotations

import resource

import numpy as np

import clawcomm
from clawcomm.launch import run_ranks

MIB = 1 << 20


def _faults_per_call(rank, n, mb):
    eng = clawcomm.engine_of()
    total = mb * MIB // 4
    x = np.ones(total, np.float32)
    out = np.empty(total // n, np.float32)
    buf = np.ones(total, np.float32)
    eng.reduce_scatter(x, out)  # warm-up: the working memory grows once
    eng.reduce(buf, root=0)
    eng.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    calls = 3
    for _ in range(calls):
        eng.reduce_scatter(x, out)
        eng.reduce(buf, root=0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert out[0] == n  # the work was done
    return faults / calls


def test_large_reduce_scatter_and_reduce_do_not_fault_in_fresh_memory_each_call():
    mb = 48  # above glibc's largest mmap threshold (32 MiB)
    pages = mb * MIB // 4096
    for per_call in run_ranks(_faults_per_call, 2, mb):
        # A fresh 48 MiB buffer per call would fault in 12288 pages.
        assert per_call < pages / 8, f"{per_call:.0f} page faults per call (of {pages} pages)"
