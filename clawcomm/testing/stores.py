"""Stores for tests whose ranks die at random moments.

torch's ``FileStore`` appends a record as two writes, its key and then its
value. A rank killed between them leaves the record cut short, and every
other ``FileStore`` on that file then loops forever reading it (torch 2.13:
100% of a core, no timeout). Tests that kill ranks during setup therefore
rendezvous through a ``TCPStore``, whose server applies whole requests, so
a rank that dies mid-request leaves nothing behind. (A ``FileStore`` also
deletes its file when its reference count drops to zero, which a new
instance on the same path can race: give a rank one instance for every
group it joins on that path.)

The server runs in a helper process, never as a thread of the process that
forks the ranks: a rank forked while that thread holds a lock (logging a
killed client's disconnection, say) inherits the lock held, and the rank
hangs at its first store call. One helper serves every ``StoreServer`` of
a process, each under a prefix of its own.

    with StoreServer() as server:
        run_ranks(body, 3, server.address, init=False)

    def body(rank, ws, where):
        store = open_store(where, ws)
"""

from __future__ import annotations

import atexit
import datetime
import subprocess
import sys
import uuid

_SERVE = """
import sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # serves until the test process closes the pipe or dies
"""

_helper: tuple[subprocess.Popen, int] | None = None


def _stop_helper() -> None:
    global _helper
    if _helper is not None:
        proc, _ = _helper
        _helper = None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _helper_port() -> int:
    """The helper's port, starting it at the first call."""
    global _helper
    if _helper is None or _helper[0].poll() is not None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            proc.kill()
            raise RuntimeError(f"clawcomm.testing: the TCPStore helper did not start ({line!r})")
        if _helper is None:
            atexit.register(_stop_helper)
        _helper = (proc, int(line))
    return _helper[1]


class StoreServer:
    """A fresh namespace in a ``TCPStore`` that a helper process serves on a
    free loopback port, for the ranks this process forks; ``address`` is
    what ``open_store`` takes."""

    def __enter__(self) -> StoreServer:
        self.address = f"tcp://127.0.0.1:{_helper_port()}/{uuid.uuid4().hex}"
        return self

    def __exit__(self, *exc) -> None:
        pass  # the keys stay in the helper: a few hundred bytes per trial


def open_store(where: str, world_size: int, timeout_s: float = 60.0):
    """A client of ``tcp://host:port/namespace`` (a ``StoreServer``'s
    address), else a ``FileStore`` on the path ``where``."""
    import torch.distributed as dist

    if where.startswith("tcp://"):
        hostport, _, namespace = where[len("tcp://") :].partition("/")
        host, port = hostport.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), None, False, timeout=timeout)
        return dist.PrefixStore(namespace + "/", store) if namespace else store
    return dist.FileStore(where, world_size)
