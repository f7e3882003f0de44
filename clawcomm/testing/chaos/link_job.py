"""One rank of the hang family's link trial (clawcomm.testing.chaos.hangs),
started by torchrun on a namespace host: all-reduce until an error, then
write what it said and when to OUT_DIR/rank<r>.json.

    python -m clawcomm.testing.chaos.link_job OUT_DIR TIMEOUT_S
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time


def reduce_until_error(out_dir: str, rank: int, count: int) -> dict:
    """All-reduces `count` floats until a collective fails, once the first
    has passed and this rank's ready file is written (a fault is injected
    once every rank has one); returns the error and when it came. The
    multihost tests' fault job runs the same loop."""
    import torch
    import torch.distributed as dist

    t = torch.ones(count)
    dist.all_reduce(t)
    open(os.path.join(out_dir, f"ready{rank}"), "w").close()
    try:
        while True:
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": str(e), "error_at": time.time()}


def main() -> None:
    out_dir, timeout = sys.argv[1], float(sys.argv[2])
    import torch.distributed as dist

    import clawcomm  # noqa: F401

    dist.init_process_group("clawcomm", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    result = {"rank": rank, "host": os.environ.get("CLAWCOMM_HOST_ID"), "pid": os.getpid()}
    result.update(reduce_until_error(out_dir, rank, 1 << 20))
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(
        os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json")
    )
    os._exit(0)  # no goodbye to peers that cannot be reached


if __name__ == "__main__":
    main()
