"""Bad arguments fail on the rank that passed them, naming the operation and
the wrong value, before any byte is sent: the group still works after."""

from __future__ import annotations

import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks


def _bad_arguments(rank, ws):
    messages = {}

    def expect(name, fn):
        try:
            fn()
            messages[name] = "no error"
        except (ValueError, RuntimeError) as e:
            messages[name] = f"{type(e).__name__}: {e}"

    expect("output size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)))
    expect(
        "mixed dtypes",
        lambda: dist.all_gather([torch.empty(2), torch.empty(2).double()], torch.ones(2)),
    )
    expect("sparse", lambda: dist.broadcast(torch.ones(3).to_sparse(), 0))
    # torch routes a non-cpu tensor to that device's backend before we see it
    # (no CUDA here anyway), so call the backend object directly.
    from clawcomm import backend_of

    expect("device", lambda: backend_of().allreduce([torch.ones(3, device="meta")]))
    expect(
        "avg on ints", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), dist.ReduceOp.AVG)
    )
    expect("band on floats", lambda: dist.all_reduce(torch.ones(3), dist.ReduceOp.BAND))
    expect("dtype", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)))

    def bad_root():
        opts = dist.BroadcastOptions()
        opts.rootRank = 5
        dist.group.WORLD.broadcast([torch.ones(1)], opts)

    expect("root", bad_root)
    expect(
        "split sizes", lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [1, 1], [3, 3])
    )
    expect(
        "unsupported op",
        lambda: backend_of().allocate_tensor(4, dtype=torch.float32, device=torch.device("cpu")),
    )
    # Nothing was sent by any of those: the group still works.
    t = torch.ones(2)
    dist.all_reduce(t)
    messages["after"] = t.tolist()
    return messages


def test_bad_arguments_fail_clearly_before_sending():
    m = run_ranks(_bad_arguments, 2)[0]
    assert (
        "clawcomm::all_gather_into_tensor" in m["output size"] and "3 elements" in m["output size"]
    )
    assert "dtypes" in m["mixed dtypes"], m["mixed dtypes"]  # torch may reject it first
    assert "dense" in m["sparse"] or "sparse" in m["sparse"].lower(), m["sparse"]
    assert "meta" in m["device"] and "cpu" in m["device"], m["device"]
    assert "avg" in m["avg on ints"] and "int32" in m["avg on ints"], m["avg on ints"]
    assert "band" in m["band on floats"], m["band on floats"]
    assert "clawcomm::allreduce" in m["dtype"] and "Short" in m["dtype"], m["dtype"]
    assert "root 5" in m["root"], m["root"]
    assert "split sizes" in m["split sizes"], m["split sizes"]
    assert "clawcomm" in m["unsupported op"] and "support" in m["unsupported op"], m[
        "unsupported op"
    ]
    assert m["after"] == [2.0, 2.0]


def _wide_roots(rank, n):
    t = torch.ones(4)
    messages = []
    for call in (
        lambda: dist.broadcast(t, src=2**32 + 1),
        lambda: dist.reduce(t, dst=2**32),
        lambda: dist.broadcast(t, src=-1),
    ):
        try:
            call()
            messages.append("no error")
        except (ValueError, RuntimeError) as e:
            messages.append(str(e))
    dist.all_reduce(t)  # the group still works
    return messages, t.tolist()


def test_a_root_is_checked_before_it_is_narrowed_to_an_int():
    """2**32 + 1 used to become rank 1: a silently wrong broadcast."""
    for messages, after in run_ranks(_wide_roots, 2, timeout=60):
        assert all("out of range" in m for m in messages), messages
        assert after == [2.0] * 4
