"""The compression lab's method specs (sync options per method) and its runs
at a dp x pp layout through the trainer's pipeline (``--layout``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from clawcomm.experiments.layout import parse_layout
from clawcomm.experiments.methods import parse_method

CFG = {"outer_lr": 0.7, "outer_momentum": 0.9, "steps": 100}


def test_a_method_names_its_sync_its_options_and_its_compressor():
    m = parse_method("diloco:32:fragments=4:delay=2:mix=0.5+int8", CFG)
    assert (m.sync, m.fragments, m.delay, m.mix, m.compressor) == ("diloco:32", 4, 2, 0.5, "int8")
    s = m.outer_settings(CFG)
    assert (s.sync_delay, s.sync_mix, s.compression, s.steps) == (2, 0.5, "int8", 100)
    m = parse_method("topk:0.01+fp16")
    assert (m.sync, m.compressor) == ("every-step", "topk:0.01+fp16")
    assert parse_method("local-sgd:8").compressor == "none"
    assert parse_method("compute").sync == "every-step"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("diloco:32:frags=4", "'frags=4' is not fragments=F, delay=STEPS or mix=ALPHA"),
        ("diloco:32:delay=x", "delay 'x' is not a number"),
        ("diloco:32:delay=32", "sync_delay must be in \\[0, H\\) \\(H 32\\)"),
        ("diloco:32:fragments=5", "fragments 5 must be >= 1 and divide"),
        ("diloco:32+int9", "unknown compressor"),
        ("diloco", "not every-step, local-sgd:H or diloco:H"),
    ],
)
def test_bad_methods_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec, CFG)


def test_parse_layout():
    assert parse_layout("2x2") == (2, 2) and parse_layout("4X1") == (4, 1)
    for bad in ("2", "2x", "x2", "0x2", "axb"):
        with pytest.raises(ValueError, match="--layout"):
            parse_layout(bad)


def _lab(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "clawcomm.cli", "experiment", "compression", "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_lab_runs_methods_through_the_pipeline_at_dp_x_pp(tmp_path):
    """dp 2 x pp 2 on the MLP: each stage exchanges its own gradients (int8:
    about a quarter of dense's bytes), delayed DiLoCo meets in fragments
    (each parameter once per 4 steps), compute alone exchanges nothing, and
    every method learns."""
    out = tmp_path / "l.json"
    p = _lab("--model", "mlp", "--layout", "2x2", "--steps", "24", "--warmup", "4", "-c",
             "none,int8,diloco:4:fragments=2:delay=1:mix=0.5", "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 ranks on one host, dp 2 x pp 2" in p.stdout
    data = json.loads(out.read_text())["links"]["one host"]
    by = {r["compressor"]: r for r in data["results"]}
    dense = by["none"]["bytes_per_step"]
    assert 0.24 < by["int8"]["bytes_per_step"] / dense < 0.30
    diloco = by["diloco:4:fragments=2:delay=1:mix=0.5"]
    assert 0.2 < diloco["bytes_per_step"] / dense < 0.3  # every parameter once per 4 steps
    assert by["compute"]["bytes_per_step"] == 0
    for r in data["results"]:
        assert r["layout"] == "2x2" and r["final_loss"] < r["curve"][0][1], r["compressor"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--layout", "2x2", "--device", "cuda"], "runs on the CPU, not --device cuda"),
        (["--layout", "2x2", "--nproc", "3"], "--nproc 3 is not --layout 2x2's dp x pp"),
        (["--layout", "2x2", "--batch", "6"], "--batch 6 must split into 4 micro-batches"),
        (["--layout", "two"], "--layout 'two' is not DPxPP"),
    ],
)
def test_bad_layouts_are_refused(args, message):
    p = _lab("-c", "none", *args, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]


def test_delayed_meetings_count_their_bytes_in_the_lab(tmp_path):
    """On the DDP path the delayed exchanges run over a group of their own;
    the lab counts its bytes too: the same bytes as meeting on time."""
    out = tmp_path / "d.json"
    p = _lab("--model", "mlp", "--steps", "16", "--warmup", "0", "-c",
             "diloco:4,diloco:4:delay=2", "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    by = {r["compressor"]: r for r in json.loads(out.read_text())["links"]["one host"]["results"]}
    on_time, late = by["diloco:4"]["bytes_per_step"], by["diloco:4:delay=2"]["bytes_per_step"]
    assert on_time > 0 and late == pytest.approx(on_time, rel=0.02)


def test_ctrl_c_ends_the_lab_with_one_line():
    # Ctrl-C reaches the whole foreground process group: the lab and its ranks
    import signal
    import time

    code = "import sys; from clawcomm.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["experiment", "compression", "--model", "mlp", "-c", "none", "--steps", "100000",
            "--quiet"]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=root))  # fmt: skip
    time.sleep(12)  # the ranks are training
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == (
        "clawcomm experiment compression: interrupted after 0 of 2 runs; nothing written"
    ), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
