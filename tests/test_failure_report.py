"""Failures in the user's words: the engine's errors and flight records name
global ranks first, ``clawcomm train`` ends a failed run with one summary
(who failed first and why, what the others saw, where the flight records
and the last checkpoint are), a bad CLAWCOMM_* value is one line, and old
flight-record folders are pruned."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _training import _save_at

from clawcomm import flight as clawcomm_flight
from clawcomm.cli import main
from clawcomm.launch import RankFailure, run_ranks
from clawcomm.train import failure
from clawcomm.train.config import TrainConfig


def _dies_in_a_subgroup(rank, ws, flight_dir):
    os.environ["CLAWCOMM_FLIGHT_DIR"] = flight_dir
    pair = dist.new_group([0, 2])  # global ranks 0 and 2: group ranks 0 and 1
    if rank == 1:
        return None
    x = torch.ones(1 << 16)
    dist.all_reduce(x, group=pair)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(1000):
            dist.all_reduce(x, group=pair)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_an_error_in_a_subgroup_names_the_global_rank_first(tmp_path):
    # the subgroup's records go in a folder of their own inside the job's
    flight = str(tmp_path / "flight")
    out = run_ranks(_dies_in_a_subgroup, 3, flight, allow_failures=True, pg_timeout=30)
    assert isinstance(out[2], RankFailure)
    assert "rank 2 (group rank 1, pid " in out[0] and ") died" in out[0], out[0]
    (job,) = os.listdir(flight)
    (group,) = os.listdir(os.path.join(flight, job))
    assert group.startswith("group-"), group
    folder = os.path.join(flight, job, group)
    assert f"flight record: {folder}/rank0.json" in out[0], out[0]
    record = json.loads(open(os.path.join(folder, "rank0.json")).read())
    assert record["global_rank"] == 0 and record["global_ranks"] == [0, 2]
    assert list(clawcomm_flight.load_job(os.path.join(flight, job))) == [group]
    report = clawcomm_flight.diagnose(clawcomm_flight.load(folder))
    assert report[0].startswith("rank 0 (group rank 0) failed: clawcomm::all_reduce: rank 2 (")
    assert report[1].startswith("ranks [2] (group ranks [1]) wrote no flight record"), report


def test_the_summary_names_the_first_failure_and_where_to_look(tmp_path, monkeypatch):
    monkeypatch.delenv("CLAWCOMM_DEBUG", raising=False)
    died = "DistBackendError: clawcomm::all_reduce: rank 3 (group rank 1, pid 12) died"
    errors = {
        0: f"Traceback (most recent call last):\n  File x\n{died} (flight record: /f/ab/rank0.json)"
        "\nclawcomm train: rank 0 failed in step 3",
        2: f"Traceback (most recent call last):\n  File y\n{died}\nclawcomm train: rank 2 failed "
        "in step 3",
        3: "rank died with exit code -9",
    }
    text = failure.summary(errors, [100, 101, 102, 103], str(tmp_path / "none"))
    lines = text.splitlines()
    assert (
        lines[0]
        == "clawcomm train: the run failed in step 3: rank 3 (pid 103) was killed by SIGKILL"
    )
    assert lines[1] == f"  rank 0 stopped: {died} (flight record: /f/ab/rank0.json)"
    assert lines[2] == f"  rank 2 stopped: {died}"
    assert "  flight record: /f/ab (clawcomm flight /f/ab)" in lines
    assert f"  no checkpoint in {tmp_path / 'none'} yet" in lines
    assert "Traceback" not in text and "CLAWCOMM_DEBUG=1" in lines[-1]
    own = {1: "Traceback (most recent call last):\n  File z\nZeroDivisionError: division by zero"}
    text = failure.summary(own, [7, 8])
    assert text.startswith("clawcomm train: the run failed: rank 1 (pid 8) raised ZeroDivision")
    assert "Traceback" in text  # its own code raised: its traceback is the user's


def test_the_summary_says_resume_goes_on_only_where_a_retry_can(tmp_path, monkeypatch):
    """Not past a damaged checkpoint without naming it, not where none is
    intact, and not where the checkpoint does not fit the command (whose
    one line then stands without a traceback)."""
    monkeypatch.delenv("CLAWCOMM_DEBUG", raising=False)
    root = str(tmp_path / "ck")
    _save_at(TrainConfig(model="mlp", hidden=32), root, [2, 4])
    killed = {1: "rank died with exit code -9"}
    newest = f"{root}/step-00000004"
    lines = failure.summary(killed, [5, 6], root).splitlines()
    assert f"  last checkpoint: {newest}; the same command with --resume goes on" in lines
    lines = failure.summary(killed, [5, 6], root, resume=True).splitlines()
    assert f"  last checkpoint: {newest}; the same command goes on" in lines
    unfit = {
        0: "Traceback (most recent call last):\n  File x\nclawcomm.train.checkpoint_files."
        f"CheckpointError: {newest} holds another model: it lacks ['4.weight']"
    }
    text = failure.summary(unfit, [5], root, resume=True)
    assert text.splitlines()[0] == (
        f"clawcomm train: the run failed: rank 0 (pid 5) raised CheckpointError: {newest} holds "
        "another model: it lacks ['4.weight']"
    )
    assert f"  last checkpoint: {newest}; it does not fit this command (above)" in text
    assert "Traceback" not in text and "goes on" not in text
    shard = f"{newest}/__0_0.distcp"
    os.truncate(shard, 1000)
    lines = failure.summary(killed, [5, 6], root).splitlines()
    assert lines[1].startswith(f"  {shard}: cut short, 1000 bytes where"), lines
    assert lines[1].endswith(
        f"; last intact checkpoint: {root}/step-00000002; the same command with --resume goes "
        "on from it"
    ), lines
    os.remove(f"{root}/step-00000002/.metadata")
    lines = failure.summary(killed, [5, 6], root).splitlines()
    assert lines[1].startswith(f"  no intact checkpoint in {root}: {shard}: cut short"), lines
    assert lines[1].endswith(
        ": --resume cannot go on; without it the run starts from step 0"
    ), lines


def test_a_killed_rank_ends_clawcomm_train_with_one_summary(tmp_path, capsys, monkeypatch):
    # dp 2 x pp 2: the pipeline and data-parallel groups that saw the death
    # write their records in one folder of the job, which the summary names
    # once and ``clawcomm flight`` reads group by group
    monkeypatch.setenv("CLAWCOMM_FLIGHT_DIR", str(tmp_path / "flight"))
    ck = tmp_path / "ck"
    argv = ["train", "--model", "mlp", "--hidden", "32", "--dp", "2", "--pp", "2", "--steps", "6",
            "--kill-rank", "3", "--kill-at-step", "2", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "1", "--quiet"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("clawcomm train: the run failed") and "rank 3 (pid " in first, err
    assert "was killed by SIGKILL" in first, err
    assert f"last checkpoint: {ck}/step-00000002; the same command with --resume goes on" in err
    assert "Traceback" not in err, err
    (job,) = os.listdir(tmp_path / "flight")
    folder = str(tmp_path / "flight" / job)
    flights = [line for line in err.splitlines() if line.startswith("  flight record:")]
    assert flights == [f"  flight record: {folder} (clawcomm flight {folder})"], err
    assert main(["flight", folder]) == 0
    out = capsys.readouterr().out
    groups = [line for line in out.splitlines() if line.startswith("# group ")]
    assert len(groups) == len(clawcomm_flight.load_job(folder)) >= 2, out
    assert "rank 3" in out


@pytest.mark.parametrize(
    "argv",
    [["train", "--model", "mlp", "--steps", "1"], ["bench", "-b", "8", "-e", "8"],
     ["experiment", "compression", "--compressors", "none", "--steps", "1"]],
    ids=["train", "bench", "experiment"],
)  # fmt: skip
def test_a_bad_setting_is_one_line_before_any_rank_starts(monkeypatch, capsys, argv):
    monkeypatch.setenv("CLAWCOMM_SPIN_US", "99999999")
    assert main(argv) == 2
    err = capsys.readouterr().err
    command = " ".join(argv[:2] if argv[0] == "experiment" else argv[:1])
    assert err.strip() == (
        f"clawcomm {command}: error: CLAWCOMM_SPIN_US=99999999 is not a whole number in "
        "[0, 1000000]"
    ), err


def test_clawcomm_flight_on_a_folder_that_is_not_there(tmp_path, capsys):
    assert main(["flight", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"clawcomm flight: error: {tmp_path / 'nowhere'} is not a folder"), err
    assert main(["flight", str(tmp_path)]) == 1
    assert "no flight records in" in capsys.readouterr().err


def _fails_with_records(rank, ws, flight_dir, keep):
    os.environ.update({"CLAWCOMM_FLIGHT_DIR": flight_dir, "CLAWCOMM_FLIGHT_KEEP": str(keep)})
    group = dist.new_group([0, 1])  # its records go in the job's folder
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(Exception, match="died"):
        for _ in range(1000):
            dist.all_reduce(torch.ones(1 << 14), group=group)


@pytest.mark.parametrize("keep", [2])
def test_old_flight_records_are_pruned(tmp_path, keep):
    flight = tmp_path / "flight"
    old = flight / "0000old"
    old.mkdir(parents=True)
    (old / "rank0.json").write_text("{}")
    week = time.time() - 8 * 24 * 3600
    os.utime(old, (week, week))
    for n in range(3):
        (flight / f"recent{n}").mkdir()
    run_ranks(_fails_with_records, 2, str(flight), keep, allow_failures=True, pg_timeout=30)
    left = sorted(os.listdir(flight))
    assert "0000old" not in left and len(left) == keep, left  # its own folder and the newest
