"""How a trainer's data-parallel replicas stay in step: a gradient reducer
over the replicas every step, or an outer sync every H steps
(``--sync local-sgd/diloco``), built for the parameters each group holds.

The reducer averages every parameter's gradient over the stage's
data-parallel group (every replica's context-parallel ranks), except the
experts' at ep > 1, which the ranks that hold the same experts reduce
(``clawcomm.parallel.expert``).
"""

from __future__ import annotations

from clawcomm.compression import get_compressor
from clawcomm.parallel.buckets import FIRST_BUCKET_MB
from clawcomm.parallel.reducer import GradReducer
from clawcomm.parallel.zero3 import unit_of_params
from clawcomm.pipeline.actions import B, I, W
from clawcomm.train.outer import OuterSync


def synchronise(trainer):
    """(the reducer, the outer sync, the group of the outer sync's delayed
    exchanges) of ``trainer``'s layout; None where it has none."""
    cfg = trainer.cfg
    if cfg.averaged_over == 1:  # (at dp 1 with cp > 1 the cp ranks' gradients are summed)
        return None, None, None
    if cfg.sync != "every-step":  # replicas meet every H steps
        # Delayed meetings exchange on a thread, over a group of their own.
        exchange_group = trainer.grid.make_dp_group() if cfg.sync_delay else None
        return (
            None,
            OuterSync(trainer.params, trainer.dp_group, cfg, exchange_group),
            exchange_group,
        )
    tied = {id(p) for p, _, _ in trainer._ties} | {id(p) for p, _ in trainer.apart}
    tp = trainer.tensor_parallel
    whole = tp.replicated_ids() if tp is not None else set()
    reduced = trainer.experts.dense(trainer.params) if trainer.experts else trainer.params
    reducer = GradReducer(
        reduced,
        trainer.dp_group,
        bucket_cap_mb=cfg.bucket_cap_mb,
        first_bucket_mb=min(FIRST_BUCKET_MB, cfg.bucket_cap_mb),
        compressor=get_compressor(cfg.compression) if cfg.compression else None,
        compression_warmup_steps=cfg.compression_warmup,
        overlap=cfg.overlap,
        names=[trainer.names.get(id(p), str(i)) for i, p in enumerate(reduced)],
        # ZeRO shards all but the parameters tied across pipeline ranks (or
        # kept apart on one), whose gradients are summed after the reduction (see
        # clawcomm.parallel.zero), and at tp > 1 those that tensor
        # parallelism leaves whole, synchronised over the TP group after it.
        zero=cfg.zero,
        replicated={i for i, p in enumerate(reduced) if id(p) in tied | whole},
        units=unit_of_params(reduced, trainer.local) if cfg.zero == 3 else None,
    )
    # A gradient is final after the last backward actions of its stage on
    # this rank; the reducer counts their contributions in step 1 and
    # launches on that count from step 2.
    me = trainer.grid.pp_rank
    last = {(a.stage, a.kind): a for a in trainer.schedule[me] if a.kind in (B, I, W)}
    reducer.track_final_grads(last.values())
    reducer.attach_grads()
    return reducer, None, None
