"""CUDA tensors through the clawcomm backend: CUDA IPC and staging through
pinned host memory. Every test carries the ``gpu`` marker and skips cleanly
where there is no GPU. Rank r runs on ``cuda:{r % device_count}``, the layout
torchrun users have: one GPU per rank where there are enough, ranks sharing
one (under MPS) where there are not.

Results are compared with the same collectives on CPU tensors, which the rest
of the suite checks against local values and gloo. The CUDA IPC path's logic
is also tested without a GPU (tests/test_device_collectives.py, over the host
runtime).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks

# device_count() asks NVML: the driver stays uninitialised in this process, so
# the forked ranks can use the GPU.
HAVE_GPU = torch.backends.cuda.is_built() and torch.cuda.device_count() > 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU (CUDA tests run on the GPU machine)"),
]


def _inputs(rank, count, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(-8, 9, (count,), generator=g).to(dtype)
    return x


def _device(rank):
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _every_collective(rank, n, dtype, count):
    dev = _device(rank)
    problems = []

    def same(name, got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            problems.append(f"{name}: got {got.flatten()[:6].tolist()}, want {want.flatten()[:6]}")

    x = _inputs(rank, count, dtype)
    # all_reduce on a side stream: the work must follow the caller's stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        d = x.to(dev) * 1  # produced on the side stream
        work = dist.all_reduce(d, async_op=True)
        work.wait()  # the side stream waits; the host does not need to
        d2 = d * 1  # ordered after the copy back on the side stream
    c = x.clone()
    dist.all_reduce(c)
    torch.cuda.synchronize()
    same("all_reduce", d2, c)

    # Rank 0's tensor is a strided view, the others' contiguous: the call
    # still routes alike on every rank (through a contiguous copy on rank 0).
    wide = torch.zeros(2 * count, dtype=dtype, device=dev)
    d = wide[::2] if rank == 0 else torch.zeros(count, dtype=dtype, device=dev)
    d.copy_(x.to(dev))
    dist.all_reduce(d)
    same("all_reduce strided on rank 0", d, c)

    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        # A product of four values in [-8, 8] needs up to 12 bits, more than
        # bfloat16 holds: the CUDA kernel rounds once (float32 product), the
        # CPU ring at every hop. Factors in [-2, 2] keep every product exact.
        y = x.clamp(-2, 2) if op == dist.ReduceOp.PRODUCT else x
        d, c = y.to(dev), y.clone()
        dist.all_reduce(d, op=op)
        dist.all_reduce(c, op=op)
        same(f"all_reduce {op}", d, c)

    d, c = x.to(dev), x.clone()
    dist.broadcast(d, src=n - 1)
    dist.broadcast(c, src=n - 1)
    same("broadcast", d, c)

    outs_d = [torch.empty_like(x, device=dev) for _ in range(n)]
    outs_c = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(outs_d, x.to(dev))
    dist.all_gather(outs_c, x)
    same("all_gather", torch.cat(outs_d), torch.cat(outs_c))

    big = torch.cat([x] * n)
    d = torch.empty_like(x, device=dev)
    c = torch.empty_like(x)
    dist.reduce_scatter_tensor(d, big.to(dev))
    dist.reduce_scatter_tensor(c, big)
    same("reduce_scatter_tensor", d, c)

    d = torch.empty_like(big, device=dev)
    c = torch.empty_like(big)
    dist.all_to_all_single(d, big.to(dev))
    dist.all_to_all_single(c, big)
    same("all_to_all_single", d, c)

    if n > 1:
        peer = (rank + 1) % n
        src = (rank - 1) % n
        got = torch.empty_like(x, device=dev)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x.to(dev), peer), dist.P2POp(dist.irecv, got, src)]
        )
        for r in reqs:
            r.wait()
        same("send/recv", got, _inputs(src, count, dtype))

    # the future is CUDA-aware: then() sees the copied-back values
    d = x.to(dev)
    fut = dist.all_reduce(d, async_op=True).get_future()
    total = fut.then(lambda f: f.value()[0].sum()).wait()
    c = x.clone()
    dist.all_reduce(c)
    if total.item() != c.sum().item():
        problems.append(f"future.then: {total.item()} != {c.sum().item()}")
    return problems


PATHS = {"ipc": {}, "staged": {"CLAWCOMM_CUDA_IPC": "0"}}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("count", [0, 1, 1001, 1 << 18, 3 << 20])
def test_cuda_collectives_match_the_cpu_engine(path, world_size, dtype, count):
    """Inputs are small integers, so every sum is exact and the CUDA kernels
    (rank order) and the CPU ring (ring order) must agree bit for bit."""
    env = dict(PATHS[path], CLAWCOMM_CUDA_IPC_BYTES=str(1 << 20))  # 3 << 20: several pieces
    for problems in run_ranks(_every_collective, world_size, dtype, count, env=env, timeout=300):
        assert not problems, problems


def _graph_replay(rank, n):
    dev = _device(rank)
    x = torch.zeros(4096, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x)  # warm-up outside the graph: creates the IPC group
    torch.cuda.current_stream().wait_stream(side)
    import clawcomm

    status = clawcomm.backend_of(device="cuda").cuda_ipc_status()
    if status.get(dev.index) != "ok":  # staging needs the host: it cannot be captured
        return True, f"skipped: CUDA IPC unusable here ({status})"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
    got = []
    for step in range(3):
        x.fill_(float(rank + 1 + step))
        g.replay()
        torch.cuda.synchronize()
        got.append(x[:3].tolist())
    want = [[float(sum(r + 1 + step for r in range(n)))] * 3 for step in range(3)]
    return got == want, got


@pytest.mark.parametrize("world_size", [2, 4])
def test_ipc_all_reduce_replays_inside_a_cuda_graph(world_size):
    """The epochs live in device memory, so each replay synchronises afresh."""
    results = run_ranks(_graph_replay, world_size, timeout=300)
    for ok, got in results:
        assert ok, got
    if isinstance(results[0][1], str):
        pytest.skip(results[0][1])


def _wait_polling(work, limit=30.0):
    """Waits for `work` on the host, then raises its error. Polled: torch's
    binding of Work.synchronize keeps the GIL, so no other thread (an abort
    timer) could run meanwhile."""
    start = time.monotonic()
    while not work.is_completed() and time.monotonic() - start < limit:
        time.sleep(0.01)
    work.wait()


def _peer_never_comes(rank, n):
    dev = _device(rank)
    x = torch.ones(1024, device=dev)
    dist.all_reduce(x)  # both ranks: the IPC group exists
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(8)  # rank 0's next all-reduce waits for it in vain, and gives up
        errors = []
    else:
        start = time.monotonic()
        errors = []
        try:  # the kernel gives up at the 5 s timeout
            _wait_polling(dist.all_reduce(x, async_op=True))
            errors.append("no error")
        except RuntimeError as e:
            errors.append(f"{time.monotonic() - start:.1f} s: {e}")
    # Every later call fails, on both ranks: refused at once, or (rank 1,
    # whose call may launch before it learns) its kernel stops on seeing
    # rank 0's failure and the work reports it.
    try:
        _wait_polling(dist.all_reduce(x, async_op=True))
        errors.append("no error")
    except RuntimeError as e:
        errors.append(str(e))
    # No trap: this process's CUDA context is still alive.
    alive = torch.ones(4, device=dev).sum().item() == 4
    return errors, alive


def test_a_peer_that_never_arrives_is_an_error_and_the_context_survives():
    out = run_ranks(_peer_never_comes, 2, pg_timeout=5, timeout=120)
    errors0, alive0 = out[0]
    assert "gave up waiting for rank 1" in errors0[0], errors0
    assert all(e != "no error" for e in errors0 + out[1][0]), out
    assert alive0 and out[1][1], out


def _abort_while_spinning(rank, n):
    dev = _device(rank)
    x = torch.ones(4096, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    start = time.monotonic()
    error = None
    if rank == 0:
        threading.Timer(0.5, dist.distributed_c10d._abort_process_group).start()
        try:
            _wait_polling(dist.all_reduce(x, async_op=True))  # rank 1 never joins
        except RuntimeError as e:
            error = str(e)
    else:
        time.sleep(2)
    took = time.monotonic() - start
    alive = torch.ones(4, device=dev).sum().item() == 4
    return took, error, alive


def test_abort_reaches_the_spinning_kernel():
    """A 60 s timeout: torch's _abort_process_group() on rank 0 stops its
    spinning blocks within a second, its work reports the abort, and the
    CUDA context survives."""
    if not hasattr(dist.distributed_c10d, "_abort_process_group"):
        pytest.skip("this torch has no _abort_process_group")
    out = run_ranks(_abort_while_spinning, 2, pg_timeout=60, timeout=120, allow_failures=True)
    took, error, alive = out[0]
    assert took < 3 and error and "abort" in error, out[0]
    assert alive, out[0]


def _mixed_devices(rank, n):
    out = torch.empty(4 * n, device=_device(rank))
    try:
        dist.all_gather_into_tensor(out, torch.ones(4))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mixing_devices_in_one_call_is_a_clear_error():
    for msg in run_ranks(_mixed_devices, 2, timeout=120):
        assert "cuda:" in msg and "cpu" in msg and "one device" in msg, msg


def _ddp_step(rank, n):
    torch.manual_seed(0)
    dev = _device(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(dev))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(8 * n, 16, generator=g)
        y = torch.randn(8 * n, 4, generator=g)
        mine = slice(8 * rank, 8 * rank + 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[mine].to(dev)), y[mine].to(dev)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    return max(
        (a.detach().cpu() - b.detach()).abs().max().item()
        for a, b in zip(ddp.module.parameters(), ref.parameters(), strict=True)
    )


def test_ddp_on_cuda_matches_single_process_training():
    for err in run_ranks(_ddp_step, 2, timeout=300):
        assert err < 1e-5, err


def _compressed(rank, n, spec):
    from clawcomm.compression import CompressorState, get_compressor

    comp = get_compressor(spec)
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(50_000, generator=g) for _ in range(3)]
    out = {}
    for device in ("cpu", _device(rank)):
        state = CompressorState()
        got = []
        for x in grads:
            t = x.to(device, copy=True)  # all_reduce works in place
            comp.all_reduce(t, state, "w", None)
            got.append(t.cpu())
        out[str(device)[:4]] = got
    # relative to the largest result
    return max(
        ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(out["cpu"], out["cuda"], strict=True)
    )


# fp16/bf16: the CPU ring keeps each rank's own input in float32 where the
# GPU path rounds every input once, then the sum once: a few 16-bit ulps
# (2**-10 and 2**-7 relative) apart at most.
TOLERANCE = {"fp16": 2**-8, "bf16": 2**-5, "powersgd:2": 1e-4}


@pytest.mark.parametrize(
    "spec",
    ["fp16", "bf16", "topk:0.01", "topk:0.01:exact", "randomk:0.01", "int8", "int4", "qsgd:2",
     "terngrad", "sign", "dgc:0.01", "threshold:2.5", "powersgd:2"],
)  # fmt: skip
def test_compressors_on_cuda_tensors_match_the_cpu(spec):
    """Three steps with error feedback: the CUDA kernels select the same
    entries and write the same codes as the CPU ones, so the sums agree (up
    to summation order; PowerSGD's products up to cuBLAS's rounding)."""
    for err in run_ranks(_compressed, 2, spec, timeout=300):
        assert err < TOLERANCE.get(spec, 1e-6), (spec, err)


def _data_parallel_cuda(rank, n, compression):
    from clawcomm.parallel import DataParallel

    torch.manual_seed(0)
    dev = _device(rank)
    base = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ref.load_state_dict(base.state_dict())
    dp = DataParallel(
        base.to(dev), bucket_cap_mb=0.002, first_bucket_mb=0.001, compression=compression
    )
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = torch.randn(6 * n, 16, generator=g), torch.randn(6 * n, 4, generator=g)
        mine = slice(6 * rank, 6 * rank + 6)
        torch.nn.functional.mse_loss(dp(x[mine].to(dev)), y[mine].to(dev)).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max(
        (a.detach().cpu() - b.detach()).abs().max().item()
        for a, b in zip(dp.parameters(), ref.parameters(), strict=True)
    )


@pytest.mark.parametrize("compression,atol", [(None, 1e-5), ("fp16", 2e-3)])
def test_data_parallel_on_cuda_matches_single_process_training(compression, atol):
    """Buckets on the GPU, reduced through the CUDA path while backward runs."""
    for err in run_ranks(_data_parallel_cuda, 2, compression, timeout=300):
        assert err < atol, err


def _sends_and_receives(rank, n):
    """Each rank sends to the next and receives from the one before, in one
    batch (crossed on 2 ranks), then into a non-contiguous tensor."""
    import clawcomm

    dev = _device(rank)
    to, frm = (rank + 1) % n, (rank - 1) % n
    ok = []
    for i, count in enumerate([0, 1, 1001, 3 << 20, 20 << 20]):  # the last fits no ring: staged
        x = _inputs(10 * rank + i, count, torch.float32).to(dev)
        y = torch.full((count,), -1.0, device=dev)
        ops = [dist.P2POp(dist.isend, x, to, tag=i), dist.P2POp(dist.irecv, y, frm, tag=i)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        ok.append(torch.equal(y.cpu(), _inputs(10 * frm + i, count, torch.float32)))
    z = torch.zeros(64, 8, device=dev).t()  # non-contiguous
    x = torch.arange(512.0, device=dev) + rank
    if rank % 2 == 0:
        dist.send(x, to, tag=99)
        dist.recv(z, frm, tag=99)
    else:
        dist.recv(z, frm, tag=99)
        dist.send(x, to, tag=99)
    want = (torch.arange(512.0) + frm).view(8, 64)
    ok.append(torch.equal(z.cpu(), want))
    torch.cuda.synchronize()
    sends = clawcomm.engine_of(device="cuda").comm_stats()["send"]
    return ok, sends["payload_bytes_sent"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("p2p_bytes", ["0", str(64 << 20)])
def test_cuda_sends_and_receives_arrive_whole(world_size, p2p_bytes):
    """Through the CUDA IPC rings (CLAWCOMM_CUDA_P2P_BYTES) or staged."""
    env = {"CLAWCOMM_CUDA_P2P_BYTES": p2p_bytes}
    for ok, sent in run_ranks(_sends_and_receives, world_size, env=env, timeout=300):
        assert all(ok), ok
        assert sent >= 4 * (1001 + (3 << 20) + (20 << 20)), sent


def _posted_before_the_send(rank, n):
    """1f1b's pattern: each rank posts its receive, then computes what its
    peer waits for, then sends it. A receive launched when posted waits in
    the GPU's queues, and the compute queued after it may be held behind
    it on both ranks (the 1f1b hang seen on an H200)."""
    dev = _device(rank)
    peer = 1 - rank
    got = torch.full((1 << 18,), -1.0, device=dev)
    ok = []
    for step in range(20):
        recv = dist.irecv(got, peer, tag=step)
        mine = torch.full((1 << 18,), float(rank + 1), device=dev)
        for _ in range(8):  # compute queued after the receive was posted
            mine = mine * 2.0 - mine
        send = dist.isend(mine, peer, tag=step)
        recv.wait()
        send.wait()
        ok.append(bool((got == float(peer + 1)).all()))
    torch.cuda.synchronize()
    return ok


def test_a_receive_posted_before_the_compute_its_peer_needs_does_not_hang():
    env = {"CLAWCOMM_CUDA_P2P_BYTES": str(64 << 20)}
    for ok in run_ranks(_posted_before_the_send, 2, env=env, timeout=120, pg_timeout=60):
        assert all(ok), ok


def _train_on(rank, n, cfg):
    from clawcomm.train.cli import train_rank

    metrics = train_rank(cfg, announce=False)
    return [m["loss"] for m in metrics], [m.get("max_gpu_mem_mb") for m in metrics], metrics[-1]


TRAIN = dict(model="gpt", dim=32, heads=2, layers=2, seq_len=16, lr=3e-3, lr_decay="none",
             steps=4, quiet=True, microbatches=4)  # fmt: skip


@pytest.mark.parametrize(
    "layout,env",
    [
        (dict(dp=2, pp=1), {}),
        (dict(dp=1, pp=2, schedule="1f1b"), {}),
        (dict(dp=2, pp=2, schedule="zb1", compression="fp16"), {}),
        (dict(dp=2, pp=1), {"CLAWCOMM_CUDA_IPC": "0"}),
        (dict(dp=1, pp=2, schedule="interleaved", virtual_stages=2), {}),
        (dict(dp=1, pp=2, schedule="1f1b"), {"CLAWCOMM_CUDA_P2P_BYTES": "0"}),
        (dict(dp=2, pp=2, schedule="1f1b", zero=1), {}),
        (dict(dp=2, pp=2, schedule="gpipe", zero=2, accumulation=2), {}),
        (dict(dp=2, pp=1, zero=3), {}),
        # async parameter gathers and a compressed reducer's sync calls on one group
        (dict(dp=2, pp=1, zero=3, compression="fp16", overlap=False), {}),
    ],
)
def test_the_trainer_on_cuda_follows_the_cpu_run(layout, env):
    """Same seed, same loss curve within float tolerance, on cuda:rank % GPUs
    through CUDA IPC (or staged); every rank reports its peak GPU memory."""
    from clawcomm.train import TrainConfig

    world = layout["dp"] * layout["pp"]
    cpu = run_ranks(_train_on, world, TrainConfig(**TRAIN, **layout, device="cpu"), timeout=300)
    gpu = run_ranks(
        _train_on, world, TrainConfig(**TRAIN, **layout, device="cuda"), env=env, timeout=300
    )
    want = cpu[0][0]
    for losses, peaks, last in gpu:
        assert losses == pytest.approx(want, rel=1e-3), (losses, want)
        assert all(p is not None and p > 0 for p in peaks), peaks
        # the CUDA IPC buffers count in max_memory_mb (none when staged)
        assert (last["comm_device_bytes"] > 0) == (env.get("CLAWCOMM_CUDA_IPC") != "0"), last
