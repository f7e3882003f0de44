"""bench/gpu_check.sh, the one script a GPU session runs, checked without a
GPU: its syntax, and its dry run (the plan and the time gates, with the
summary's date, commit and machine lines), which runs nothing."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
PHASES = ("build", "latency", "zero3", "tests", "latency2", "bench", "memcheck")


def _dry(tmp_path, budget):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_BUDGET_S=budget)
    out = subprocess.run(
        ["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return (tmp_path / "check.txt").read_text()


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_dry_run_says_when_where_and_which_phases_fit(tmp_path):
    text = _dry(tmp_path, "480")
    lines = text.splitlines()
    assert lines[0].startswith("# bash bench/gpu_check.sh --dry-run, 20")
    assert lines[1].startswith("# commit ") and "; tree " in lines[1]
    assert lines[2].startswith("# machine: ") and "budget 480 s" in lines[2]
    ran = {ln.split()[0] for ln in lines if "would run" in ln}
    assert {"build", "latency", "zero3", "tests", "latency2", "memcheck"} <= ran, text
    assert (tmp_path / "host_state.txt").read_text().count("## ") == 3


def test_a_short_budget_skips_phases_and_says_so(tmp_path):
    text = _dry(tmp_path, "300")
    skipped = [ln.split()[0] for ln in text.splitlines() if " skipped: " in ln]
    assert "tests" in skipped and "build" not in skipped, text
    assert set(skipped) <= set(PHASES) | {"kernels", "racecheck", "train"}


def test_every_benchmark_json_says_when_where_and_at_which_commit(tmp_path, monkeypatch):
    """report.write_json (clawcomm bench, bench/gpu_latency.py,
    bench/gpu_kernels_bench.py, ...) adds the provenance; without git the
    commit comes from CLAWCOMM_COMMIT, else it says "not recorded"."""
    import json

    from clawcomm.bench import provenance
    from clawcomm.bench.report import write_json

    path = tmp_path / "r.json"
    write_json(str(path), {"rows": [1]})
    got = json.loads(path.read_text())
    p = got["provenance"]
    assert got["rows"] == [1] and p["date"].endswith("Z") and len(p["tree"]) == 40
    assert p["gpu"] and p["cores"] >= 1 and len(p["load"]) == 3
    monkeypatch.setattr(provenance, "_run", lambda cmd: "")  # no git, no nvidia-smi
    monkeypatch.setenv("CLAWCOMM_COMMIT", "abc123")
    assert provenance.commit() == "abc123" and provenance.gpu() == "none"
    monkeypatch.delenv("CLAWCOMM_COMMIT")
    assert provenance.commit() == "not recorded"
