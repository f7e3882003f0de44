"""The data- and pipeline-parallel trainer: ``clawcomm train`` and its
Python API.

    from clawcomm.train import Trainer, TrainConfig
    trainer = Trainer(nn.Sequential(...), loss_fn, make_optimizer, TrainConfig(dp=2, pp=2))
    trainer.fit(batches)

    clawcomm train --nproc 4 --dp 2 --pp 2 --schedule 1f1b --microbatches 8
    torchrun --nproc-per-node 4 -m clawcomm.train --dp 2 --pp 2
"""

from clawcomm.train.config import TrainConfig
from clawcomm.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
