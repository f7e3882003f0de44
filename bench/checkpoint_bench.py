"""Checkpoint figures for issue 12, on this machine:

1. Kill-mid-save: ``--trials`` processes (100 by default) each save trainer
   checkpoints in a loop and are SIGKILLed at a random moment (uniform in
   0..0.4 s after their first save, so inside a save most of the time); after
   each, the checkpoint ``latest`` names must load. Prints how many did.
2. Blocking time of a save of the GPT model (``clawcomm train``'s default:
   dim 128, 4 blocks, AdamW) against writing and fsyncing the same number of
   bytes to the same disk with one plain file write, and where the save's
   time goes (state dict, DCP's per-item serialization, dcp.save, commit).

    python3 bench/checkpoint_bench.py --trials 100 --json bench/results/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kill_trials(n: int, seed: int) -> dict:
    from clawcomm.testing.checkpoint import kill_mid_save_trial

    rng = random.Random(seed)
    ok, failures = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(n):
            root = os.path.join(tmp, f"t{t}")
            try:
                last, loaded = kill_mid_save_trial(root, rng.uniform(0.0, 0.4))
                ok += loaded in (last, last + 1)
            except Exception as e:  # a trial that could not load is the failure counted
                failures.append(f"trial {t}: {type(e).__name__}: {e}")
            print(f"\rkill-mid-save: {t + 1}/{n}, {ok} loadable", end="", file=sys.stderr)
    print(file=sys.stderr)
    return {"trials": n, "loadable": ok, "failures": failures[:5]}


def save_time(repeats: int) -> dict:
    import torch

    from clawcomm.train.config import TrainConfig
    from clawcomm.train.data import global_batches
    from clawcomm.train.models import build
    from clawcomm.train.trainer import Trainer

    cfg = TrainConfig(model="gpt", quiet=True, steps=2)
    model, loss, opt, ds, _, _ = build(cfg)
    tr = Trainer(model, loss, opt, cfg)
    tr.fit(global_batches(ds, cfg.effective_batch, 0), steps=2, progress=False)  # Adam state
    nbytes = sum(p.numel() * p.element_size() for p in tr.params)
    nbytes += sum(
        v.numel() * v.element_size()
        for s in tr.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    blob = os.urandom(nbytes)
    best_save = best_write = best_async = best_async_total = float("inf")
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:
        for r in range(repeats):
            tr.step_index = r + 1
            t0 = time.perf_counter()
            tr.save_checkpoint(os.path.join(tmp, "ck"))
            best_save = min(best_save, time.perf_counter() - t0)
            tr.step_index = 100 + r
            t0 = time.perf_counter()
            tr.save_checkpoint(os.path.join(tmp, "ck"), asynchronous=True)
            best_async = min(best_async, time.perf_counter() - t0)
            tr.wait_checkpoint()
            best_async_total = min(best_async_total, time.perf_counter() - t0)
            path = os.path.join(tmp, f"raw{r}")
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            best_write = min(best_write, time.perf_counter() - t0)
    breakdown = _breakdown(tr, repeats, blob)
    tr.close()
    return {
        "breakdown_ms": breakdown,
        "bytes": nbytes,
        "save_s": best_save,
        "raw_write_s": best_write,
        "ratio": best_save / best_write,
        "async_blocking_s": best_async,
        "async_total_s": best_async_total,
        "async_ratio": best_async / best_write,
    }


def _breakdown(tr, repeats: int, blob: bytes) -> dict:
    """Where a synchronous save's time goes (best of `repeats` each, ms):
    building the state dict; DCP's torch.save of every tensor item (into
    memory, as it does into the file, one zip container per item); the whole
    dcp.save without and with fsync; the trainer's save (adds the renames,
    the pointer and pruning); and a plain write + fsync of the same bytes."""
    import io
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from clawcomm.train import checkpoint as ck

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    sd = ck.state_dict(tr)
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor)]
    out: dict = {"items": len(sd), "tensor_items": len(tensors)}
    n = [0]

    def best(fn) -> float:
        b = float("inf")
        for _ in range(repeats):
            n[0] += 1
            t0 = time.perf_counter()
            fn(n[0])
            b = min(b, time.perf_counter() - t0)
        return b * 1e3

    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:

        def dcp_save(i, sync):
            d = os.path.join(tmp, f"d{i}")
            os.makedirs(d)
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, sync_files=sync))

        def raw(i):
            with open(os.path.join(tmp, f"r{i}"), "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())

        out["state_dict"] = best(lambda i: ck.state_dict(tr))
        out["torch_save_items"] = best(lambda i: [torch.save(t, io.BytesIO()) for t in tensors])
        out["dcp_save_no_fsync"] = best(lambda i: dcp_save(i, False))
        out["dcp_save"] = best(lambda i: dcp_save(i, True))
        out["trainer_save"] = best(lambda i: tr.save_checkpoint(os.path.join(tmp, "ck")))
        out["raw_write_fsync"] = best(raw)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    kills = kill_trials(args.trials, args.seed)
    saves = save_time(args.repeats)
    print(
        f"kill-mid-save: {kills['loadable']} of {kills['trials']} trials left a loadable checkpoint"
    )
    print(
        f"GPT checkpoint ({saves['bytes'] / 1e6:.1f} MB of parameters and Adam state): save blocks "
        f"{saves['save_s'] * 1e3:.0f} ms, a plain write + fsync of the same bytes "
        f"{saves['raw_write_s'] * 1e3:.0f} ms: {saves['ratio']:.2f}x (best of {args.repeats})"
    )
    print(
        f"asynchronous save: blocks {saves['async_blocking_s'] * 1e3:.0f} ms "
        f"({saves['async_ratio']:.2f}x the plain write), {saves['async_total_s'] * 1e3:.0f} ms "
        "until committed"
    )
    b = saves["breakdown_ms"]
    print(
        f"where a save's time goes ({b['items']} items, {b['tensor_items']} of them tensors; "
        f"best of {args.repeats}, ms): state dict {b['state_dict']:.1f}, torch.save of every "
        f"tensor item {b['torch_save_items']:.1f}, dcp.save {b['dcp_save_no_fsync']:.1f} without "
        f"fsync and {b['dcp_save']:.1f} with, the trainer's save {b['trainer_save']:.1f}, a plain "
        f"write + fsync {b['raw_write_fsync']:.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "kill_mid_save": kills, "save": saves}, f, indent=1
            )
    return 0 if kills["loadable"] == kills["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
