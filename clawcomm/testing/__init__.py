"""Test support, shipped so that the CLIs and bench/ can use it too; not
part of the communication API.

- :mod:`clawcomm.testing.ranks`: ``run_ranks`` runs a function on N local
  ranks (the helper every multi-rank test uses, and the launcher of
  ``clawcomm bench`` / ``clawcomm train`` outside torchrun).
- :mod:`clawcomm.testing.stores`: a ``TCPStore`` the test process serves,
  for tests that kill ranks mid-setup (a ``FileStore`` hangs its readers
  when a writer dies mid-record).
- :mod:`clawcomm.testing.chaos`: the chaos families (kill, mismatch,
  settings, timeout, soak, storm) and their scores.
- :mod:`clawcomm.testing.netns`: hosts as network namespaces with shaped
  links (root only), for the multi-host tests and benchmarks.
"""

from .ranks import RankFailure, run_ranks, under_torchrun

__all__ = ["RankFailure", "run_ranks", "under_torchrun"]
