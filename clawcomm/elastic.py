"""Going on without a lost host: rebuild the process group in-process from
the survivors, under a fresh store prefix (as torchft does every step,
instead of TorchElastic's restart of every rank).

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    dist.init_process_group("clawcomm", timeout=timedelta(seconds=10))
    epoch = 0
    while training:
        try:
            step()
        except RuntimeError:               # a peer died: every rank gets an error
            epoch += 1
            rank, world = clawcomm.elastic.rebuild(store, old_rank, old_world, epoch)

``rebuild`` aborts and destroys the broken default group, has every survivor
announce itself under ``clawcomm/epoch<e>/``, waits ``settle_s`` for the
others, and the survivor with the lowest old rank proposes who is in (the
first proposal stands: a late survivor cannot replace it). The
new group (ranks renumbered in old-rank order) connects over a
``PrefixStore`` of that epoch, so its keys never meet the old group's; its
connections present a new job token, and every frame carries the group's
epoch, so a frame of the old group is refused, never taken as data. A
survivor left out (it announced itself too late) gets an error that says
so. tests/multihost (kill a host, rebuild, go on) runs it.
"""

from __future__ import annotations

import datetime
import json
import time

__all__ = ["rebuild"]


def rebuild(
    store,
    old_rank: int,
    old_world: int,
    epoch: int,
    timeout: datetime.timedelta = datetime.timedelta(seconds=30),
    settle_s: float = 2.0,
) -> tuple[int, int]:
    """Replaces the default process group with one of the ranks that are
    still alive; returns (new rank, new world size). Every survivor calls
    it with the same `epoch` (one more than the last)."""
    import torch.distributed as dist

    import clawcomm

    if dist.is_initialized():
        try:
            clawcomm.engine_of().abort(f"rebuilding the group for epoch {epoch}")
        except Exception:  # noqa: BLE001 - already broken or not ours: destroy anyway
            pass
        dist.destroy_process_group()
    prefix = f"clawcomm/epoch{epoch}"
    members = agree_members(store, prefix, old_rank, old_world, timeout, settle_s)
    if old_rank not in members:
        raise RuntimeError(
            f"clawcomm.elastic.rebuild: rank {old_rank} announced itself after the survivors of "
            f"epoch {epoch} were fixed ({members}); it is not in the new group"
        )
    rank, world = members.index(old_rank), len(members)
    dist.init_process_group(
        "clawcomm",
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    return rank, world


def agree_members(
    store, prefix: str, old_rank: int, old_world: int, timeout, settle_s: float
) -> list[int]:
    """The old ranks in the new group, the same list on every survivor:
    each announces itself, waits `settle_s`, and the lowest it saw proposes
    who is in. The first proposal wins (the store's compare-and-set), so a
    survivor that arrives late, with a lower old rank, cannot replace the
    list the others already went on with."""
    store.set(f"{prefix}/alive/{old_rank}", "1")
    time.sleep(settle_s)
    alive = [r for r in range(old_world) if store.check([f"{prefix}/alive/{r}"])]
    if alive and alive[0] == old_rank:
        store.compare_set(f"{prefix}/members", "", json.dumps(alive))
    store.wait([f"{prefix}/members"], timeout)
    return json.loads(store.get(f"{prefix}/members"))
