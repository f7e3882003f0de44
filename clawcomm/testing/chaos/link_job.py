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


def main() -> None:
    out_dir, timeout = sys.argv[1], float(sys.argv[2])
    import torch
    import torch.distributed as dist

    import clawcomm  # noqa: F401

    dist.init_process_group("clawcomm", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    result = {"rank": rank, "host": os.environ.get("CLAWCOMM_HOST_ID"), "pid": os.getpid()}
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    open(os.path.join(out_dir, f"ready{rank}"), "w").close()
    try:
        while True:
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the error is the result
        result["error"], result["error_at"] = str(e), time.time()
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(
        os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json")
    )
    os._exit(0)  # no goodbye to peers that cannot be reached


if __name__ == "__main__":
    main()
