"""Tensor parallelism (with sequence parallelism and overlap): its layers
(``layers``), its communication (``comm``) and how the trainer's models
split (``parallelize``). The trainer's ``--tp`` builds a ``TensorParallel`` for its
group and applies ``parallelize`` to the whole model before cutting stages.
"""

from clawcomm.parallel.tensor.layers import Split
from clawcomm.parallel.tensor.parallelize import (
    Parallelized,
    TensorParallel,
    check,
    parallelize,
    whole_shape,
)

__all__ = ["Parallelized", "Split", "TensorParallel", "check", "parallelize", "whole_shape"]
