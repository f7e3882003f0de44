"""Groups split from others: ``split_group``, torch's ``split_group`` where
torch allows it and the same on machines where it does not.

A clawcomm group splits without a new rendezvous over the store: the new
group's ranks swap their addresses over the parent's connections
(csrc/comm/split.cc), as ``ncclCommSplit`` does. torch reaches it through
``ProcessGroup.split_group``; ``torch.distributed.split_group`` calls that only
when an accelerator is present and the default group is bound to a device
(``init_process_group(device_id=...)``), and refuses otherwise, on every
backend. ``clawcomm.split_group`` calls it then, and on a machine without one
takes the same steps itself.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def _torch_can_split() -> bool:
    default = c10d._get_default_group()
    return bool(default.bound_device_id) and torch.accelerator.is_available()


def split_group(
    split_ranks: list[list[int]],
    parent: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
    group_desc: str | None = None,
) -> dist.ProcessGroup | None:
    """``torch.distributed.split_group(parent, split_ranks, timeout)``, on any
    machine. Every rank of ``parent`` (default: the world) calls it with the
    same disjoint lists of ``parent``'s ranks; each gets the group of the list
    that holds it, registered with torch.distributed like any other (so
    ``dist.all_reduce(t, group=g)`` and ``dist.get_rank(g)`` work), or None if
    no list holds it::

        dp = clawcomm.split_group([[0, 2], [1, 3]])
    """
    if not split_ranks or any(len(g) == 0 for g in split_ranks):
        raise ValueError(f"clawcomm.split_group: split_ranks {split_ranks!r} has an empty group")
    if _torch_can_split():
        return dist.split_group(parent, split_ranks, timeout=timeout, group_desc=group_desc)
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is None:  # checked before any rank sends a byte
        raise RuntimeError(
            f"clawcomm.split_group: torch {torch.__version__} splits a group only with an "
            "accelerator and init_process_group(device_id=...); use dist.new_group here"
        )
    parent = parent or c10d._get_default_group()
    world = c10d._world
    if parent not in world.pg_group_ranks:
        raise ValueError(f"clawcomm.split_group: group {parent} is not registered")
    to_group = world.pg_group_ranks[parent]
    to_global = {g: r for r, g in to_group.items()}
    seen: set[int] = set()
    for group in split_ranks:
        bad = [r for r in group if r not in to_global]
        if bad or len(set(group)) != len(group) or seen & set(group):
            raise ValueError(
                f"clawcomm.split_group: split_ranks {split_ranks!r}: each list must hold "
                f"distinct ranks of the parent group (0..{parent.size() - 1}), in one list only"
            )
        seen |= set(group)
    me = to_group[dist.get_rank()]
    mine = next((sorted(g) for g in split_ranks if me in g), sorted(split_ranks[0]))
    name = c10d._process_group_name(mine, use_hashed_name=True)
    backend_name, _ = world.pg_map[parent]
    child = parent.split_group(
        mine,
        timeout=timeout or c10d._get_default_timeout(dist.Backend(backend_name)),
        group_name=name,
        group_desc=group_desc,
    )
    if child is None:
        return None
    register(
        child,
        backend_name=dist.Backend(backend_name),
        store=child.get_group_store(),
        group_name=name,
        backend_config=str(c10d.BackendConfig(dist.Backend(backend_name))),
        rank_mapping={to_global[r]: i for i, r in enumerate(mine)},
    )
    return child
