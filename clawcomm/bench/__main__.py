import sys

from clawcomm.bench.cli import main

sys.exit(main())
