"""The families that make a job fail: kill, mismatch, settings, timeout."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from .harness import SLACK, TIMEOUT, Score, join_group, run_trial, segments

# --- kill -----------------------------------------------------------------


def _kill_trial(rank, ws, store_path, victim, start_at, delay, count):
    import torch
    import torch.distributed as dist

    from clawcomm._torch_names import all_gather_single

    time.sleep(max(0.0, start_at - time.time()))
    # A rank spawned late on a loaded machine starts past start_at: it cannot
    # notice a death before it starts looking, so its clock runs from then.
    began = time.time()
    killed_at = start_at + delay
    if rank == victim:
        threading.Timer(max(0.0, killed_at - began), os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        join_group(rank, ws, store_path)
        x = torch.ones(count)
        gathered = torch.empty(count * ws)
        i = 0
        while time.time() < killed_at + TIMEOUT + 2 * SLACK:
            # An all-reduce, a broadcast from each root in turn and an
            # all-gather: at 4 MiB on shared memory the last two go by single
            # copy (the broadcast from 3 ranks, direct), so the victim may die
            # while a peer reads its memory.
            if i % 3 == 0:
                dist.all_reduce(x)
            elif i % 3 == 1:
                dist.broadcast(x, (i // 3) % ws)
            else:
                all_gather_single(gathered, x)
            x.fill_(1.0)
            i += 1
        return ("no error", 0.0)
    except Exception as e:  # noqa: BLE001
        return (str(e), time.time() - max(killed_at, began))


def kill(trials: int, seed: int = 0) -> Score:
    score = Score("kill")
    rng = random.Random(seed)
    for _ in range(trials):
        ws = rng.choice([2, 3, 4])
        env = {"CLAWCOMM_TRANSPORT": rng.choice(["shm", "tcp"])}
        victim, delay = rng.randrange(ws), rng.uniform(0.0, 0.15)
        # 16 KiB, or 4 MiB, whose broadcast and all-gather frames go by
        # single copy on shared memory (see _kill_trial).
        count = rng.choice([4096, 1 << 20])
        before = segments()
        results, hung = run_trial(_kill_trial, ws, victim, time.time() + 0.3, delay, count, env=env)
        survivors = [r for p, r in enumerate(results) if p != victim]
        good = all(
            isinstance(r, tuple) and r[0] != "no error" and r[1] <= TIMEOUT + SLACK
            for r in survivors
        )
        leak = bool(segments() - before)
        score.add(good, hang=hung, leak=leak, note=f"{env} ws={ws} count={count} {survivors}")
    return score


# --- mismatch ---------------------------------------------------------------

MISMATCHES = ["op", "size", "dtype", "root", "redop", "skipped"]


def _mismatch_trial(rank, ws, store_path, kind, odd):
    import torch
    import torch.distributed as dist

    from clawcomm._torch_names import all_gather_single

    join_group(rank, ws, store_path)
    t = torch.ones(64)
    me = rank == odd
    start = time.monotonic()
    try:
        if kind == "op":
            dist.broadcast(t, 0) if me else dist.all_reduce(t)
        elif kind == "size":
            dist.all_reduce(torch.ones(65) if me else t)
        elif kind == "dtype":
            dist.all_reduce(t.double() if me else t)
        elif kind == "root":
            dist.broadcast(t, (odd + 1) % ws if me else odd)
        elif kind == "redop":
            dist.all_reduce(t, dist.ReduceOp.MAX if me else dist.ReduceOp.SUM)
        elif kind == "skipped":
            if not me:
                dist.all_reduce(t)
            all_gather_single(torch.empty(64 * ws), t)
        dist.all_reduce(t)  # and the next call: it must not slip through either
        return ("no error", time.monotonic() - start)
    except Exception as e:  # noqa: BLE001
        return (str(e), time.monotonic() - start)


def mismatch(trials: int, seed: int = 0) -> Score:
    score = Score("mismatch")
    rng = random.Random(seed)
    named = 0
    for i in range(trials):
        kind = MISMATCHES[i % len(MISMATCHES)]
        ws = rng.choice([2, 3])
        odd = rng.randrange(ws)
        env = {"CLAWCOMM_TRANSPORT": rng.choice(["shm", "tcp"])}
        results, hung = run_trial(_mismatch_trial, ws, kind, odd, env=env)
        texts = [r[0] for r in results if isinstance(r, tuple)]
        good = len(texts) == ws and all(
            t != "no error" and e <= TIMEOUT + SLACK for t, e in (r for r in results)
        )
        # "rank A called X, rank B called Y", on the rank that saw both frames
        named += any(" called " in t for t in texts)
        score.add(good, hang=hung, note=f"{kind} ws={ws} odd={odd}: {texts}")
    score.extra["named both sides"] = named
    return score


# --- settings and arguments -------------------------------------------------

NUMERIC_SETTINGS = [
    "CLAWCOMM_SHM_RING_BYTES", "CLAWCOMM_SEGMENT_BYTES", "CLAWCOMM_INLINE_BYTES",
    "CLAWCOMM_TREE_MAX_BYTES", "CLAWCOMM_SPIN_US", "CLAWCOMM_YIELD_US",
    "CLAWCOMM_RECORDER_ENTRIES", "CLAWCOMM_PROGRESS_NICE", "CLAWCOMM_CUDA_IPC_BYTES",
    "CLAWCOMM_CUDA_ONESHOT_BYTES",
]  # fmt: skip
NONSENSE = ["-1", "abc", "1e9", " 5", "5 ", "0x10", "18446744073709551616", "99999999999999999999"]
CHOICE_SETTINGS = {
    "CLAWCOMM_TRANSPORT": "udp",
    "CLAWCOMM_ALGO": "bogus",
    "CLAWCOMM_SIMD": "avx9000",
    "CLAWCOMM_CUDA_IPC": "maybe",
}


def _settings_trial(rank, ws, store_path, cases):
    """In one process: each case sets one variable and creates a group; it
    must fail at creation, naming the variable."""
    import torch.distributed as dist

    out = []
    for i, (var, value) in enumerate(cases):
        os.environ[var] = value
        try:
            join_group(rank, ws, store_path, prefix=f"case-{i}/")
            dist.destroy_process_group()
            out.append((var, value, "accepted"))
        except Exception as e:  # noqa: BLE001
            out.append((var, value, "named" if var in str(e) else f"unclear: {e}"))
        finally:
            del os.environ[var]
    return out


def _arguments_trial(rank, ws, store_path):
    """Arguments at their limits: each must be refused before any byte is
    sent, and the group must still work afterwards."""
    import torch
    import torch.distributed as dist

    from clawcomm._torch_names import all_gather_single

    join_group(rank, ws, store_path)
    x = torch.ones(8)
    cases = {
        "root 2**32+1": lambda: dist.broadcast(x, 2**32 + 1),
        "root -1": lambda: dist.broadcast(x, -1),
        "root = size": lambda: dist.reduce(x, ws),
        "peer = size": lambda: dist.send(x, ws),
        "uneven split": lambda: dist.all_to_all_single(torch.empty(8), x, [9] * ws, [1] * ws),
        "wrong output size": lambda: all_gather_single(torch.empty(3), x),
        "int16 dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16)),
        "unsigned 16-bit dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16)),
    }
    out = []
    for name, call in cases.items():
        try:
            call()
            out.append((name, "accepted"))
        except Exception:  # noqa: BLE001  (torch's own checks may come first: also refused)
            out.append((name, "refused"))
    # Limits that must work, and give the right values.
    out_t = torch.empty(8, ws).t()  # a strided output
    all_gather_single(out_t, torch.full((8,), float(rank + 1)))
    want = torch.arange(1, ws + 1, dtype=torch.float32).repeat_interleave(8).reshape(ws, 8)
    out.append(("strided output", "ok" if torch.equal(out_t, want) else "wrong"))
    empty = torch.ones(0)
    dist.all_reduce(empty)
    out.append(("empty tensor", "ok" if empty.numel() == 0 else "wrong"))
    y = torch.full((8,), float(rank + 1))
    dist.all_reduce(y)
    out.append(("still works", "ok" if y[0].item() == ws * (ws + 1) / 2 else "wrong"))
    return out


def _parsed(var: str, value: str) -> tuple[str, str, str]:
    """One case through the engine's own reading of the settings (what a
    group's creation reads first), in this process."""
    from clawcomm import _C

    os.environ[var] = value
    try:
        _C._check_settings()
        return var, value, "accepted"
    except ValueError as e:
        return var, value, "named" if var in str(e) else f"unclear: {e}"
    finally:
        del os.environ[var]


def settings(trials: int = 1, seed: int = 0) -> Score:
    """Every numeric setting with every nonsense value, and every choice
    setting with a wrong choice, through the engine's reading of the
    settings; and through a group's creation on two ranks, each setting and
    each nonsense value at least once (every numeric setting goes through
    the same reader, so the whole matrix there would only repeat it)."""
    score = Score("settings")
    matrix = [(v, x) for v in NUMERIC_SETTINGS for x in NONSENSE] + list(CHOICE_SETTINGS.items())
    width = max(len(NUMERIC_SETTINGS), len(NONSENSE))
    cases = [(NUMERIC_SETTINGS[i % len(NUMERIC_SETTINGS)], NONSENSE[i % len(NONSENSE)])
             for i in range(width)] + list(CHOICE_SETTINGS.items())  # fmt: skip
    for _ in range(trials):
        for r in (_parsed(var, value) for var, value in matrix):
            score.add(r[2] == "named", wrong=r[2] == "accepted", note=str(r))
        results, hung = run_trial(_settings_trial, 2, cases, limit=300)
        for r in results[0] if isinstance(results[0], list) else []:
            score.add(r[2] == "named", hang=hung, wrong=r[2] == "accepted", note=str(r))
        results, hung = run_trial(_arguments_trial, 2)
        for r in results[0] if isinstance(results[0], list) else []:
            ok = r[1] in ("refused", "ok")
            score.add(ok, hang=hung, wrong=r[1] in ("accepted", "wrong"), note=str(r))
    return score


# --- timeout, then a clean exit ----------------------------------------------


def _timeout_trial(rank, ws, store_path):
    import torch
    import torch.distributed as dist

    join_group(rank, ws, store_path)
    start = time.monotonic()
    error = "no error"
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(16))
        except Exception as e:  # noqa: BLE001
            error = str(e)
    else:
        time.sleep(TIMEOUT + 0.5)  # never calls
    elapsed = time.monotonic() - start
    dist.destroy_process_group()
    return error, elapsed


def timeout(trials: int, seed: int = 0) -> Score:
    import subprocess
    import sys

    score = Score("timeout")
    code = (
        "from clawcomm.testing.chaos.failures import run_trial, _timeout_trial\n"
        "results, hung = run_trial(_timeout_trial, 2)\n"
        "print(repr(results[0]), hung)\n"
    )
    for _ in range(trials):
        before = segments()
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        ok = p.returncode == 0 and "timed out" in p.stdout and "False" in p.stdout
        score.add(ok, leak=bool(segments() - before), note=p.stdout + p.stderr[-300:])
    return score
