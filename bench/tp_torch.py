"""torch's own tensor parallelism on the trainer's GPT: ``parallelize_module``
on a 1-D ``init_device_mesh("cpu", (tp,))``, over the clawcomm backend and
over gloo, in one run.

    python3 bench/tp_torch.py --tp 2 4 --backend clawcomm,gloo --steps 20 --json runs/tp_torch.json

Beside each of torch's rows, the same GPT, batches and settings through
``clawcomm train``'s own tensor parallelism (``Trainer`` with ``tp``, one
micro-batch per step, no clipping, a constant learning rate): the rows named
``train/<backend>`` (``--no-trainer`` leaves them out). Their step time is
the trainer's ``step_ms`` (its whole step: the metrics' all-gather too), and
their bytes the TP group's per rank (``bytes_sent_tp / tp``).

Every rank builds the same GPT (``clawcomm.train.models.gpt``) from one seed,
on the character vocabulary of the trainer's default corpus; rank 0 computes
the loss of the first batch on that whole model, in one process, before
anything is parallelised. The model is then rebuilt from the same weights in
a form torch's plans can shard (``TpBlock``) and parallelised with torch's
styles, Megatron's layout:

- each block's attention: q, k and v column-wise, its output projection
  row-wise; its MLP: ``fc`` column-wise, ``out`` row-wise;
- with ``--sequence-parallel`` (the default), the LayerNorms run on a
  sequence shard (``SequenceParallel``): the attention and the MLP gather
  the sequence once on entry (``PrepareModuleInput``) and their row-wise
  layers reduce-scatter it back, instead of all-reducing;
- the token embedding row-wise with a replicated input (torch's examples),
  reduce-scattered onto the sequence shard under sequence parallelism; the
  position embedding likewise under sequence parallelism, and replicated
  (left plain) without it;
- the output projection column-wise, gathered to whole logits
  (``Replicate``), or left sharded over the vocabulary with
  ``--loss-parallel`` (torch's ``loss_parallel``). It shares its weight with
  the token embedding: both are sharded ``Shard(0)`` over the vocabulary, and
  the tie, which ``parallelize_module`` breaks by making a new Parameter for
  each, is made again afterwards.

Why q, k and v are separate layers: the model's ``qkv`` Linear(d, 3d) holds
q, k and v one after the other in its [3d, d] weight, and torch's
``ColwiseParallel`` cuts that weight into contiguous row blocks, so at tp 2
rank 0 would get all of q and half of k, and no rank a head's q, k and v
together. ``TpBlock`` splits it into three Linear(d, d) (rows [0, d),
[d, 2d), [2d, 3d) of the same weight and bias) and shards each: rank r gets
heads [r h/tp, (r+1) h/tp) of each, and views them with h/tp heads. The
attention's input is gathered once for the three (``PrepareModuleInput``
on the attention module) rather than once each.

Per run: the median and the fastest step (forward, backward, AdamW at
lr 1e-3; the slowest rank's time of each step, after 3 warm-up steps), the
bytes each rank sends per step through the clawcomm engine of the mesh's
group (``comm_stats()``, every kind of collective; n/a on gloo), the loss
of step 1 against the single-process loss (equal within 1e-5 relative, or
the script fails), and the last loss. The loss is the mean cross-entropy per
token of the micro-batch, which every rank sees whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from clawcomm.launch import run_ranks
from clawcomm.train import data, models

WARM = 3  # steps before timing starts
TOLERANCE = 1e-5  # step 1's loss against the single process, relative


@dataclasses.dataclass
class TpConfig:
    tp: int = 2
    sequence_parallel: bool = True
    loss_parallel: bool = False
    steps: int = 20
    seq_len: int = 64
    dim: int = 128
    layers: int = 4
    heads: int = 4
    micro_batch: int = 8
    lr: float = 1e-3
    seed: int = 0


# ---- the GPT in a form torch's plans can shard ----------------------------------


class TpEmbedding(nn.Module):
    """``models.Embedding`` with the positions looked up as [1, t], so that a
    row-wise plan can put them on the same sequence shard as the tokens."""

    def __init__(self, emb: models.Embedding):
        super().__init__()
        self.tokens, self.positions = emb.tokens, emb.positions

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
        return self.tokens(idx) + self.positions(pos)


class Attention(nn.Module):
    """Causal self-attention with q, k, v as three layers, viewed with
    ``heads`` heads of ``head_dim``: after column-wise sharding each layer's
    local output holds heads/tp whole heads."""

    def __init__(self, qkv: nn.Linear, proj: nn.Linear, heads: int, tp: int):
        super().__init__()
        d = qkv.in_features
        if heads % tp:
            raise ValueError(f"tp_torch: {heads} heads do not split over tp {tp}")
        self.head_dim, self.local_heads = d // heads, heads // tp
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        with torch.no_grad():
            for i, layer in enumerate((self.q, self.k, self.v)):
                layer.weight.copy_(qkv.weight[i * d : (i + 1) * d])
                layer.bias.copy_(qkv.bias[i * d : (i + 1) * d])
        self.proj = proj

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)  # local: [b, t, d/tp]
        b, t, local = q.shape
        if local != self.local_heads * self.head_dim:
            raise RuntimeError(
                f"tp_torch: q has {local} features on this rank, expected {self.local_heads} "
                f"heads x {self.head_dim}"
            )
        q, k, v = (z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, local))


class Mlp(nn.Module):
    def __init__(self, fc: nn.Linear, out: nn.Linear):
        super().__init__()
        self.fc, self.out = fc, out

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class TpBlock(nn.Module):
    """``models.Block`` with the same weights (qkv split three ways, the
    rest the same modules), as attention and MLP submodules."""

    def __init__(self, block: models.Block, tp: int):
        super().__init__()
        self.norm1, self.norm2 = block.norm1, block.norm2
        self.attn = Attention(block.qkv, block.proj, block.heads, tp)
        self.mlp = Mlp(block.fc, block.out)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def tp_model(model: nn.Sequential, tp: int) -> nn.Sequential:
    emb, *blocks, head = model
    return nn.Sequential(TpEmbedding(emb), *(TpBlock(b, tp) for b in blocks), head)


def plan(cfg: TpConfig, layers: int) -> dict:
    """torch's parallel styles for each module of ``tp_model``'s GPT."""
    sp = cfg.sequence_parallel
    seq = Shard(1) if sp else Replicate()  # the activations between layers
    out = {"0.tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)}
    if sp:
        out["0.positions"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    for i in range(1, layers + 1):
        out[f"{i}.attn.q"] = ColwiseParallel()
        out[f"{i}.attn.k"] = ColwiseParallel()
        out[f"{i}.attn.v"] = ColwiseParallel()
        out[f"{i}.attn.proj"] = RowwiseParallel(output_layouts=seq)
        out[f"{i}.mlp.fc"] = ColwiseParallel()
        out[f"{i}.mlp.out"] = RowwiseParallel(output_layouts=seq)
        # The attention's input as one DTensor for q, k and v: their input
        # gradients add up before the one reduction (all-reduce, or
        # reduce-scatter onto the sequence shard), not three.
        out[f"{i}.attn"] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),)
        )
        if sp:
            out[f"{i}.norm1"] = SequenceParallel()
            out[f"{i}.norm2"] = SequenceParallel()
            out[f"{i}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    head = layers + 1
    if sp:
        out[f"{head}.norm"] = SequenceParallel()
    out[f"{head}.proj"] = ColwiseParallel(
        input_layouts=seq,
        output_layouts=Shard(-1) if cfg.loss_parallel else Replicate(),
        use_local_output=not cfg.loss_parallel,
    )
    return out


# ---- one run ----------------------------------------------------------------------


def _bytes_sent(engines) -> int:
    return sum(v["bytes_sent"] for e in engines for v in e.comm_stats().values())


def run_rank(rank: int, world: int, cfg: TpConfig) -> dict:
    """One rank of a run (under ``run_ranks``): the figures of the table."""
    ds = data.CharText(data.default_text(), cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = models.gpt(ds.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq_len)
    batches = data.global_batches(ds, cfg.micro_batch, cfg.seed)
    first = next(batches)
    reference = None
    if rank == 0:
        with torch.no_grad():
            x, y = first
            reference = float(models.gpt_loss(model(x), y)) / y.numel()

    mesh = init_device_mesh("cpu", (world,))
    model = tp_model(model, world)
    parallelize_module(model, mesh, plan(cfg, cfg.layers))
    emb, head = model[0].tokens.weight, model[-1].proj.weight
    if emb.placements != head.placements:  # both must hold the same vocabulary rows
        raise RuntimeError(
            f"tp_torch: the token embedding is {emb.placements}, the output projection "
            f"{head.placements}: they cannot share one weight"
        )
    model[-1].proj.weight = emb  # the tie, made again
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    engines = []
    if dist.get_backend() == "clawcomm":
        import clawcomm

        groups = {id(g): g for g in (None, mesh.get_group())}.values()
        engines = list({id(e): e for e in (clawcomm.engine_of(g, "cpu") for g in groups)}.values())

    losses, times, sent = [], [], []
    batch = first
    for step in range(cfg.steps):
        if step:
            batch = next(batches)
        x, y = batch
        dist.barrier()
        before = _bytes_sent(engines)
        t0 = time.perf_counter()
        logits = model(x)
        if cfg.loss_parallel:
            with loss_parallel():
                loss = models.gpt_loss(logits, y) / y.numel()
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = models.gpt_loss(logits, y) / y.numel()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
        sent.append(_bytes_sent(engines) - before)
    return dict(reference=reference, losses=losses, times=times, sent=sent, clawcomm=bool(engines))


def _trainer_config(cfg: TpConfig):
    from clawcomm.train import TrainConfig

    return TrainConfig(model="gpt", dim=cfg.dim, layers=cfg.layers, heads=cfg.heads,
                       seq_len=cfg.seq_len, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel,
                       microbatches=1, micro_batch_size=cfg.micro_batch, steps=cfg.steps,
                       lr=cfg.lr, lr_decay="none", warmup_steps=0, clip=0.0, seed=cfg.seed,
                       quiet=True)  # fmt: skip


def run_trainer_rank(rank: int, world: int, cfg: TpConfig) -> dict:
    """One rank of ``clawcomm train``'s own TP on the same model and batches."""
    from clawcomm.train import Trainer

    tcfg = _trainer_config(cfg)
    model, loss_fn, make_opt, ds, tokens, sample = models.build(tcfg)
    trainer = Trainer(model, loss_fn, make_opt, tcfg, tokens_per_sample=tokens, sample=sample)
    metrics = trainer.fit(data.global_batches(ds, cfg.micro_batch, cfg.seed), progress=False)
    trainer.close()
    return dict(
        losses=[m["loss"] for m in metrics],
        times=[m["step_ms"] / 1e3 for m in metrics],
        sent=[m["bytes_sent_tp"] / cfg.tp for m in metrics],
    )


def measure_trainer(backend: str, cfg: TpConfig, reference: float, timeout: float = 1800):
    """``clawcomm train --tp`` at ``cfg``: a row of the table."""
    ranks = run_ranks(run_trainer_rank, cfg.tp, cfg, backend=backend, timeout=timeout)
    losses = ranks[0]["losses"]
    times = [t * 1e3 for t in ranks[0]["times"]]  # (every rank's step ends together)
    timed = times[WARM:] or times
    rel = abs(losses[0] - reference) / abs(reference)
    return dict(
        backend=f"train/{backend}", tp=cfg.tp, sequence_parallel=cfg.sequence_parallel,
        loss_parallel=True, step_ms_median=statistics.median(timed), step_ms_min=min(timed),
        bytes_per_step=statistics.median(ranks[0]["sent"][WARM:] or ranks[0]["sent"])
        if backend == "clawcomm" else None,
        loss_step1=losses[0], loss_reference=reference, loss_step1_rel_diff=rel,
        loss_step1_ok=rel <= TOLERANCE, loss_last=losses[-1], losses=losses, step_ms=times,
    )  # fmt: skip


def measure(backend: str, cfg: TpConfig, timeout: float = 1800) -> dict:
    """One backend at ``cfg.tp`` ranks: a row of the table."""
    ranks = run_ranks(run_rank, cfg.tp, cfg, backend=backend, timeout=timeout)
    losses = ranks[0]["losses"]
    # A step ends when its slowest rank's does.
    times = [max(r["times"][s] for r in ranks) * 1e3 for s in range(cfg.steps)]
    timed = times[WARM:] or times
    sent = statistics.median(ranks[0]["sent"][WARM:] or ranks[0]["sent"])
    ref = ranks[0]["reference"]
    rel = abs(losses[0] - ref) / abs(ref)
    return dict(
        backend=backend, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel,
        loss_parallel=cfg.loss_parallel, step_ms_median=statistics.median(timed),
        step_ms_min=min(timed), bytes_per_step=sent if ranks[0]["clawcomm"] else None,
        loss_step1=losses[0], loss_reference=ref, loss_step1_rel_diff=rel,
        loss_step1_ok=rel <= TOLERANCE, loss_last=losses[-1], losses=losses, step_ms=times,
    )  # fmt: skip


# ---- the table --------------------------------------------------------------------

HEADER = (
    f"{'backend':<15}{'tp':>3}{'seq-par':>8}{'step ms med':>12}{'min':>8}{'bytes/step':>12}"
    f"{'loss step 1':>12}{'1 process':>11}{'rel diff':>10}{'loss last':>10}"
)


def row_text(r: dict) -> str:
    sent = "n/a" if r["bytes_per_step"] is None else f"{r['bytes_per_step']:.0f}"
    mark = "" if r["loss_step1_ok"] else "  MISMATCH"
    return (
        f"{r['backend']:<15}{r['tp']:>3}{'on' if r['sequence_parallel'] else 'off':>8}"
        f"{r['step_ms_median']:>12.2f}{r['step_ms_min']:>8.2f}{sent:>12}"
        f"{r['loss_step1']:>12.6f}{r['loss_reference']:>11.6f}{r['loss_step1_rel_diff']:>10.1e}"
        f"{r['loss_last']:>10.4f}{mark}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[2], help="tp sizes (ranks)")
    p.add_argument("--backend", default="clawcomm,gloo", help="comma-separated backends")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=False,
                   help="logits sharded over the vocabulary (torch's loss_parallel)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer", action=argparse.BooleanOptionalAction, default=True,
                   help="also run clawcomm train's own TP on each backend")  # fmt: skip
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    for tp in args.tp:
        if args.heads % tp:
            p.error(f"--heads {args.heads} does not split over --tp {tp}")
        if args.sequence_parallel and args.seq_len % tp:
            p.error(f"--seq-len {args.seq_len} does not split over --tp {tp} (sequence parallel)")
    backends = [b for b in args.backend.split(",") if b]
    base = TpConfig(sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
                    steps=args.steps, seq_len=args.seq_len, dim=args.dim, layers=args.layers,
                    heads=args.heads, micro_batch=args.micro_batch, seed=args.seed)  # fmt: skip
    print(f"# torch tensor parallelism (parallelize_module) on the GPT: dim {args.dim}, "
          f"{args.layers} blocks, {args.heads} heads, {args.seq_len} tokens, micro-batch "
          f"{args.micro_batch}, AdamW lr 1e-3, {args.steps} steps ({WARM} warm-up), loss "
          f"{'parallel' if args.loss_parallel else 'on whole logits'}")  # fmt: skip
    print(f"# {HEADER}")
    rows = []
    for tp in args.tp:
        for backend in backends:
            r = measure(backend, dataclasses.replace(base, tp=tp))
            rows.append(r)
            print(f"  {row_text(r)}", flush=True)
            if args.trainer:
                t = measure_trainer(backend, dataclasses.replace(base, tp=tp), r["loss_reference"])
                rows.append(t)
                print(f"  {row_text(t)}", flush=True)
    bad = [r for r in rows if not r["loss_step1_ok"]]
    print(f"# step 1's loss equals the single-process loss within {TOLERANCE:g} relative: "
          f"{'yes' if not bad else f'NO ({len(bad)} runs)'}")  # fmt: skip
    if args.json:
        from clawcomm.bench.report import write_json

        write_json(
            args.json,
            {"command": " ".join(["python3", *sys.argv]), "args": vars(args), "runs": rows},
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
