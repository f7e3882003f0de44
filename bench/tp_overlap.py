"""How much tensor-parallel communication ``--tp-overlap`` hides, on the
waiting model (layers that hold the host as an accelerator would, so two
CPU cores can show overlap honestly; clawcomm.train.models).

    python3 bench/tp_overlap.py --json runs/tp_overlap.json

Each waiting layer split over tp ranks waits 1/tp of its time and exchanges
what a sequence-parallel layer pair does: an all-gather of its input's
tokens before, a reduce-scatter of its output after, in forward and in the
input-gradient pass (``[micro-batch, seq_len, width]`` float32 each). Without
overlap those are blocking collectives; with it each is cut into one block
per rank, passed around the TP ring while the layer waits on the blocks
already there (clawcomm.parallel.tensor.comm).

Per run (``clawcomm train --model wait --tp N [--no-]tp-overlap``): the
median over the second half of the steps of ``tp_ms``, the time the slowest
rank was blocked on TP communication (the exposed part), of the step time,
and the TP bytes per step. ``hidden`` = 1 - exposed with overlap / exposed
without, the issue's figure (target: at least 0.70).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig, Trainer, models
from clawcomm.train.data import global_batches


def _config(args, tp: int, overlap: bool) -> TrainConfig:
    return TrainConfig(model="wait", layers=args.layers, wait_ms=args.wait_ms,
                       wait_width=args.width, seq_len=args.seq_len, tp=tp, tp_overlap=overlap,
                       microbatches=args.microbatches, micro_batch_size=args.micro_batch_size,
                       steps=args.steps, quiet=True)  # fmt: skip


def _rank(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = tr.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    tr.close()
    return metrics


def measure(cfg: TrainConfig) -> dict:
    metrics = run_ranks(_rank, cfg.tp, cfg, timeout=1800)[0]
    half = metrics[len(metrics) // 2 :]
    return dict(
        tp=cfg.tp,
        overlap=cfg.tp_overlap_on,
        tp_ms=statistics.median(m["tp_ms"] for m in half),
        step_ms=statistics.median(m["step_ms"] for m in half),
        bytes_tp=statistics.median(m["bytes_sent_tp"] for m in half),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--wait-ms", default="16,16,16", help="forward, input-gradient, weight ms/layer")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    print(f"# waiting model: {args.layers} layers, {args.wait_ms} ms, width {args.width}, "
          f"{args.seq_len} tokens, {args.microbatches} x {args.micro_batch_size} samples; "
          f"median of the last {args.steps - args.steps // 2} of {args.steps} steps")  # fmt: skip
    print(f"# {'tp':>3}{'overlap':>9}{'tp_ms (exposed)':>17}{'step ms':>9}{'TP MB/step':>11}"
          f"{'hidden':>8}")  # fmt: skip
    runs, figures = [], {}
    for tp in args.tp:
        off = measure(_config(args, tp, False))
        on = measure(_config(args, tp, True))
        hidden = 1 - on["tp_ms"] / off["tp_ms"] if off["tp_ms"] > 0 else 0.0
        on["hidden"] = hidden
        figures[tp] = hidden
        for r in (off, on):
            runs.append(r)
            h = f"{r['hidden']:.2f}" if "hidden" in r else ""
            mb = r["bytes_tp"] / 2**20
            print(f"  {r['tp']:>3}{'on' if r['overlap'] else 'off':>9}{r['tp_ms']:>17.2f}"
                  f"{r['step_ms']:>9.1f}{mb:>11.2f}{h:>8}", flush=True)  # fmt: skip
    if args.json:
        from clawcomm.bench.report import write_json

        write_json(
            args.json,
            {"command": " ".join(["python3", *sys.argv]), "args": vars(args), "runs": runs},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
