"""One rank of the multi-host tests (tests/multihost/test_multihost.py),
started by torchrun inside a namespace host (clawcomm.launch.netns):

    python3 job.py conformance|training|fault|elastic OUT_DIR

Writes OUT_DIR/rank<R>.json: the failures it found (conformance, training
against single-process training) or, for fault, the error every all-reduce
ended with once the test cut a link or killed a host, and when; for
elastic, the steps run before and after the survivors rebuilt the group
without the killed host.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)


def _write(out_dir: str, rank: int, payload: dict) -> None:
    tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))


def main() -> None:
    what, out_dir = sys.argv[1], sys.argv[2]
    import torch.distributed as dist

    import clawcomm  # noqa: F401

    timeout = float(os.environ.get("JOB_TIMEOUT_S", "30"))
    if what == "elastic":
        _elastic(out_dir, timeout)
        return
    dist.init_process_group("clawcomm", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "host": os.environ.get("CLAWCOMM_HOST_ID"), "failures": []}
    backend = clawcomm.backend_of()
    result["transports"] = [backend.transport_of(p) for p in range(world)]
    result["algorithm_64MiB"] = backend.all_reduce_algorithm(64 << 20)
    if what == "conformance":
        from test_collectives import SWEEPS, run_sweeps, sweep_large

        result["failures"] = run_sweeps(rank, world, [*SWEEPS, sweep_large])
    elif what == "training":
        from test_data_parallel import _assert_close, _train

        try:
            _assert_close([_train(rank, world, {"overlap": True})])
        except AssertionError as e:
            result["failures"].append(str(e)[:2000])
    elif what == "fault":
        # All-reduce until something breaks; the test cuts a link or kills
        # a host once every rank has written its ready file.
        from clawcomm.testing.chaos.link_job import reduce_until_error

        result.update(reduce_until_error(out_dir, rank, 4 << 20))
        result["error"] = result["error"][:4000]
        _write(out_dir, rank, result)
        os._exit(0)  # no goodbye to peers that are gone
    _write(out_dir, rank, result)
    dist.destroy_process_group()


def _elastic(out_dir: str, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    import clawcomm.elastic

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("clawcomm", timeout=datetime.timedelta(seconds=timeout))
    old_rank, old_world = dist.get_rank(), dist.get_world_size()
    result = {"rank": old_rank, "host": os.environ.get("CLAWCOMM_HOST_ID"), "failures": []}
    members = list(range(old_world))
    before = after = 0
    epoch = 0
    while after < 5:
        t = torch.full((1000,), float(old_rank + 1))
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            result["error"] = str(e)[:300]
            epoch += 1
            t0 = time.time()
            _, world = clawcomm.elastic.rebuild(store, old_rank, old_world, epoch)
            result["rebuild_s"] = time.time() - t0
            result["new_world"] = world
            members = json.loads(store.get(f"clawcomm/epoch{epoch}/members"))
            continue
        want = float(sum(r + 1 for r in members))
        if not torch.all(t == want):
            result["failures"].append(f"step {before + after}: {t[0].item()} != {want}")
        if epoch == 0:
            before += 1
            if before == 3:
                open(os.path.join(out_dir, f"ready{old_rank}"), "w").close()
            time.sleep(0.05)
        else:
            after += 1
    result.update(before=before, after=after, members=members)
    _write(out_dir, old_rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
