"""torchft's reconfigurable process group over clawcomm.

torchft (``pip install torchft``) heals a job step by step: replica groups
that lose a member drop it and go on, and a restarted one rejoins and takes
the live replicas' state, with no job restart. Its Manager drives the
process group that joins the replicas through ``configure`` at each change
of quorum; this class answers it with a new clawcomm group each time, over
the store and prefix the Manager names::

    from torchft import Manager, DistributedDataParallel, OptimizerWrapper
    from clawcomm.torchft_group import ProcessGroupClawcomm

    manager = Manager(pg=ProcessGroupClawcomm(), min_replica_size=1, ...)
    model = DistributedDataParallel(manager, model)

The group before a reconfigure is aborted first (torchft's own rule), so
what it had in flight fails at once on every member; a member that died is
named in the errors, and the hang diagnosis (docs/reliability.md) applies
within each quorum's group. ``examples/torchft_ddp.py`` is torchft's DDP
example on it; ``tests/test_torchft.py`` kills a replica group and sees the
other go on and the dead one heal.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup as BaseProcessGroup

from clawcomm._optional import require

require("torchft", "clawcomm.torchft_group (torchft's replica groups over clawcomm)")

from torchft.process_group import ProcessGroupWrapper  # noqa: E402

from clawcomm import _C_torch  # noqa: E402

__all__ = ["ProcessGroupClawcomm"]


class ProcessGroupClawcomm(ProcessGroupWrapper):
    """A clawcomm group that torchft's Manager rebuilds at every quorum."""

    def _create_pg(self, store, rank: int, world_size: int) -> BaseProcessGroup:
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
        backend = _C_torch.ClawcommBackend(store, rank, world_size, self._timeout, -1)
        ranks = getattr(self, "_global_ranks", None)  # set by torchft 0.2's configure
        if ranks and len(ranks) == world_size:
            backend._set_global_ranks(list(ranks))
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.CUSTOM, backend)
        return pg

    def getBackendName(self) -> str:
        return "torchft-clawcomm"
