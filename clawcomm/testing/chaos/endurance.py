"""The families that make a job last: soak (random collectives, memory and
file descriptors watched) and storm (hostile clients against its ports)."""

from __future__ import annotations

import ctypes
import os
import random
import socket
import struct
import threading
import time

from .harness import (
    SOAK_HEAP_GROWTH_LIMIT,
    SOAK_RSS_GROWTH_LIMIT,
    Score,
    join_group,
    run_trial,
    segments,
)

# --- soak -------------------------------------------------------------------


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]  # fmt: skip


def _heap_bytes(libc) -> int:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2,
    every arena; 0 where there is none): what a leak in the engine or in
    torch's tensors raises, whatever the pages do."""
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        return 0
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def _soak_trial(rank, ws, store_path, ops, seed):
    import torch
    import torch.distributed as dist

    from clawcomm._torch_names import all_gather_single, reduce_scatter_single

    join_group(rank, ws, store_path)
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
            samples.append((_rss_kb(), len(os.listdir("/proc/self/fd")), _heap_bytes(libc)))
    return wrong, samples


def floor_rise(values: list[int]) -> float:
    """How far the floor of ``values`` kept rising: the samples are cut in
    thirds and the floor (lowest sample) of each compared with the one
    before; a leak raises both steps, so twice the smaller rise is what
    counts. Floors, because single samples swing (a 0.5 MiB tensor's mmap
    kept or returned); both steps, because a one-time step (a thread arena
    made late, a cache that fills once) raises one floor only and is not a
    leak."""
    if len(values) < 3:
        return 0.0
    k = len(values) // 3
    first, mid, last = min(values[:k]), min(values[k:-k]), min(values[-k:])
    return 2.0 * max(0, min(mid - first, last - mid))


def rss_growth(rss: list[int]) -> float:
    """``floor_rise`` of the resident set, in percent of its first floor."""
    if len(rss) < 3:
        return 0.0
    return floor_rise(rss) / min(rss[: len(rss) // 3]) * 100


def soak(ops: int, seed: int = 0) -> Score:
    score = Score("soak")
    before = segments()
    results, hung = run_trial(_soak_trial, 2, ops, seed, limit=3600)
    ok_all = True
    growth = heap = fds = 0.0
    measured = ops - max(ops // 10, min(ops // 2, 2000))  # after the warm-up (_soak_trial)
    for rank, r in enumerate(results):
        if not isinstance(r, tuple):
            ok_all = False
            score.notes.append(str(r)[-300:])
            continue
        wrong, samples = r
        rss, bytes_in_use = [s[0] for s in samples], [s[2] for s in samples]
        per_op = floor_rise(bytes_in_use) / max(1, measured)
        growth, heap = max(growth, rss_growth(rss)), max(heap, per_op)
        if rss_growth(rss) >= SOAK_RSS_GROWTH_LIMIT or per_op >= SOAK_HEAP_GROWTH_LIMIT:
            score.notes.append(f"rank {rank} after warm-up: RSS kB {rss}, heap B {bytes_in_use}")
        fds = max(fds, max(s[1] for s in samples) - min(s[1] for s in samples) if samples else 0)
        score.wrong += wrong
    score.trials = ops
    flat = growth < SOAK_RSS_GROWTH_LIMIT and heap < SOAK_HEAP_GROWTH_LIMIT and fds == 0
    score.ok = ops if ok_all and flat and score.wrong == 0 else 0
    score.hangs += hung
    score.leaks += bool(segments() - before)
    score.extra["heap growth B/op"] = round(heap, 2)
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
    from clawcomm.testing.frames import make_frame

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
    join_group(rank, ws, store_path, expose_s=1.0)  # rank 0's listener is stormed for 1 s
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
    results, hung = run_trial(_storm_trial, 2, connections // 2, env=env, limit=1800)
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
