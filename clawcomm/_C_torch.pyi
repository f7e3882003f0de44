"""Type stub for ``clawcomm._C_torch``: the torch.distributed adapter
(csrc/torch/), linked against ``clawcomm._C``."""

import datetime

import torch.distributed as dist
from typing_extensions import CapsuleType

class ClawcommOptions:  # a c10d::Backend::Options at run time
    """The clawcomm backend's options (torch's Backend.Options), which split_group may copy."""

    backend: str
    _timeout: datetime.timedelta
    progress_nice: int
    """The nice value of the group's progress thread (0-19); -1: CLAWCOMM_PROGRESS_NICE's."""
    def __init__(self, timeout: datetime.timedelta, progress_nice: int = -1) -> None: ...
    def __copy__(self) -> ClawcommOptions: ...
    def __deepcopy__(self, memo: dict) -> ClawcommOptions: ...

class ClawcommBackend(dist.ProcessGroup):  # a c10d::Backend at run time
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        progress_nice: int = -1,
    ) -> None: ...
    @property
    def options(self) -> ClawcommOptions:
        """The backend's options (torch's split_group copies them)."""
    def _set_global_ranks(self, ranks: list[int]) -> None:
        """The job's rank of each rank of this group: errors and flight records name them."""
    def transport_of(self, peer: int) -> str:
        """How this rank reaches `peer`: 'shm', 'tcp' or 'self'."""
    def all_reduce_algorithm(self, nbytes: int) -> str:
        """The algorithm all_reduce of `nbytes` bytes uses ('oneshot', 'twoshot', 'ring', 'tree', 'hierarchical'; 'deterministic' under CLAWCOMM_DETERMINISTIC=1)."""
    def _start_time_estimate(self) -> None:
        """torch's _time_estimator: the collectives issued until _end_time_estimate() move nothing; the cost model prices them."""
    def _end_time_estimate(self) -> float:
        """The cost model's time for the collectives since _start_time_estimate(), in microseconds."""
    def cuda_ipc_status(self) -> dict[int, str]:
        """Per CUDA device index used so far: 'ok' where collectives go through
        CUDA IPC, else why they are staged through host memory."""
    def _engine_handle(self) -> CapsuleType:
        """A handle for clawcomm._C._engine_from_handle (use clawcomm.engine_of())."""
