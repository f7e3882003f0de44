"""torch.distributed's current names for the tensor-to-tensor collectives.

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` (the old names warn);
older releases, such as the 2.11 on the GPU machines, have only the old ones.
Everything in clawcomm calls these two through here.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
