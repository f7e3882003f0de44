"""PyTorch's own distributed test suite, run against a backend.

Run the way torch's test/distributed/test_distributed_spawn.py runs it:

    BACKEND=clawcomm WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) \\
        python -m pytest tests/torch_suite/torch_distributed_suite.py -q

and with BACKEND=gloo for the comparison (docs/torch_suite.md has the counts).
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


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
