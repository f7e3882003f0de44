"""The chaos families: a job is attacked the way real jobs fail, and every
trial is scored. tests/chaos/ runs each family a few times in CI;
bench/chaos.py runs them long and writes the scorecard docs/reliability.md shows.

Each family returns a :class:`Score`: trials, how many ended as they must
(an error on every rank that had to fail, within the group's timeout + 1 s,
or a correct result), hangs (a rank still running at the harness's limit),
leaks (a shared-memory segment of the job left in /dev/shm) and wrong
results (a collective that returned a wrong value instead of failing).

Families:
  kill      SIGKILL of a random rank at a random moment, setup included,
            over shm and TCP, 2 to 4 ranks, with messages small or large
            enough to go by single copy.
  mismatch  one rank calls another collective: op, size, dtype, root,
            reduce op, or skips a call.
  settings  every numeric CLAWCOMM_* setting given nonsense, and arguments
            at their limits: refused at setup, or before any byte is sent.
  timeout   one rank stops calling; the other times out, then both destroy
            the group and exit cleanly.
  soak      random collectives on 2 ranks, results checked; RSS and open file
            descriptors sampled.
  storm     hostile clients (empty, random bytes, a wrong token, a cut-short
            hello, absurd frame lengths) against rank 0's listener while the
            group sets up (rank 1 connects only after 1 s of it), then against
            the job's ports while it runs (the listener is closed by then:
            the kernel refuses them); results checked, stalls timed.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import random
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

TIMEOUT = 3.0  # the group's timeout in every trial (s)
SLACK = 1.0  # an error must come within TIMEOUT + SLACK of its cause
# The soak's limit on the resident set's growth after warm-up (%). Sampled
# after malloc_trim, a flat process stays within 0.02% (2 ranks, 20,000 ops).
SOAK_RSS_GROWTH_LIMIT = 0.25


@dataclass
class Score:
    family: str
    trials: int = 0
    ok: int = 0
    hangs: int = 0
    leaks: int = 0
    wrong: int = 0
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def add(self, ok: bool, *, hang=False, leak=False, wrong=False, note: str | None = None):
        self.trials += 1
        self.ok += ok and not (hang or leak or wrong)
        self.hangs += hang
        self.leaks += leak
        self.wrong += wrong
        if note and len(self.notes) < 5 and not ok:
            self.notes.append(note)

    @property
    def perfect(self) -> bool:
        return self.trials > 0 and self.ok == self.trials

    def line(self) -> str:
        extra = "".join(f", {k} {v}" for k, v in self.extra.items())
        return (
            f"{self.family:9s} trials {self.trials:5d}  as required {self.ok:5d}  "
            f"hangs {self.hangs}  leaks {self.leaks}  wrong results {self.wrong}{extra}"
        )


def segments() -> set[str]:
    """The clawcomm shared-memory segments in /dev/shm."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("clawcomm-")}


def slow_to_read_addresses(store, seconds: float):
    """Wraps a c10d store so that this rank waits `seconds` before it first
    reads a peer's TCP address: the peer's listener stays open (and exposed)
    that long during setup."""
    import torch.distributed as dist

    class Slow(dist.Store):
        def __init__(self):
            super().__init__()
            self.waited = False

        def set(self, key, value):
            store.set(key, value)

        def get(self, key):
            return store.get(key)

        def add(self, key, value):
            return store.add(key, value)

        def check(self, keys):
            if any("addr/tcp/" in k for k in keys) and not self.waited:
                self.waited = True
                time.sleep(seconds)
            return store.check(keys)

        def wait(self, keys, timeout=None):
            store.wait(keys) if timeout is None else store.wait(keys, timeout)

    return Slow()


def _init(rank: int, ws: int, store_path: str, expose_s: float = 0.0) -> None:
    import torch.distributed as dist

    import clawcomm  # noqa: F401

    store = dist.FileStore(store_path, ws)
    if expose_s and rank > 0:
        store = slow_to_read_addresses(store, expose_s)
    dist.init_process_group(
        "clawcomm",
        store=store,
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )


def _run(fn, ws, *args, env=None, limit=60.0):
    """run_ranks with a fresh store; returns (results, hung)."""
    import tempfile

    from clawcomm.testing import RankFailure, run_ranks

    with tempfile.TemporaryDirectory(prefix="clawcomm-chaos-") as tmp:
        results = run_ranks(
            fn, ws, os.path.join(tmp, "store"), *args,
            env=env, init=False, timeout=limit, allow_failures=True,
        )  # fmt: skip
    hung = any(
        isinstance(r, RankFailure) and any("hung for more than" in e for e in r.errors.values())
        for r in results
    )
    return results, hung


# --- kill -----------------------------------------------------------------


def _kill_trial(rank, ws, store_path, victim, start_at, delay, count):
    import torch
    import torch.distributed as dist

    time.sleep(max(0.0, start_at - time.time()))
    killed_at = start_at + delay
    if rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        _init(rank, ws, store_path)
        x = torch.ones(count)
        while time.time() < killed_at + TIMEOUT + 2 * SLACK:
            dist.all_reduce(x)
            x.fill_(1.0)
        return ("no error", 0.0)
    except Exception as e:  # noqa: BLE001
        return (str(e), time.time() - killed_at)


def kill(trials: int, seed: int = 0) -> Score:
    score = Score("kill")
    rng = random.Random(seed)
    for _ in range(trials):
        ws = rng.choice([2, 3, 4])
        env = {"CLAWCOMM_TRANSPORT": rng.choice(["shm", "tcp"])}
        victim, delay = rng.randrange(ws), rng.uniform(0.0, 0.15)
        # 16 KiB, or 4 MiB, whose frames go by single copy on shared memory:
        # the victim may die while a peer reads its memory.
        count = rng.choice([4096, 1 << 20])
        before = segments()
        results, hung = _run(_kill_trial, ws, victim, time.time() + 0.3, delay, count, env=env)
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

    _init(rank, ws, store_path)
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
        results, hung = _run(_mismatch_trial, ws, kind, odd, env=env)
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
            _init(rank, ws, f"{store_path}-{i}")
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

    _init(rank, ws, store_path)
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


def settings(trials: int = 1, seed: int = 0) -> Score:
    score = Score("settings")
    cases = [(v, x) for v in NUMERIC_SETTINGS for x in NONSENSE] + list(CHOICE_SETTINGS.items())
    for _ in range(trials):
        results, hung = _run(_settings_trial, 2, cases, limit=300)
        for r in results[0] if isinstance(results[0], list) else []:
            score.add(r[2] == "named", hang=hung, wrong=r[2] == "accepted", note=str(r))
        results, hung = _run(_arguments_trial, 2)
        for r in results[0] if isinstance(results[0], list) else []:
            ok = r[1] in ("refused", "ok")
            score.add(ok, hang=hung, wrong=r[1] in ("accepted", "wrong"), note=str(r))
    return score


# --- timeout, then a clean exit ----------------------------------------------


def _timeout_trial(rank, ws, store_path):
    import torch
    import torch.distributed as dist

    _init(rank, ws, store_path)
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
        "from clawcomm.chaos import _run, _timeout_trial\n"
        "results, hung = _run(_timeout_trial, 2)\n"
        "print(repr(results[0]), hung)\n"
    )
    for _ in range(trials):
        before = segments()
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        ok = p.returncode == 0 and "timed out" in p.stdout and "False" in p.stdout
        score.add(ok, leak=bool(segments() - before), note=p.stdout + p.stderr[-300:])
    return score


# --- soak -------------------------------------------------------------------


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _soak_trial(rank, ws, store_path, ops, seed):
    import torch
    import torch.distributed as dist

    from clawcomm._torch_names import all_gather_single, reduce_scatter_single

    _init(rank, ws, store_path)
    libc = ctypes.CDLL(None)
    trim = getattr(libc, "malloc_trim", lambda pad: 0)  # glibc's; absent elsewhere
    rng = random.Random(seed)  # the same sequence on every rank
    wrong, samples = 0, []
    # Warm-up: every op and size met a few times (the allocator's pools fill
    # up over the first couple of thousand calls), then RSS must stay flat.
    warm = max(ops // 10, min(ops // 2, 2000))
    for i in range(ops):
        n = rng.choice([1, 7, 64, 1000, 4096, 65537])
        kind = rng.choice(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"])
        x = torch.full((n * ws,), float(rank + 1))
        if kind == "all_reduce":
            dist.all_reduce(x)
            wrong += x[0].item() != ws * (ws + 1) / 2
        elif kind == "broadcast":
            dist.broadcast(x, i % ws)
            wrong += x[-1].item() != i % ws + 1
        elif kind == "all_gather":
            out = torch.empty(n * ws * ws)
            all_gather_single(out, x)
            wrong += out[-1].item() != ws
        elif kind == "reduce_scatter":
            out = torch.empty(n)
            reduce_scatter_single(out, x)
            wrong += out[0].item() != ws * (ws + 1) / 2
        else:
            out = torch.empty(n * ws)
            dist.all_to_all_single(out, x)
            wrong += out[-1].item() != ws
        if i >= warm and (i - warm) % max(1, (ops - warm) // 20) == 0:
            trim()  # what the allocator holds freed is not a leak
            samples.append((_rss_kb(), len(os.listdir("/proc/self/fd"))))
    return wrong, samples


def _rss_growth(rss: list[int]) -> float:
    """How far the floor of the resident set rose after warm-up, in percent:
    the lowest sample of the last third against the lowest of the first. The
    allocator's pools swing single samples by 2-3% either way on a flat
    process (a 0.5 MiB tensor's mmap kept or returned; malloc_trim before
    each sample takes most of that away), so the last sample against the
    first flags noise; a leak raises the floor."""
    if len(rss) < 3:
        return 0.0
    k = len(rss) // 3
    first = min(rss[:k])
    return (min(rss[-k:]) - first) / first * 100


def soak(ops: int, seed: int = 0) -> Score:
    score = Score("soak")
    before = segments()
    results, hung = _run(_soak_trial, 2, ops, seed, limit=3600)
    ok_all = True
    growth = fds = 0.0
    for r in results:
        if not isinstance(r, tuple):
            ok_all = False
            score.notes.append(str(r)[-300:])
            continue
        wrong, samples = r
        growth = max(growth, _rss_growth([s[0] for s in samples]))
        fds = max(fds, max(s[1] for s in samples) - min(s[1] for s in samples) if samples else 0)
        score.wrong += wrong
    score.trials = ops
    flat = growth < SOAK_RSS_GROWTH_LIMIT and fds == 0
    score.ok = ops if ok_all and flat and score.wrong == 0 else 0
    score.hangs += hung
    score.leaks += bool(segments() - before)
    score.extra["RSS growth after warm-up %"] = round(growth, 3)
    score.extra["fd change"] = int(fds)
    return score


# --- hostile clients --------------------------------------------------------


def listening_ports() -> set[int]:
    """This process's TCP ports in LISTEN state (from /proc, no psutil)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


def tcp_hello(rank: int, token: int) -> bytes:
    """A TCP setup hello as a peer sends it (csrc/transport/tcp/connection.cc)."""
    return struct.pack("<IiQII", 0x636C7463, rank, token, 0, 1)  # socket 0 of 1


def _hostile_payloads(rng: random.Random) -> bytes:
    from clawcomm.testing import make_frame

    hello = tcp_hello(1, rng.getrandbits(64))  # a wrong token
    frame = make_frame(2, b"", claimed=1 << 40)  # a point-to-point frame claiming 1 TiB
    return rng.choice([b"", rng.randbytes(rng.randint(1, 200)), hello, hello[:7], hello + frame])


def _storm(ports: set[int], stop: threading.Event, counter: list[int], seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        for port in list(ports) or [1]:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(_hostile_payloads(rng))
            except OSError:
                pass
            counter[0] += 1


def _storm_trial(rank, ws, store_path, connections):
    import torch
    import torch.distributed as dist

    stop, counter, ports = threading.Event(), [0], set()

    def watch():  # every listening port this rank opens, as soon as it exists
        while not stop.is_set():
            ports.update(listening_ports())
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
    for i in range(2):
        threading.Thread(
            target=_storm, args=(ports, stop, counter, rank * 10 + i), daemon=True
        ).start()
    _init(rank, ws, store_path, expose_s=1.0)  # rank 0's listener is stormed for 1 s
    during_setup = counter[0]
    x = torch.ones(4097)  # the last element: "my storm has sent its share"
    wrong, worst, last, calls = 0, 0.0, time.monotonic(), 0
    while True:  # run under the storm, until every rank's storm is done
        x.fill_(float(rank + 1))
        x[-1] = float(counter[0] - during_setup >= connections and calls >= 100)
        dist.all_reduce(x)
        calls += 1
        wrong += x[0].item() != ws * (ws + 1) / 2
        now = time.monotonic()
        worst, last = max(worst, now - last), now
        if x[-1].item() == ws:
            break
    stop.set()
    return wrong, worst, counter[0], during_setup, calls


def storm(connections: int, seed: int = 0) -> Score:
    score = Score("storm")
    before = segments()
    env = {"CLAWCOMM_TRANSPORT": "tcp", "CLAWCOMM_SOCKET_ADDR": "127.0.0.1"}
    results, hung = _run(_storm_trial, 2, connections // 2, env=env, limit=1800)
    total, worst, at_setup, calls = 0, 0.0, 0, 0
    ok = True
    for r in results:
        if not isinstance(r, tuple):
            ok = False
            score.notes.append(str(r)[-300:])
            continue
        wrong, w, n, s, c = r
        score.wrong += wrong
        worst = max(worst, w)
        total += n
        at_setup += s
        calls += c
    score.trials = total
    score.ok = total if ok and score.wrong == 0 and worst < 0.1 else 0
    score.hangs += hung
    score.leaks += bool(segments() - before)
    score.extra["of them during setup"] = at_setup
    score.extra["all-reduces"] = calls
    score.extra["longest gap between results ms"] = round(worst * 1000, 1)
    return score


FAMILIES = {
    "kill": kill,
    "mismatch": mismatch,
    "settings": settings,
    "timeout": timeout,
    "soak": soak,
    "storm": storm,
}
