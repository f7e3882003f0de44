import atexit
import os
import shutil
import sys
import tempfile

# The tests import helpers from this folder (_cases.py) and the package itself.
sys.path.insert(0, os.path.dirname(__file__))

# The flight records of the failures tests cause go to a folder of the
# session's, removed at its end: the suite leaves nothing in $TMPDIR.
_FLIGHT = tempfile.mkdtemp(prefix="clawcomm-test-flight-")
os.environ.setdefault("CLAWCOMM_FLIGHT_DIR", _FLIGHT)
atexit.register(shutil.rmtree, _FLIGHT, True)

# Ranks are forked from this process (clawcomm.launch.run_ranks): what it
# has imported, they have. torch imports these on first use, at 1.5-2.5 s of
# CPU each, which every rank of every test that uses DDP, DCP or FSDP paid
# again; imported once here, they cost that once.
import torch._dynamo  # noqa: E402, F401
import torch.distributed.checkpoint  # noqa: E402, F401
import torch.distributed.fsdp  # noqa: E402, F401
