"""Starting ranks: what ``clawcomm train``, ``bench``, ``experiment`` and
``plan --check`` run on, and every multi-rank test with them.

- :mod:`clawcomm.launch.ranks`: ``run_ranks`` forks N local ranks that join
  a fresh group and returns their results (or every rank's traceback);
  ``under_torchrun`` says whether this process is one of torchrun's;
  ``check_settings`` refuses a bad ``CLAWCOMM_*`` value before any rank
  starts.
- :mod:`clawcomm.launch.forkrun`: torchrun with forked workers (one import
  a host), for the namespace hosts.
- :mod:`clawcomm.launch.netns`: hosts made of network namespaces with
  shaped links (root only), for multi-host runs on one machine.
"""

from .ranks import RankFailure, check_settings, run_ranks, under_torchrun

__all__ = ["RankFailure", "check_settings", "run_ranks", "under_torchrun"]
