"""``clawcomm plan``, the command: its flags, and the report it prints
(``search`` predicts, ``report`` lays out, ``check`` measures)."""

from __future__ import annotations

import os
import sys

from clawcomm.plan import shared_cores
from clawcomm.plan.check import check, model_flags, namespace_cores, shapes
from clawcomm.plan.report import report
from clawcomm.plan.search import PRICED_WIRES, cost_model, plan


def add_arguments(p) -> None:
    from clawcomm.train import flags

    p.add_argument("--config", metavar="FILE.toml", help="settings (flags given here win)")
    p.add_argument("--nproc", type=int, required=True, help="ranks of the world to plan for")
    p.add_argument("--top", type=int, default=5, help="layouts to show (5)")
    p.add_argument("--check", type=int, default=0, metavar="K",
                   help="train the first K for --check-steps steps each and compare")  # fmt: skip
    p.add_argument("--check-steps", type=int, default=20, help="steps per checked layout (20)")
    p.add_argument("--check-rounds", type=int, default=1, metavar="R",
                   help="measure the checked layouts R times in turn: medians, their spread, "
                        "and how well two rounds agree with each other (1)")  # fmt: skip
    p.add_argument("--check-shapes", action="store_true",
                   help="check the first and the best of each other shape (dp, pp, schedule), "
                        "not the first K, which are often one shape's ZeRO stages")  # fmt: skip
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="hosts the ranks are spread over, --nproc / hosts each (1)",
    )
    p.add_argument(
        "--link",
        metavar="RATE",
        help="each host's link, as 1gbit or 200mbit (default: the cost model's)",
    )
    p.add_argument(
        "--cost-model",
        metavar="FILE.json",
        help="a calibrated cost model (clawcomm bench --calibrate)",
    )
    p.add_argument("--search-compression", metavar="LIST", default="",
                   help="also choose the gradients' wire among these specs (comma-separated, "
                        f"none for dense; {PRICED_WIRES}; default: keep "
                        "--compression)")  # fmt: skip
    p.add_argument("--search-sync", metavar="LIST", default="",
                   help="also choose the sync method among these: every-step, local-sgd:H, "
                        "diloco:H (comma-separated; default: keep --sync)")  # fmt: skip
    p.add_argument("--trial-steps", type=int, default=shared_cores.TRIAL_STEPS, metavar="N",
                   help="where a host's ranks outnumber its cores, train one layout "
                        "N steps here to measure what an action costs beyond its profile "
                        "(%(default)s; 0: none, the plan counts the profiled compute "
                        "alone)")  # fmt: skip
    p.add_argument("--cores", type=int, default=0,
                   help="cores the ranks of one host share (0: this machine's; namespace "
                        "hosts on one machine share it: its cores / hosts)")  # fmt: skip
    flags.add_arguments(p)


def run(args) -> int:
    from clawcomm.train import flags

    try:
        cfg = flags.from_args(args, args.config)
        searched = [w.strip() for w in args.search_compression.split(",") if w.strip()]
        syncs = [w.strip() for w in args.search_sync.split(",") if w.strip()]
        if args.check_rounds < 1:
            raise ValueError(f"--check-rounds {args.check_rounds}: must be >= 1")
        if args.trial_steps != 0 and args.trial_steps < 2:
            raise ValueError(f"--trial-steps {args.trial_steps}: must be 0 (none) or >= 2")
        cores = args.cores or None
        if args.check and args.hosts > 1:
            # checked on namespace hosts of this machine, which share its cores
            why = netns_unavailable()
            if why:
                raise ValueError(f"--check with --hosts {args.hosts} trains on namespace hosts "
                                 f"of this machine: {why}")  # fmt: skip
            cores = cores or namespace_cores(args.hosts)
        # the trial trains where --check would: on namespace hosts where there are several
        on_hosts = args.hosts > 1 and not netns_unavailable()
        preds, over, prof = plan(cfg, args.nproc, cfg.max_memory_mb, cores,
                                 cost_model(args.cost_model, args.link), args.hosts,
                                 searched or None, syncs or None, args.trial_steps, on_hosts,
                                 args.link, None if args.tp is None else [cfg.tp])  # fmt: skip
    except (ValueError, OSError) as e:
        print(f"clawcomm plan: error: {e}", file=sys.stderr)
        return 2
    if not preds:
        least = min(p.memory_mb for p in over)
        print(f"clawcomm plan: every layout needs more than --max-memory-mb "
              f"{cfg.max_memory_mb:g} MB (the least: {least:.0f} MB)", file=sys.stderr)  # fmt: skip
        return 2
    base = ["--nproc", str(args.nproc), *model_flags(cfg)]
    print(report(preds, over, prof, base, args.top), flush=True)
    crowded = shared_cores.caveat(prof, args.nproc // args.hosts, cores or os.cpu_count() or 1)
    if crowded:
        print("# " + crowded)
    if searched:
        print("# the wire is chosen by time alone: fp16 and bf16 round every value, int8 and "
              "int4 quantise it, top-k and random-k send a few and carry or drop the rest, "
              "PowerSGD sends a low-rank approximation and carries the rest; "
              "`clawcomm experiment compression` measures what that costs in loss")  # fmt: skip
    if syncs:
        print("# the sync method is chosen by time alone: local SGD and DiLoCo replicas drift "
              "apart between meetings; `clawcomm experiment compression --methods "
              "local-sgd:8,diloco:32` measures what that costs in loss")  # fmt: skip
    if args.check:
        if args.hosts > 1:
            print(f"# checked on {args.hosts} namespace hosts of this machine, "
                  f"{cores} core(s) each, links {args.link or 'unshaped'}")  # fmt: skip
        chosen = shapes(preds, args.check) if args.check_shapes else preds[: args.check]
        try:
            print(check(cfg, chosen, len(chosen), args.check_steps, args.nproc,
                        args.check_rounds, args.hosts, args.link))  # fmt: skip
        except (ValueError, RuntimeError, OSError) as e:
            print(f"clawcomm plan --check: error: {e}", file=sys.stderr)
            return 1
    return 0


def netns_unavailable() -> str | None:
    from clawcomm.launch.netns import unavailable

    return unavailable()
