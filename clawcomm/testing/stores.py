"""Stores for tests whose ranks die at random moments.

torch's ``FileStore`` appends a record as two writes, its key and then its
value. A rank killed between them leaves the record cut short, and every
other ``FileStore`` on that file then loops forever reading it (torch 2.13:
100% of a core, no timeout). Tests that kill ranks during setup therefore
rendezvous through a ``TCPStore`` that the test process serves: its server
applies whole requests, so a rank that dies mid-request leaves nothing
behind. (A ``FileStore`` also deletes its file when its reference count
drops to zero, which a new instance on the same path can race: give a rank
one instance for every group it joins on that path.)

    with StoreServer() as server:
        run_ranks(body, 3, server.address, init=False)

    def body(rank, ws, where):
        store = open_store(where, ws)
"""

from __future__ import annotations

import datetime


class StoreServer:
    """A ``TCPStore`` served by this process on a free loopback port, for
    the ranks it forks; ``address`` is what ``open_store`` takes."""

    def __enter__(self) -> StoreServer:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.address = f"tcp://127.0.0.1:{self._store.port}"
        return self

    def __exit__(self, *exc) -> None:
        del self._store


def open_store(where: str, world_size: int, timeout_s: float = 60.0):
    """A ``TCPStore`` client for ``tcp://host:port`` (a ``StoreServer``'s
    address), else a ``FileStore`` on the path ``where``."""
    import torch.distributed as dist

    if where.startswith("tcp://"):
        host, port = where[len("tcp://") :].rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore(host, int(port), None, False, timeout=timeout)
    return dist.FileStore(where, world_size)
