"""What the namespace testbed's links deliver when every host sends at once:
16 MiB per rank over 1 Gbit/s links, one rank per host, at 2, 4 and 8 hosts,
in three patterns:

* one-way: even ranks send to the next odd rank (half the hosts send);
* ring: every rank sends to the next and receives from the previous;
* exchange: pairs (r, r^1) send each other 16 MiB at once, as each step of
  recursive doubling (the tree all-reduce) does.

    python3 bench/netns_flows.py | tee bench/results/netns_flows.txt

Each figure is a rank's time for its transfer (median of 5, after a
barrier and a pause); a link at 1 Gbit/s moves 16 MiB in 140 ms. The cost
model takes every host's link as full duplex, each direction at the rate
whatever the other hosts do; this measures where the testbed (veth pairs on
one software bridge, shaped by tc tbf, on 2 cores) departs from that.
Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import sys
import time

PATTERNS = ("one-way", "ring", "exchange")


def worker() -> None:
    import torch
    import torch.distributed as dist

    import clawcomm  # noqa: F401  (registers the backend)

    dist.init_process_group("clawcomm")
    r, n = dist.get_rank(), dist.get_world_size()
    a, b = torch.ones(4 << 20), torch.empty(4 << 20)  # 16 MiB each
    mine = {}
    for mode in PATTERNS:
        times = []
        for _ in range(5):
            dist.barrier()
            time.sleep(0.2)
            dist.barrier()
            t = time.perf_counter()
            if mode == "one-way":
                ops = [dist.P2POp(dist.isend, a, r + 1) if r % 2 == 0 else
                       dist.P2POp(dist.irecv, b, r - 1)]  # fmt: skip
            elif mode == "ring":
                ops = [dist.P2POp(dist.isend, a, (r + 1) % n),
                       dist.P2POp(dist.irecv, b, (r - 1) % n)]  # fmt: skip
            else:
                ops = [dist.P2POp(dist.isend, a, r ^ 1), dist.P2POp(dist.irecv, b, r ^ 1)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            times.append(time.perf_counter() - t)
        mine[mode] = sorted(times)[2] * 1e3
    out = [None] * n
    dist.all_gather_object(out, mine)
    if r == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    from clawcomm.launch.netns import Cluster, failed, unavailable

    why = unavailable()
    if why:
        print(f"netns_flows: {why}", file=sys.stderr)
        return 2
    print("# ms per rank for 16 MiB (one-way: the receivers' times), 1 Gbit/s links: 140 ms")
    for hosts in (2, 4, 8):
        with Cluster(hosts, rate="1gbit") as cluster:
            runs = cluster.torchrun([os.path.abspath(__file__), "--worker"], 1, timeout=600)
        if failed(runs):
            return 1
        line = next(x for x in runs[0].output.splitlines() if x.startswith("RESULT "))
        ranks = json.loads(line[len("RESULT ") :])
        for mode in PATTERNS:
            times = [ranks[i][mode] for i in range(hosts) if mode != "one-way" or i % 2]
            print(f"{hosts} hosts  {mode:<9} " + " ".join(f"{t:5.0f}" for t in times)
                  + f"   slowest {max(times) / 140:.2f}x the link")  # fmt: skip
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
        sys.exit(0)
    sys.exit(main())
