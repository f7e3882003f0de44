"""Simulating what is not run: the cost model's predictions played at any
scale, behind ``clawcomm simulate``.

- :mod:`clawcomm.simulate.cli`: the command (collectives and a training
  step's communication on any number of hosts, from a calibrated model).
- :mod:`clawcomm.simulate.messages`: the same algorithms message by
  message, with link queues, as a check of the closed forms
  (``clawcomm.cost_model``).
- :mod:`clawcomm.simulate.replay`: a training step replayed from Chakra
  execution traces (``clawcomm train --chakra``), and projected to more hosts.

A pipeline schedule played with given action costs is the pipeline's own
(``clawcomm.pipeline.clock``), not a simulation of this room.
"""
