"""Every output path of every command is checked before any rank starts
(clawcomm.outputs): one line naming the flag and the path, exit 2, no
traceback; folders are made; every file written is named in one line."""

from __future__ import annotations

import json

import pytest

from clawcomm import outputs
from clawcomm.cli import main


@pytest.fixture
def blocked(tmp_path):
    """A path that cannot be written whoever runs the test (root included):
    its folder would have to be made inside a file."""
    (tmp_path / "a-file").write_text("x")
    return str(tmp_path / "a-file" / "sub" / "out.json")


def test_check_makes_folders_and_leaves_nothing_behind(tmp_path, blocked):
    target = tmp_path / "runs" / "deep" / "m.jsonl"
    outputs.check("--metrics", str(target))
    assert target.parent.is_dir() and not target.exists()
    outputs.check("--checkpoint-dir", str(tmp_path / "runs" / "ck"), folder=True)
    assert list((tmp_path / "runs" / "ck").iterdir()) == []
    parent = blocked.removesuffix("/sub/out.json")  # a file: "File exists" said as it is
    with pytest.raises(outputs.OutputError) as e:
        outputs.check("--json", blocked)
    assert str(e.value) == f"--json {blocked}: {parent} is a file, not a folder"
    with pytest.raises(outputs.OutputError, match="is a folder, not a file"):
        outputs.check("--plot", str(tmp_path))
    with pytest.raises(outputs.OutputError, match="is a file, not a folder"):
        outputs.check("--tensorboard", str(tmp_path / "a-file"), folder=True)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "mlp", "--steps", "1", "--metrics", "{}"],
        ["train", "--model", "mlp", "--steps", "1", "--timeline", "{}"],
        ["train", "--model", "mlp", "--steps", "1", "--checkpoint-dir", "{}"],
        ["bench", "-b", "1K", "-e", "1K", "--json", "{}"],
        ["experiment", "compression", "-c", "none", "--plot", "{}"],
        ["simulate", "--hosts", "2", "--json", "{}"],
    ],
    ids=["train-metrics", "train-timeline", "train-checkpoint", "bench", "experiment", "simulate"],
)
def test_an_unwritable_output_fails_at_once_naming_its_flag(argv, blocked, capsys):
    flag = argv[argv.index("{}") - 1]
    assert main([a.replace("{}", blocked) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} {blocked}: {blocked.removesuffix('/sub/out.json')} is a file" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_files_a_run_writes_are_named_after_its_summary(tmp_path, capsys):
    runs = tmp_path / "runs"
    metrics, trace = runs / "m.jsonl", runs / "t" / "trace.json"
    argv = ["train", "--model", "mlp", "--hidden", "32", "--steps", "2", "--dp", "2", "--quiet",
            "--metrics", str(metrics), "--trace", str(trace)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    tail = out[out.index("final loss") :]
    assert f"clawcomm train: wrote metrics {metrics}\n" in tail, out
    assert f"clawcomm train: wrote trace {trace}\n" in tail, out
    assert len(metrics.read_text().splitlines()) == 2 and json.loads(trace.read_text())
    main(["simulate", "--hosts", "2", "--json", str(runs / "s.json")])
    assert f"wrote results {runs / 's.json'}" in capsys.readouterr().out
