"""Tensor parallelism (with sequence parallelism and overlap): its layers
(``layers``), its communication (``comm``) and how the trainer's models
split (``parallelize``). The trainer's ``--tp`` splits the whole model with
``split_layers`` before cutting stages.
"""

from clawcomm.parallel.split import Split, whole_shape
from clawcomm.parallel.tensor.parallelize import (
    Parallelized,
    TensorParallel,
    check,
    parallelize,
    split_layers,
)

__all__ = [
    "Parallelized",
    "Split",
    "TensorParallel",
    "check",
    "parallelize",
    "split_layers",
    "whole_shape",
]
