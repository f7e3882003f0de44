"""Formatting is checked with the suite: ruff for Python, clang-format for C++.

.ci/setup installs the pinned versions from pyproject's `lint` extra.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_python_is_ruff_clean():
    if not shutil.which("ruff"):
        pytest.skip("ruff is not installed (bash .ci/setup installs it)")
    for cmd in (("ruff", "check", "."), ("ruff", "format", "--check", ".")):
        proc = _run(*cmd)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpp_is_clang_formatted():
    if not shutil.which("clang-format"):
        pytest.skip("clang-format is not installed (bash .ci/setup installs it)")
    files = _run(
        "git", "ls-files", "csrc/*.h", "csrc/*.cc", "csrc/*.cu", "csrc/*.cuh"
    ).stdout.split()
    proc = _run("clang-format", "--dry-run", "-Werror", *files)
    assert proc.returncode == 0, proc.stderr[-3000:]
