"""/dev/shm used by one host's ranks with every pair on shared memory
(CLAWCOMM_SHM_PEERS=all) and with only the pairs the reducing collectives use
(sparse), 4 MiB rings:

    python3 bench/shm_peers.py 16 32 > bench/results/shm_peers.txt

The segments are unlinked once every rank has mapped them, but their pages
stay in use while mapped, so /dev/shm's usage counts them.
"""

from __future__ import annotations

import shutil
import sys

from clawcomm.launch import run_ranks


def _body(rank, world):
    import torch.distributed as dist

    from clawcomm import backend_of

    dist.barrier()
    used = shutil.disk_usage("/dev/shm").used if rank == 0 else 0
    shm = sum(backend_of().transport_of(p) == "shm" for p in range(world))
    dist.barrier()
    return used, shm


def main(argv: list[str]) -> int:
    print("# ranks  CLAWCOMM_SHM_PEERS  /dev/shm used  shm peers per rank")
    for n in [int(a) for a in argv] or [16]:
        base = shutil.disk_usage("/dev/shm").used
        for mode in ("all", "sparse"):
            res = run_ranks(_body, n, env={"CLAWCOMM_SHM_PEERS": mode}, timeout=600)
            gib = (res[0][0] - base) / 2**30
            peers = [r[1] for r in res]
            print(f"{n:7d}  {mode:>18}  {gib:9.2f} GiB  {sum(peers) / n:.1f} (max {max(peers)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
