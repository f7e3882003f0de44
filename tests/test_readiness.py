"""When a gradient is final is GradReducer's rule alone: it hears which
action runs, counts the final contributions in the first step, lays its
buckets out in rank 0's order, launches each bucket on its last expected
contribution from the second step, refuses more than it learned, and keeps
what it learned through its state_dict."""

from __future__ import annotations

import torch

from clawcomm.launch import run_ranks
from clawcomm.parallel.reducer import GradReducer
from clawcomm.pipeline.weight_grad import notify_grad


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(300_000)) for _ in range(3)]  # a bucket each


def _contribute(reducer, action, params, final_round=True):
    """``action`` runs and gives each of ``params`` one contribution."""
    reducer.begin_action(action, final_round)
    for p in params:
        p.grad.add_(1.0)  # in its bucket, as autograd accumulates
        notify_grad(p)
    reducer.end_action(action)


def _readiness(rank, world):
    params = _params()
    r = GradReducer(params, bucket_cap_mb=1, first_bucket_mb=1, names=["a", "b", "c"])
    r.track_final_grads({"B1", "W1"})
    launched = []
    launch = r._launch
    r._launch = lambda bucket: (launched.append(bucket.params), launch(bucket))
    r.attach_grads()
    out = {}
    # Step 1: "B0" is not final, nor is a final action in an earlier round;
    # "B1" and "W1" are: c twice, b once, a never. Nothing launches early.
    _contribute(r, "B0", params)
    _contribute(r, "B1", params, final_round=False)
    _contribute(r, "B1", [params[2], params[1]])
    _contribute(r, "W1", [params[2]])
    out["early"] = list(launched)
    r.finish()
    out["expected"] = list(r.expected)
    out["order"] = [i for b in r.buckets for i in b.params]
    out["overlap"] = r.overlap
    # Step 2: b's bucket leaves on b's one mark; c's on its second.
    launched.clear()
    _contribute(r, "B1", [params[2]])
    out["after c once"] = list(launched)
    _contribute(r, "B1", [params[1]])
    out["after b"] = list(launched)
    _contribute(r, "W1", [params[2]])
    out["after c twice"] = list(launched)
    r.finish()
    # A third contribution to c: its stage's control flow changed.
    _contribute(r, "B1", [params[2]])
    _contribute(r, "W1", [params[2]])
    try:
        _contribute(r, "W1", [params[2]])
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    r.finish()
    # What it learned survives a checkpoint.
    fresh = GradReducer(_params(), bucket_cap_mb=1, first_bucket_mb=1)
    fresh.track_final_grads({"B1", "W1"})
    fresh.load_state_dict(r.state_dict())
    out["restored"] = (
        fresh.learned, fresh.expected, [i for b in fresh.buckets for i in b.params], fresh.overlap
    )  # fmt: skip
    r.close()
    fresh.close()
    return out


def test_the_reducer_learns_when_each_gradient_is_final():
    for out in run_ranks(_readiness, 2):
        assert out["early"] == []
        assert out["expected"] == [0, 1, 2]
        assert out["order"] == [2, 1, 0]  # the order of first final marks, then the rest
        assert out["overlap"] is True  # counted without overlap, launched with it after
        assert out["after c once"] == []  # the bucket in launch order first is c's
        assert out["after b"] == []
        assert out["after c twice"] == [[2], [1], [0]]  # a expects nothing: it follows
        assert "parameter 'c' received more final gradient contributions (3)" in out["error"]
        assert out["restored"] == (True, [0, 1, 2], [2, 1, 0], True)


def test_contributions_are_heard_from_autograd_device_threads():
    # Autograd runs the post-accumulate hooks of CUDA tensors on its device
    # thread, not on the thread that called backward: the listener the
    # reducer sets must hear them there too.
    import threading

    from clawcomm.pipeline.weight_grad import set_listener

    heard = []
    p = torch.nn.Parameter(torch.zeros(1))
    set_listener(heard.append)
    try:
        t = threading.Thread(target=notify_grad, args=(p,))
        t.start()
        t.join()
    finally:
        set_listener(None)
    notify_grad(p)  # no listener: nobody hears
    assert heard == [p]
