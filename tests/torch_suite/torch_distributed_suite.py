"""PyTorch's own distributed test suite, run against a backend.

Run the way torch's test/distributed/test_distributed_spawn.py runs it:

    BACKEND=clawcomm WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) \\
        python -m pytest tests/torch_suite/torch_distributed_suite.py -q

and with BACKEND=gloo for the comparison (docs/torch_suite.md has the counts).
CLAWCOMM_SUITE_START=fork forks the ranks instead of spawning them (much
faster: each spawned rank imports torch's test modules again).

Many tests are gated on the literal name (`BACKEND == "gloo"`). To run exactly
the tests gloo runs, but on clawcomm, add CLAWCOMM_SUITE_AS_GLOO=1 with
BACKEND=gloo: every group that asks for gloo then gets clawcomm.
The file name keeps it out of the default test run; tests/test_torch_suite.py
runs a selected subset in CI.
"""

import os
import sys

import torch.distributed as dist

# Imported at module level so that every spawned rank registers the backend.
import clawcomm  # noqa: F401

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402

# Tell the suite what clawcomm implements, the way a backend plugin does: it
# reads these sets when distributed_test is imported, to decide what to skip.
# (No "gpu"/"cuda": clawcomm is a CPU backend.)
for feature in ("ddp", "subgroup", "plugin"):
    DistTestCases.backend_feature[feature].add("clawcomm")
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

BACKEND = os.environ["BACKEND"]

if os.environ.get("CLAWCOMM_SUITE_AS_GLOO") == "1":
    _init_process_group, _new_group = dist.init_process_group, dist.new_group

    def _clawcomm_for_gloo(backend):
        return "clawcomm" if str(backend).lower() == "gloo" else backend

    def init_process_group(backend=None, *args, **kwargs):
        return _init_process_group(_clawcomm_for_gloo(backend), *args, **kwargs)

    def new_group(*args, backend=None, **kwargs):
        return _new_group(*args, backend=_clawcomm_for_gloo(backend), **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


START = os.environ.get("CLAWCOMM_SUITE_START", "spawn")


class TestDistBackendRanks(TestDistBackend, DistributedTest._DistTestBase):
    """Ranks started as torch's test_distributed_spawn.py starts them, or
    forked with CLAWCOMM_SUITE_START=fork (as torch's test_distributed_fork.py
    did): a forked rank inherits this module instead of importing it again,
    about 7 s of a 2-core machine's time per test (tests/test_torch_suite.py
    forks)."""

    def setUp(self):
        import torch.multiprocessing

        super().setUp()
        if START == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


if __name__ == "__main__":
    run_tests()
