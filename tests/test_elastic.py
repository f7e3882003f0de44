"""clawcomm.elastic's membership: every survivor ends with the same list."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from clawcomm.elastic import agree_members


def test_a_late_survivor_with_the_lowest_rank_cannot_replace_the_members():
    """Old ranks 1 and 2 agree on [1, 2]; old rank 0 announces itself after
    that. It used to publish [0, 1, 2] over the others' list (they went on
    as a group of 2, it as one of 3); now it reads theirs and is left out."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=10)
    got: dict[int, list[int]] = {}

    def survivor(old_rank: int, delay: float) -> None:
        time.sleep(delay)
        got[old_rank] = agree_members(store, "clawcomm/epoch1", old_rank, 3, timeout, 0.2)

    threads = [threading.Thread(target=survivor, args=a) for a in ((1, 0.0), (2, 0.0), (0, 0.6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: [1, 2], 1: [1, 2], 2: [1, 2]}, got
