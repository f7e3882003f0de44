"""torchrun with forked workers (clawcomm.launch.forkrun): the module
imported once by each host's agent, each worker a rank of the whole job
with torchrun's environment and one intra-op thread, and a failing worker
failing its host. On one host always; on 2 namespace hosts where they can
be made (root, iproute2), as the plan's trial and ``--check --hosts`` use it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from clawcomm.launch.netns import Cluster, unavailable

JOB = textwrap.dedent(
    """
    import json, os, sys
    inherited = "torch._dynamo" in sys.modules  # imported by the agent before it forked
    import torch
    import torch.distributed as dist
    import clawcomm  # noqa: F401

    out, how = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if how == "fail" and rank == 1:
        raise SystemExit(3)
    dist.init_process_group("clawcomm")
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": dist.get_world_size(), "sum": x[0].item(),
                   "threads": torch.get_num_threads(), "inherited": inherited,
                   "group_rank": int(os.environ["GROUP_RANK"])}, f)
    dist.destroy_process_group()
    """
)


def _job(tmp_path) -> dict[str, str]:
    (tmp_path / "forkjob.py").write_text(JOB)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _results(out) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_forked_workers_are_the_ranks_of_one_job(tmp_path):
    env = {**os.environ, **_job(tmp_path)}
    args = [sys.executable, "-m", "clawcomm.launch.forkrun", "--nnodes", "1",
            "--nproc-per-node", "3", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "-m", "forkjob", str(tmp_path), "ok"]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    got = _results(tmp_path)
    assert sorted(got) == [0, 1, 2]
    for r in got.values():  # 1 + 2 + 3, one thread each, torch._dynamo from the agent
        assert (r["world"], r["sum"], r["threads"], r["inherited"]) == (3, 6.0, 1, True)
    failed = subprocess.run(args[:-1] + ["fail"], env=env, capture_output=True, text=True,
                            timeout=180)  # fmt: skip
    assert failed.returncode != 0


def test_forkrun_refuses_what_it_cannot_run():
    done = subprocess.run([sys.executable, "-m", "clawcomm.launch.forkrun", "job.py"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode != 0 and "-m MODULE" in done.stderr
    with pytest.raises(ValueError, match="-m MODULE"):
        Cluster(2).torchrun(["job.py"], 2, fork=True)  # refused before any host is made


@pytest.mark.skipif(unavailable() is not None, reason=f"no namespace hosts: {unavailable()}")
def test_forked_workers_on_two_namespace_hosts(tmp_path):
    with Cluster(2, rate="1gbit") as cluster:
        runs = cluster.torchrun(["-m", "forkjob", str(tmp_path), "ok"], 2, env=_job(tmp_path),
                                timeout=240, fork=True)  # fmt: skip
    assert [r.returncode for r in runs] == [0, 0], [r.output[-2000:] for r in runs]
    got = _results(tmp_path)
    assert sorted(got) == [0, 1, 2, 3]
    assert {r["sum"] for r in got.values()} == {10.0}  # 1 + 2 + 3 + 4, across the link
    assert sorted(r["group_rank"] for r in got.values()) == [0, 0, 1, 1]
    assert all(r["threads"] == 1 and r["inherited"] for r in got.values())
