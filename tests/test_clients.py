"""Real torch.distributed clients on clawcomm give the same parameters as a
single-process reference trained on the global batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from clawcomm.launch import run_ranks

STEPS = 3
GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
        for _ in range(STEPS)
    ]


def reference_params(optim="sgd"):
    model = make_model()
    opt = _optimizer(optim, model.parameters())
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.Adam(params, lr=0.01)


def local_shard(x, rank, ws):
    per = x.shape[0] // ws
    return x[rank * per : (rank + 1) * per]


def assert_params_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# --- DDP --------------------------------------------------------------------


def train_on_shards(model, opt, rank, ws):
    """Each rank trains on its shard of every global batch; returns the parameters
    (gathered whole where FSDP2 shards them)."""
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(local_shard(x, rank, ws)), local_shard(y, rank, ws)).backward()
        opt.step()
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def _ddp(rank, ws, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    return train_on_shards(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, ws)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ddp_matches_single_process(world_size):
    want = reference_params()
    for got in run_ranks(_ddp, world_size, 25):
        assert_params_close(got, want)


def test_ddp_many_small_buckets_over_tcp():
    want = reference_params()
    for got in run_ranks(_ddp, 2, 0.0001, env={"CLAWCOMM_TRANSPORT": "tcp"}):
        assert_params_close(got, want)


def _ddp_comm_hook(rank, ws):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    # The stock allreduce hook chains .then() on our Work's future.
    model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    return train_on_shards(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, ws)


def test_ddp_comm_hook_future_chaining():
    want = reference_params()
    for got in run_ranks(_ddp_comm_hook, 2):
        assert_params_close(got, want)


# --- ZeroRedundancyOptimizer -------------------------------------------------


def _zero(rank, ws):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    params = train_on_shards(model, opt, rank, ws)
    opt.consolidate_state_dict(to=0)
    n_states = len(opt.state_dict()["state"]) if rank == 0 else None
    return params, n_states


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_redundancy_optimizer_matches_single_process(world_size):
    want = reference_params("adam")
    results = run_ranks(_zero, world_size)
    for got, _ in results:
        assert_params_close(got, want)
    assert results[0][1] == len(want)  # consolidated state covers every parameter


# --- FSDP2 --------------------------------------------------------------------


def _fsdp2(rank, ws, reshard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return train_on_shards(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, ws)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_matches_single_process(world_size, reshard):
    want = reference_params()
    for got in run_ranks(_fsdp2, world_size, reshard):
        assert_params_close(got, want)


# --- pipelining -----------------------------------------------------------------


def _pipeline(rank, ws, schedule_name):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    full = make_model()
    # Stage 0: Linear-Tanh-Linear; stage 1: Tanh-Linear (for 2 ranks).
    cut = [0, 3, 5]
    stage_mod = nn.Sequential(*list(full)[cut[rank] : cut[rank + 1]])
    stage = PipelineStage(stage_mod, rank, ws, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    # Each microbatch's loss is its mean; the schedule divides the summed
    # gradients by the number of microbatches (scale_grads=True), which gives
    # the gradient of the global-batch mean.
    schedule = cls(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    for x, y in batches():
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
    return [p.detach().clone() for p in stage_mod.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelining_matches_single_process(schedule):
    want = reference_params()
    results = run_ranks(_pipeline, 2, schedule)
    assert_params_close(results[0] + results[1], want)


# --- distributed checkpoint -----------------------------------------------------------


def _checkpoint(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = make_model(seed=3)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    fresh = make_model(seed=4)
    fully_shard(fresh, mesh=mesh)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    return [p.full_tensor().clone() for p in fresh.parameters()]


def test_distributed_checkpoint_roundtrip(tmp_path):
    want = [p.detach() for p in make_model(seed=3).parameters()]
    for got in run_ranks(_checkpoint, 2, str(tmp_path / "ckpt")):
        assert_params_close(got, want)
    assert os.listdir(tmp_path / "ckpt")


# --- object collectives ----------------------------------------------------------


def _objects(rank, ws):
    out = [None] * ws
    dist.all_gather_object(out, {"rank": rank, "text": "x" * rank})
    objs = [f"from-0-{i}" for i in range(3)] if rank == 0 else [None] * 3
    dist.broadcast_object_list(objs, src=0)
    got = [None]
    dist.scatter_object_list(got, [f"to-{r}" for r in range(ws)] if rank == 0 else None, src=0)
    gathered = [None] * ws if rank == 0 else None
    dist.gather_object(rank * 10, gathered, dst=0)
    return out, objs, got[0], gathered


def test_object_collectives():
    results = run_ranks(_objects, 3)
    for rank, (out, objs, got, gathered) in enumerate(results):
        assert out == [{"rank": r, "text": "x" * r} for r in range(3)]
        assert objs == ["from-0-0", "from-0-1", "from-0-2"]
        assert got == f"to-{rank}"
        assert gathered == ([0, 10, 20] if rank == 0 else None)


# --- torchrun ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "nproc,example,expect",
    [
        (2, ["ddp_torchrun.py"], "parameters identical on 2 ranks"),
        (2, ["data_parallel.py", "--compression", "topk:0.1", "--accumulation", "2"],
         "parameters identical on 2 ranks"),
        (4, ["pipeline_train.py", "--dp", "2", "--pp", "2", "--schedule", "zb1",
             "--compression", "topk:0.5"], "replicas identical"),
    ],
)  # fmt: skip
def test_torchrun_example_runs_unchanged(nproc, example, expect):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv-endpoint=127.0.0.1:0",
            "--rdzv-backend=c10d",
            os.path.join(root, "examples", example[0]),
            *example[1:],
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expect in proc.stdout
