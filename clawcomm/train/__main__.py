"""``python -m clawcomm.train`` (and ``torchrun ... -m clawcomm.train``)."""

import sys

from clawcomm.train.cli import main

sys.exit(main())
