"""The progress thread's priority: CLAWCOMM_PROGRESS_NICE for every group,
``clawcomm.group_options(progress_nice=...)`` for one, and the trainer's
pipeline groups at nice 0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import clawcomm
from clawcomm.launch import RankFailure, run_ranks


def _nice_values() -> list[int]:
    values = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        values.append(int(stat[stat.rfind(")") + 2 :].split()[16]))  # field 19: nice
    return sorted(set(values))


def _thread_nice_values(rank, ws):
    dist.all_reduce(torch.ones(4 << 20))  # large: it runs on the progress thread
    return _nice_values()


@pytest.mark.parametrize("nice", ["0", "7", None])
def test_progress_thread_runs_at_the_nice_value_set(nice):
    env = {} if nice is None else {"CLAWCOMM_PROGRESS_NICE": nice}
    want = {"0": [0], "7": [0, 7], None: [0, 10]}[nice]  # default 10
    for values in run_ranks(_thread_nice_values, 2, env=env):
        assert values == want


def _nothing(rank, ws):
    return None


def test_a_bad_progress_nice_value_is_refused():
    with pytest.raises(
        RankFailure, match=r"CLAWCOMM_PROGRESS_NICE=25 is not a whole number in \[0, 19\]"
    ):
        run_ranks(_nothing, 2, env={"CLAWCOMM_PROGRESS_NICE": "25"}, timeout=60)


def _one_group_at_its_own_nice(rank, ws):
    group = dist.new_group(list(range(ws)), pg_options=clawcomm.group_options(progress_nice=3))
    x = torch.ones(4 << 20)
    dist.all_reduce(x)  # the world's thread, at the environment's 7
    dist.all_reduce(x, group=group)
    dist.barrier(group=group)
    return (
        _nice_values(),
        clawcomm.backend_of(group).options.progress_nice,
        clawcomm.backend_of().options.progress_nice,
        x[0].item(),
    )


def test_a_group_runs_its_progress_thread_at_its_own_nice_value():
    for values, group_nice, world_nice, first in run_ranks(
        _one_group_at_its_own_nice, 2, env={"CLAWCOMM_PROGRESS_NICE": "7"}
    ):
        assert values == [0, 3, 7]  # the main thread, the group's, the world's
        assert (group_nice, world_nice) == (3, 7)
        assert first == 4.0


@pytest.mark.parametrize(
    "value,error,message",
    [
        (20, ValueError, r"progress_nice 20 is not a nice value in \[0, 19\]"),
        (-1, ValueError, r"progress_nice -1 is not a nice value in \[0, 19\]"),
        ("0", TypeError, r"progress_nice '0' is not an int"),
        (True, TypeError, r"progress_nice True is not an int"),
    ],
)
def test_a_bad_group_nice_value_is_refused_naming_it(value, error, message):
    with pytest.raises(error, match=r"clawcomm.group_options: " + message):
        clawcomm.group_options(progress_nice=value)


def _foreign_options(rank, ws):
    try:
        dist.new_group([0, 1], pg_options=object())
    except TypeError as e:
        return str(e)
    return "accepted"


def test_options_that_are_not_clawcomms_are_refused():
    for message in run_ranks(_foreign_options, 2):
        assert "pg_options object is not clawcomm.group_options(...)" in message


def _trainer_groups(rank, ws):
    from clawcomm.train.grid import Grid

    pp, dp, _, _ = Grid(dp=2, pp=2, rank=rank).make_groups()
    return (
        clawcomm.backend_of(pp).options.progress_nice,
        clawcomm.backend_of(dp).options.progress_nice,
    )


@pytest.mark.parametrize("env,want", [({}, (0, 10)), ({"CLAWCOMM_PROGRESS_NICE": "7"}, (7, 7))])
def test_the_trainers_pipeline_groups_run_at_nice_0_unless_the_user_names_one(env, want):
    # A stage posts its send and goes on computing: at nice 10 its progress
    # thread waited for the compute's time slice before moving the bytes.
    for nices in run_ranks(_trainer_groups, 4, env=env):
        assert nices == want
