"""clawcomm's engine called directly on numpy arrays (clawcomm.engine_of),
below torch's dispatch: every collective against local values, the dtypes a
numpy buffer can carry (bfloat16 as uint16), and argument errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import clawcomm
from clawcomm import _C
from clawcomm.launch import run_ranks


def _input(rank, count, dtype):
    return ((np.arange(count) * 3 + rank * 5) % 17).astype(dtype)


def _every_op(rank, n, dtype):
    eng = clawcomm.engine_of()
    assert (eng.rank, eng.size) == (rank, n)
    problems = []

    def check(name, got, want):
        if not np.array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64)):
            problems.append(f"{name} {dtype}: got {got[:6]}, want {want[:6]}")

    for count in (0, 1, 7, 1000, 300_000):
        ins = [_input(r, count, dtype) for r in range(n)]
        buf = ins[rank].copy()
        eng.all_reduce(buf)
        check("all_reduce", buf, np.sum(ins, axis=0, dtype=np.float64))
        buf = ins[rank].copy()
        eng.all_reduce(buf, op="max")
        check("all_reduce max", buf, np.max(ins, axis=0))
        buf = ins[rank].copy()
        eng.broadcast(buf, root=n - 1)
        check("broadcast", buf, ins[n - 1])
        buf = ins[rank].copy()
        eng.reduce(buf, root=0, op="min")
        check("reduce", buf, np.min(ins, axis=0) if rank == 0 else ins[rank])
        out = np.empty(count * n, dtype)
        eng.all_gather(ins[rank], out)
        check("all_gather", out, np.concatenate(ins))
        big = [np.tile(x, n) for x in ins]
        out = np.empty(count, dtype)
        eng.reduce_scatter(big[rank], out)
        check("reduce_scatter", out, np.sum(ins, axis=0, dtype=np.float64))
        out = np.empty(count * n, dtype)
        eng.all_to_all(big[rank], out)
        check("all_to_all", out, np.concatenate([ins[p] for p in range(n)]))
        if n > 1:
            out = np.empty(count, dtype)
            eng.sendrecv(ins[rank], (rank + 1) % n, out, (rank - 1) % n, tag=count)
            check("sendrecv", out, ins[(rank - 1) % n])
    eng.barrier()
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8"])
def test_every_op_on_numpy(world_size, dtype):
    problems = [p for r in run_ranks(_every_op, world_size, dtype) for p in r]
    assert not problems, "\n".join(problems[:20])


def _bfloat16(rank, n):
    eng = clawcomm.engine_of()
    x = torch.full((9,), 1.5 + rank, dtype=torch.bfloat16)
    eng.all_reduce(x.view(torch.int16).numpy(), dtype="bfloat16")
    return x.float().tolist()


def test_bfloat16_through_a_uint16_view():
    assert run_ranks(_bfloat16, 2) == [[4.0] * 9] * 2


def _mixed_with_torch_calls(rank, n):
    """The engine shares the group's issue order with torch calls."""
    import torch.distributed as dist

    eng = clawcomm.engine_of()
    a = np.full(5, rank + 1.0, np.float32)
    t = torch.full((5,), rank + 1.0)
    for _ in range(20):
        eng.all_reduce(a)
        dist.all_reduce(t)
    return float(a[0]), float(t[0])


def test_engine_and_torch_calls_interleave():
    # 3 ranks: every all-reduce multiplies each value's sum by 3 (6, 18, ...).
    out = run_ranks(_mixed_with_torch_calls, 3)
    assert out[0] == out[1] == out[2]
    assert out[0][0] == pytest.approx(6.0 * 3.0**19, rel=1e-6)


def _bad_arguments(rank, n):
    eng = clawcomm.engine_of()
    messages = []
    cases = [
        lambda: eng.all_gather(np.zeros(3, np.float32), np.zeros(5, np.float32)),
        lambda: eng.reduce_scatter(np.zeros(5, np.float32), np.zeros(3, np.float32)),
        lambda: eng.all_to_all(np.zeros(5, np.float32), np.zeros(5, np.float32)),
        lambda: eng.all_reduce(np.zeros((4, 4), np.float32)[:, ::2]),
        lambda: eng.all_reduce(np.zeros(3, np.complex64)),
        lambda: eng.all_reduce(np.zeros(3, np.float32), op="mean"),
        lambda: eng.all_reduce(np.zeros(3, np.float32), op="band"),
        lambda: eng.broadcast(np.zeros(3, np.float32), root=7),
        lambda: eng.all_gather(np.zeros(3, np.float32), np.zeros(6, np.float64)),
        lambda: eng.send(np.zeros(3, np.float32), dst=rank),
    ]
    for case in cases:
        try:
            case()
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    # Still usable after every rejected call: nothing was sent.
    a = np.ones(4, np.float32)
    eng.all_reduce(a)
    messages.append(float(a[0]))
    return messages


def test_bad_arguments_raise_value_error_before_sending():
    messages = run_ranks(_bad_arguments, 2)[0]
    expect = [
        "clawcomm::all_gather: input has 3 elements, output 5",
        "clawcomm::reduce_scatter: input has 5 elements, output 3",
        "clawcomm::all_to_all: input has 5 elements, output 5 (both must be the same multiple of 2",
        "clawcomm::all_reduce: buffer is not C-contiguous",
        "clawcomm::all_reduce: buffer format 'Zf' is not a supported element type",
        "clawcomm::all_reduce: unknown reduce op 'mean'",
        "clawcomm::all_reduce: reduce op band is not defined on float32",
        "clawcomm::broadcast: root 7 is out of range for a group of 2 ranks",
        "clawcomm::all_gather: input is float32 but output is float64",
        "clawcomm::send: rank 0 cannot send to itself",
    ]
    for got, want in zip(messages, expect, strict=False):
        assert want in got, (got, want)
    assert messages[-1] == 2.0


def _read_only(rank, n):
    eng = clawcomm.engine_of()
    a = np.zeros(3, np.float32)
    a.setflags(write=False)
    with pytest.raises(ValueError, match="clawcomm::all_reduce: buffer is not a writable buffer"):
        eng.all_reduce(a)
    return True


def test_read_only_output_is_refused():
    assert run_ranks(_read_only, 2) == [True, True]


def _timeout(rank, n):
    import datetime

    import torch.distributed as dist

    group = dist.new_group(backend="clawcomm", timeout=datetime.timedelta(seconds=1))
    eng = clawcomm.engine_of(group)
    if rank == 0:
        with pytest.raises(
            TimeoutError, match="clawcomm::recv: timed out waiting for rank 1 to send 4 bytes"
        ):
            eng.recv(np.zeros(4, np.uint8), src=1)
    dist.barrier()
    return True


def test_timeout_is_a_timeout_error():
    assert run_ranks(_timeout, 2) == [True, True]


def test_engine_module_builds_and_runs_without_torch():
    """clawcomm._C (engine, kernels, codecs) never loads torch: only the
    adapter, clawcomm._C_torch, does."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, clawcomm\n"
        "from clawcomm import _C\n"
        "a = np.ones(5, np.float32); _C.kernels.reduce(a, np.full(5, 2, np.float32))\n"
        "assert a.tolist() == [3.0] * 5, a\n"
        "assert clawcomm.__all__ == [], clawcomm.__all__\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    from clawcomm import _C

    with open(_C.__file__, "rb") as f:
        assert b"libtorch" not in f.read(), "clawcomm._C links against torch"


def test_stub_covers_every_public_name():
    """clawcomm/_C.pyi documents the module: every public function and class
    of _C and its submodules is in it (regenerate with pybind11-stubgen)."""
    import ast
    import pathlib

    from clawcomm import _C

    tree = ast.parse(pathlib.Path(_C.__file__).with_name("_C.pyi").read_text())
    stub = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    for name in dir(_C):
        obj = getattr(_C, name)
        if name.startswith("__") or not callable(obj) and not hasattr(obj, "__dict__"):
            continue
        assert name in stub, f"clawcomm._C.{name} is missing from _C.pyi"
        if name in ("kernels", "compress"):
            have = {f.name for f in stub[name].body if isinstance(f, ast.FunctionDef)}
            missing = {f for f in dir(obj) if not f.startswith("_")} - have
            assert not missing, f"clawcomm._C.{name}: {sorted(missing)} missing from _C.pyi"


def test_missing_optional_dependency_names_feature_and_extra():
    import sys

    from clawcomm._optional import require

    saved = sys.modules.get("matplotlib")
    sys.modules["matplotlib"] = None  # as if it were not installed
    try:
        with pytest.raises(ImportError, match=r"bench --plot needs matplotlib.*clawcomm\[plot\]"):
            require("matplotlib", "clawcomm bench --plot")
    finally:
        if saved is None:
            del sys.modules["matplotlib"]
        else:
            sys.modules["matplotlib"] = saved


def test_the_backend_names_every_all_reduce_algorithm_it_can_return():
    """all_reduce_algorithm's docstring (binding and stub) lists the table's
    all-reduce algorithms; it once left 'hierarchical' out."""
    from clawcomm import _C_torch

    algos = [name for op, name in _C._algorithm_table() if op == "all_reduce"]
    doc = _C_torch.ClawcommBackend.all_reduce_algorithm.__doc__
    stub = (Path(__file__).parent.parent / "clawcomm" / "_C_torch.pyi").read_text()
    for name in algos:
        assert f"'{name}'" in doc, doc
        assert f"'{name}'" in stub.split("def all_reduce_algorithm")[1].split('"""')[1]
