"""Data parallelism over any torch.distributed group, with gradient buckets
whose reduction overlaps backward, gradient accumulation and compression.

    from clawcomm.parallel import DataParallel
    model = DataParallel(model, compression="topk:0.01")
"""

from clawcomm.parallel.buckets import GradBucket
from clawcomm.parallel.data_parallel import DataParallel

__all__ = ["DataParallel", "GradBucket"]
