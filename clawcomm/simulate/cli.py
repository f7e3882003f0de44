"""``clawcomm simulate``: what clawcomm's collectives would take on a cluster
you do not have, from a model file (``clawcomm bench --calibrate``).

    clawcomm simulate --cost-model model.json --hosts 128 --ranks-per-host 8 --size 1G
    clawcomm simulate --hosts 2 --ranks-per-host 4 --size 64M --check    # + the event simulator
    clawcomm simulate --hosts 64 --ranks-per-host 8 --params 1.3G --compression fp16 --overlap 0.5
    clawcomm simulate --hosts 64 --ranks-per-host 8 --params 1.3G --tp 8 --layers 24 \
        --width 2048 --tokens 4K --microbatches 8                 # + tensor parallelism
    clawcomm simulate --hosts 8 --ranks-per-host 8 --ep 8 --layers 24 --width 2048 \
        --tokens 4K --top-k 2                                       # + experts' all-to-alls
    clawcomm simulate --hosts 8 --ranks-per-host 8 --cp 4 --layers 24 --width 2048 \
        --tokens 32K                                                # + the cp ring
    clawcomm simulate --chakra DIR --cost-model model.json [--project-hosts 64,512]

Prints the nccl-tests table it predicts (time, algbw, busbw; for the
all-reduce every algorithm and the one ``CLAWCOMM_ALGO=auto`` picks), the
communication time of one data-parallel training step (with --tp, the
tensor-parallel collectives of its transformer blocks too; with --ep, the
experts' all-to-alls; with --cp, the ring attention's hops), and with --plot a
picture of predicted busbw against size for 8 to 4096 ranks. With --chakra
it replays Chakra execution traces instead (``clawcomm train --chakra``'s, or
another tool's) and prints the predicted step and its critical path
(clawcomm.simulate.replay).

These are projections of a calibrated alpha-beta-gamma model
(clawcomm.cost_model; docs/algorithms.md): they know link bandwidths and
latencies, the algorithms' steps and how streams share a host's link, not
congestion inside a switch fabric, stragglers or the operating system.
bench/model_validation.py compares them with measured times.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from clawcomm import outputs
from clawcomm.bench.cli import parse_size
from clawcomm.bench.report import size_text as _size
from clawcomm.cost_model import ALGORITHMS, CostModel, Topology, busbw_factor, choose, predict

COLLECTIVES = list(ALGORITHMS)


def add_arguments(p) -> None:
    p.add_argument("--cost-model", metavar="FILE",
                   help="a calibrated cost model (clawcomm bench --calibrate; default: the "
                        "engine's)")  # fmt: skip
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--size", type=parse_size, default=1 << 30, help="largest size (1G)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=64 << 10, help="smallest (64K)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier (4)")
    p.add_argument("--op", default="all_reduce", help="comma list of " + ", ".join(COLLECTIVES))
    p.add_argument(
        "--check",
        action="store_true",
        help="also run the message-level simulation (clawcomm.simulate.messages) where it is cheap "
        "(<= 64 ranks)",
    )
    p.add_argument(
        "--params", type=parse_count, default=0,
        help="a training step: parameters (decimal: 1.3G = 1.3e9)",
    )  # fmt: skip
    p.add_argument(
        "--compression",
        default="none",
        help="the step's gradients: a compressor spec whose bytes follow from the gradient's "
        "size (none: fp32; fp16, int8, topk:RATIO, powersgd:R...), as it sends them",
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=0.0,
        help="the share of communication hidden behind backward (0..1)",
    )
    p.add_argument("--tp", type=int, default=1,
                   help="a training step: tensor-parallel ranks, within a host (the data-parallel "
                        "exchange then spans the hosts x ranks / tp replicas, each of 1/tp of "
                        "the parameters)")  # fmt: skip
    p.add_argument("--layers", type=int, default=0, help="--tp: transformer blocks")
    p.add_argument("--width", type=parse_count, default=0, help="--tp: the blocks' width")
    p.add_argument("--tokens", type=parse_count, default=0,
                   help="--tp: tokens per micro-batch (samples x sequence length)")  # fmt: skip
    p.add_argument("--microbatches", type=int, default=1, help="--tp: micro-batches a step")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="--tp: all-reduces instead of all-gathers and reduce-scatters")  # fmt: skip
    p.add_argument("--ep", type=int, default=1,
                   help="a training step: expert-parallel ranks, neighbours (every block a "
                        "mixture of experts; --layers, --width, --tokens, --top-k)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=2, help="--ep: experts each token goes to")
    p.add_argument("--cp", type=int, default=1,
                   help="a training step: context-parallel ranks, neighbours after a TP group: "
                        "ring attention's key/value hops (--layers, --width, --tokens: the "
                        "whole sequence's)")  # fmt: skip
    p.add_argument(
        "--chakra",
        metavar="DIR",
        help="replay the Chakra execution traces in DIR (<prefix>.<rank>.et, comm_group.json)",
    )
    p.add_argument(
        "--project-hosts",
        default="",
        metavar="N[,N...]",
        help="with --chakra: also each collective as if its group spanned N hosts",
    )
    p.add_argument("--plot", metavar="FILE", help="busbw against size for 8..4096 ranks (PNG)")
    p.add_argument("--json", metavar="FILE", help="write the predictions as JSON")


def parse_count(text: str) -> int:
    """'350M', '1.3G', '7e9' -> a count (decimal multiples: parameters, not bytes)."""
    import argparse

    t = text.strip()
    scale = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 350M, 1.3G)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return int(n)


def _count(n: float) -> str:
    """A count (parameters) in decimal units."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def table(
    collectives, sizes, topology: Topology, model: CostModel, check: bool
) -> tuple[str, list]:
    from clawcomm.simulate.messages import simulate, simulates

    n = topology.size
    lines, records = [], []
    head = (f"#{'size':>11} {'collective':>15} {'algorithm':>21} {'time (us)':>12} "
            f"{'algbw':>8} {'busbw':>8}")  # fmt: skip
    if check:
        head += f" {'simulated':>12} {'diff':>6}"
    lines.append(head + "   (GB/s; * = what auto picks)")
    for coll in collectives:
        for size in sizes:
            picked = choose(coll, size, topology, model)
            for algo in ALGORITHMS[coll]:
                t = predict(coll, algo, size, topology, model)
                if t == float("inf"):
                    continue
                algbw = size / t / 1e9 if t > 0 else 0.0
                busbw = algbw * busbw_factor(coll, n)
                mark = "*" if algo == picked else " "
                line = (f" {size:>11} {coll:>15} {algo + mark:>21} {t * 1e6:>12.1f} "
                        f"{algbw:>8.3f} {busbw:>8.3f}")  # fmt: skip
                rec = {"collective": coll, "algo": algo, "size": size, "time_s": t,
                       "busbw": busbw, "auto": algo == picked}  # fmt: skip
                if check and n <= 64 and simulates(coll, algo):
                    s = simulate(coll, algo, size, topology, model)
                    line += f" {s * 1e6:>12.1f} {(s / t - 1) * 100 if t else 0:>5.1f}%"
                    rec["simulated_s"] = s
                lines.append(line)
                records.append(rec)
    return "\n".join(lines), records


def training_step(params: int, compression: str, overlap: float, topology: Topology,
                  model: CostModel) -> tuple[str, float]:  # fmt: skip
    """The gradient exchange of one data-parallel step, as the compressor
    says it goes on the wire (``Compressor.wire``), priced by the cost
    model; the caller leaves ``overlap`` of it hidden behind backward."""
    from clawcomm.compression import get_compressor
    from clawcomm.cost_model import predict_sequence

    try:
        comp = get_compressor(compression)
    except ValueError as e:
        raise ValueError(f"--compression: {e}") from None
    wire = comp.wire(params, topology.size)
    if wire is None:
        raise ValueError(f"--compression {compression!r}: what it sends depends on the "
                         "gradient's values; simulate prices the wires whose bytes follow from "
                         "its size (not threshold, dgc or +ec)")  # fmt: skip
    what = " then ".join(f"{name.replace('_', '-')} of {nbytes / 2**20:.1f} MiB"
                         for name, nbytes in wire.collectives)  # fmt: skip
    return f"{comp.spec}: {what}", predict_sequence(wire.collectives, topology, model)


def tensor_parallel_step(args, model: CostModel) -> tuple[str, float]:
    """The tensor-parallel collectives of one step: every block's, forward
    and backward, for each micro-batch (what ``parallel.tensor`` says a
    split block sends), over tp ranks of one host, priced by the cost
    model."""
    from clawcomm.parallel.tensor.parallelize import block_collectives

    if args.ranks_per_host % args.tp:
        raise ValueError(f"--tp {args.tp} must divide --ranks-per-host {args.ranks_per_host} "
                         "(a TP group stays on one host)")  # fmt: skip
    if min(args.layers, args.width, args.tokens) < 1:
        raise ValueError("--tp needs --layers, --width and --tokens (the blocks it splits)")
    sp = not args.no_sequence_parallel
    passes = block_collectives(4.0 * args.tokens * args.width, sp)
    group = Topology(1, args.tp)
    block = sum(predict(op, "auto", b, group, model) for ops in passes.values() for op, b in ops)
    calls = sum(len(ops) for ops in passes.values())
    what = (f"{calls} collectives a block and micro-batch "
            f"({'sequence parallel' if sp else 'all-reduces'}) x {args.layers} blocks x "
            f"{args.microbatches} micro-batches")  # fmt: skip
    return what, block * args.layers * args.microbatches


def _neighbours(args, n: int, inside: int) -> Topology:
    """n neighbouring ranks, ``inside`` ranks apart (a TP group's width):
    on one host where they fit, else spread over the hosts they span."""
    hosts = max(1, n * inside // args.ranks_per_host)
    return Topology(hosts, n // hosts)


def expert_step(args, model: CostModel) -> tuple[str, float]:
    """The experts' all-to-alls of one step (parallel.expert): every block's
    tokens there and back, forward and backward (each as an even exchange
    of every token slot's float32 activation) and the counts' exchange, for
    each micro-batch, over ep neighbouring ranks."""
    if min(args.layers, args.width, args.tokens) < 1:
        raise ValueError("--ep needs --layers, --width and --tokens (the blocks' tokens)")
    group = _neighbours(args, args.ep, args.tp)
    slots = 4.0 * args.tokens * args.top_k * args.width
    block = 4 * predict("all_to_all", "auto", slots, group, model)
    block += predict("all_to_all", "auto", 8.0 * args.ep, group, model)
    what = (f"5 all-to-alls a block and micro-batch ({_size(slots)} of slots each way) x "
            f"{args.layers} blocks x {args.microbatches} micro-batches over {group.hosts} "
            f"host(s)")  # fmt: skip
    return what, block * args.layers * args.microbatches


def context_step(args, model: CostModel) -> tuple[str, float]:
    """Ring attention's hops of one step (parallel.context): a rank's keys
    and values (1/cp of the sequence's, 1/tp of its width at tp) sent cp - 1
    times forward and 2 cp - 1 times backward (the blocks and their
    gradients' sums) for every block and micro-batch, each a message
    between neighbours; the ring's transfers overlap the blocks'
    computation, which this model does not know."""
    if min(args.layers, args.width, args.tokens) < 1:
        raise ValueError("--cp needs --layers, --width and --tokens (the whole sequence's)")
    across = args.cp * args.tp > args.ranks_per_host
    alpha, beta = (model.net_alpha, model.net_beta) if across else (model.shm_alpha, model.shm_beta)
    kv = 2 * 4.0 * args.tokens / args.cp * args.width / args.tp
    hops = (args.cp - 1) + (2 * args.cp - 1)
    what = (
        f"{hops} hops of {_size(kv)} a block and micro-batch x {args.layers} blocks x "
        f"{args.microbatches} micro-batches, {'across hosts' if across else 'within a host'}"
    )
    return what, hops * (alpha + kv * beta) * args.layers * args.microbatches


def plot(path: str, model: CostModel, ranks_per_host: int, max_size: int) -> None:
    from clawcomm._optional import require

    require("matplotlib", "clawcomm simulate --plot").use("Agg")
    import matplotlib.pyplot as plt

    sizes = [1 << p for p in range(16, max(17, max_size.bit_length()))]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    n = 8
    while n <= 4096:
        k = min(ranks_per_host, n)
        topology = Topology(n // k, k)
        bw = [size / predict("all_reduce", "auto", size, topology, model) / 1e9
              * busbw_factor("all_reduce", n) for size in sizes]  # fmt: skip
        ax.plot(sizes, bw, marker=".", label=f"{n} ranks ({n // k} x {k})")
        n *= 2
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce size (bytes)")
    ax.set_ylabel("predicted busbw (GB/s)")
    ax.set_title("clawcomm all-reduce (auto), projected by the cost model")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_chakra(args, model: CostModel) -> int:
    from clawcomm import chakra
    from clawcomm.simulate import replay as chakra_replay

    try:
        projections = [int(h) for h in args.project_hosts.split(",") if h.strip()]
        if any(h < 1 for h in projections):
            raise ValueError(f"--project-hosts {args.project_hosts}: hosts must be at least 1")
        trace = chakra.read(args.chakra)
        known = all("host" in trace.metadata.get(r, {}) for r in trace.ranks)
        host_of = None if known else (lambda r: r // args.ranks_per_host)
        results = {0: chakra_replay.replay(trace, model, host_of)}
        for h in projections:
            results[h] = chakra_replay.replay(trace, model, host_of, project_hosts=h)
    except (OSError, ValueError, ImportError) as e:
        print(f"clawcomm simulate: error: {e}", file=sys.stderr)
        return 2
    where = "hosts from the traces" if known else f"{args.ranks_per_host} ranks per host"
    nodes = sum(map(len, trace.ranks.values()))
    print(
        f"# clawcomm simulate --chakra {args.chakra}: {len(trace.ranks)} ranks ({where}), "
        f"{nodes} nodes, cost model {args.cost_model or 'default'}"
    )
    print(chakra_replay.report(results[0]))
    for h in projections:
        r = results[h]
        shares = ", ".join(f"{k} {v / r.step:.0%}" for k, v in r.share().items() if v > 0)
        print(
            f"# projected, every collective's group over {h} hosts: step "
            f"{r.step * 1e3:.2f} ms; critical path {shares}"
        )
    if args.json:
        payload = {
            h: {
                "step_s": r.step,
                "critical_path_s": r.share(),
                "critical_path": [[s.rank, s.node.name, s.start, s.end] for s in r.critical],
            }
            for h, r in results.items()
        }
        with open(args.json, "w") as f:
            json.dump({"model": asdict(model), "by_projected_hosts": payload}, f, indent=1)
        outputs.wrote("clawcomm simulate", "results", args.json)
    return 0


def run(args) -> int:
    try:
        model = CostModel.load(args.cost_model) if args.cost_model else CostModel()
        outputs.check("--json", args.json)
        outputs.check("--plot", args.plot)
    except (OSError, ValueError) as e:  # (an outputs.OutputError too)
        print(f"clawcomm simulate: error: {e}", file=sys.stderr)
        return 2
    if args.chakra:
        return run_chakra(args, model)
    try:
        if args.hosts < 1 or args.ranks_per_host < 1:
            raise ValueError("--hosts and --ranks-per-host must be at least 1")
        if not 0 <= args.overlap <= 1:
            raise ValueError(f"--overlap {args.overlap} is not in [0, 1]")
        collectives = [c.strip() for c in args.op.split(",") if c.strip()]
        for c in collectives:
            if c not in ALGORITHMS:
                raise ValueError(f"--op {c!r} is not one of {', '.join(COLLECTIVES)}")
        if args.stepfactor < 2 or args.minbytes > args.size:
            raise ValueError("need -f >= 2 and -b <= --size")
        topology = Topology(args.hosts, args.ranks_per_host)
        sizes, s = [], args.minbytes
        while s <= args.size:
            sizes.append(s)
            s *= args.stepfactor
        text, records = table(collectives, sizes, topology, model, args.check)
        step = tp_step = None
        if args.tp < 1:
            raise ValueError(f"--tp {args.tp} must be at least 1")
        if args.params:
            dp = Topology(args.hosts, args.ranks_per_host // args.tp) if args.tp > 1 else topology
            params = args.params // args.tp
            step = training_step(params, args.compression, args.overlap, dp, model)
        if args.tp > 1:
            tp_step = tensor_parallel_step(args, model)
        for name in ("ep", "cp"):
            if getattr(args, name) < 1 or args.ranks_per_host * args.hosts % getattr(args, name):
                raise ValueError(f"--{name} {getattr(args, name)} must divide the world")
        inside = [(f"expert parallel at ep {args.ep}", expert_step(args, model), "experts")
                  for _ in range(args.ep > 1)]  # fmt: skip
        inside += [(f"context parallel at cp {args.cp}", context_step(args, model), "context")
                   for _ in range(args.cp > 1)]  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"clawcomm simulate: error: {e}", file=sys.stderr)
        return 2
    source = args.cost_model or "the engine's default"
    print(f"# clawcomm simulate: {args.hosts} hosts x {args.ranks_per_host} ranks = "
          f"{topology.size} ranks, cost model {source}")  # fmt: skip
    print(f"# links: shm {1 / model.shm_beta / 1e9:.2f} GB/s + {model.shm_alpha * 1e6:.1f} us, "
          f"network {1 / model.net_beta / 1e9:.3f} GB/s + {model.net_alpha * 1e6:.1f} us, "
          f"reduction {1 / model.gamma / 1e9:.2f} GB/s")  # fmt: skip
    print(text)
    largest = sizes[-1]
    print(f"# auto picks {choose('all_reduce', largest, topology, model)} for a "
          f"{_size(largest)} all-reduce")  # fmt: skip
    payload = {"topology": [args.hosts, args.ranks_per_host], "model": asdict(model),
               "records": records}  # fmt: skip
    if step:
        what, t = step
        exposed = t * (1 - args.overlap)
        print(f"# training step, {_count(args.params)} parameters: {what}: {t * 1e3:.1f} ms, "
              f"{exposed * 1e3:.1f} ms exposed with {args.overlap:.0%} overlapped")  # fmt: skip
        payload["training_step"] = {"what": what, "comm_s": t, "exposed_s": exposed}
    if tp_step:
        what, t = tp_step
        print(f"# tensor parallel at tp {args.tp}: {what}: {t * 1e3:.1f} ms a step, on the "
              f"critical path of every block (none of it overlapped)")  # fmt: skip
        payload["tensor_parallel"] = {"what": what, "comm_s": t}
    for title, (what, t), key in inside:
        print(f"# {title}: {what}: {t * 1e3:.1f} ms a step")
        payload[key] = {"what": what, "comm_s": t}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        outputs.wrote("# clawcomm simulate", "results", args.json)
    if args.plot:
        plot(args.plot, model, args.ranks_per_host, args.size)
        outputs.wrote("# clawcomm simulate", "plot", args.plot)
    return 0
