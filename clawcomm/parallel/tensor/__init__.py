"""Tensor parallelism (with sequence parallelism and overlap): its layers
(``layers``), its communication (``comm``) and how the trainer's models
split (``plan``). The trainer's ``--tp`` builds a ``TensorParallel`` for its
group and applies ``parallelize`` to the whole model before cutting stages.
"""

from clawcomm.parallel.tensor.layers import Split
from clawcomm.parallel.tensor.plan import Plan, TensorParallel, check, parallelize, whole_shape

__all__ = ["Plan", "Split", "TensorParallel", "check", "parallelize", "whole_shape"]
