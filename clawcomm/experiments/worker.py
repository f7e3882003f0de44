"""One rank of a compression-lab run under torchrun (``lab.run_on_link``):

    python -m clawcomm.experiments.worker SPEC CONFIG_JSON OUT_JSON

Rank 0 writes the run's measurements to OUT_JSON."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    spec, config, out = argv
    import torch.distributed as dist

    import clawcomm  # noqa: F401  (registers the backend)
    from clawcomm.experiments.compression import train_any

    dist.init_process_group("clawcomm")
    try:
        result = train_any(dist.get_rank(), dist.get_world_size(), spec, json.loads(config))
        if result is not None:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
