"""clawcomm: a collective-communication engine for distributed training.

``import clawcomm`` registers the ``"clawcomm"`` torch.distributed backend for
CPU tensors::

    import clawcomm
    import torch.distributed as dist
    dist.init_process_group("clawcomm")

Settings are read from ``CLAWCOMM_*`` environment variables when a group is
created; docs/settings.md lists them.
"""

__version__ = "0.1.0"

try:
    import torch.distributed  # noqa: F401
except ModuleNotFoundError as e:  # the engine (clawcomm._C) works without torch
    if (e.name or "").split(".")[0] != "torch":
        raise
    __all__: list[str] = []
else:
    from clawcomm._backend import (
        BACKEND_NAME,
        backend_of,
        comm_stats,
        engine_of,
        group_options,
        register,
    )
    from clawcomm.groups import split_group

    __all__ = [
        "BACKEND_NAME",
        "backend_of",
        "comm_stats",
        "engine_of",
        "group_options",
        "register",
        "split_group",
    ]
    register()
