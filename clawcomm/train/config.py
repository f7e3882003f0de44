"""Every setting of ``clawcomm train``, declared once: the dataclass below
gives the Python API its options, and through ``flags`` the CLI its flags
(``--micro-batch-size`` for ``micro_batch_size``) and ``--config FILE.toml``
its keys (the same names, with either ``-`` or ``_``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from clawcomm.pipeline.schedules import SCHEDULES, check_schedule_args

MODELS = ("gpt", "moe", "mlp", "wait")


def _opt(default, help: str, choices=None, **kw):
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclass
class TrainConfig:
    # layout and schedule
    layout: str = _opt(
        "",
        "auto: dp, tp, pp, schedule, micro-batches and ZeRO chosen by `clawcomm plan` for the "
        "world and --global-batch (overrides those flags; a --tp above 1 is kept)",
        ("", "auto"),
    )
    dp: int = _opt(1, "data-parallel replicas")
    pp: int = _opt(1, "pipeline stages' ranks (dp * tp * pp = world size)")
    tp: int = _opt(
        1,
        "tensor-parallel ranks: each layer split over tp neighbouring ranks (Megatron-style: "
        "attention by heads, the MLP by columns then rows, embedding and output by vocabulary)",
    )
    sequence_parallel: bool | None = _opt(
        None,
        "tp > 1: the residual stream, LayerNorms and dropout-free parts hold 1/tp of the tokens; "
        "an all-gather before each column-parallel layer and a reduce-scatter after each "
        "row-parallel one replace the all-reduces (gpt and wait; the mlp has no tokens). "
        "Default: on where the model has tokens",
        kind=bool,
        default_text="auto",
    )
    tp_overlap: bool | None = _opt(
        None,
        "tp > 1 with sequence parallelism: cut each all-gather and reduce-scatter into one "
        "block per rank, passed around the TP ring while the layer computes on the blocks "
        "already here (async TP). Default: on for the wait model, off for models that compute "
        "on the CPU, whose cores the transfers would take from the computation "
        "(docs/tensor_parallel.md has the figures)",
        kind=bool,
        default_text="auto",
    )
    ep: int = _opt(
        1,
        "moe: expert-parallel ranks, dividing dp: each copy of the experts spread over ep "
        "neighbouring data-parallel ranks, the tokens sent to their experts and back by two "
        "uneven all-to-alls (--dp 4 --ep 2: 2 copies of each expert)",
    )
    cp: int = _opt(
        1,
        "gpt: context-parallel ranks: each holds 1/cp of every sequence (chunks i and "
        "2cp-1-i, so that the causal mask gives every rank the same work) and attention "
        "passes keys and values around them (dp * cp * tp * pp = world size)",
    )
    cp_method: str = _opt(
        "ring",
        "cp > 1: ring (key/value blocks passed around the cp ranks while each computes on the "
        "block it holds) or allgather (every rank's keys and values gathered first)",
        ("ring", "allgather"),
    )
    schedule: str = _opt("1f1b", "pipeline schedule", SCHEDULES)
    microbatches: int = _opt(4, "micro-batches per schedule run")
    virtual_stages: int = _opt(1, "stages per rank (interleaved schedule: v)", flag="-v")
    accumulation: int = _opt(1, "schedule runs per optimizer step (gradient accumulation)")
    micro_batch_size: int = _opt(8, "samples per micro-batch")
    global_batch: int = _opt(
        0,
        "samples per optimizer step, all replicas together: the accumulation is derived from it "
        "(0: micro-batch-size x microbatches x accumulation x dp); --resume keeps the "
        "checkpoint's",
    )
    allow_batch_change: bool = _opt(
        False, "--resume: let the global batch differ from the checkpoint's (it is printed)"
    )
    balance: str = _opt(
        "params", "cut stages by parameter count or measured time", ("params", "time")
    )
    device: str = _opt(
        "auto",
        "where ranks compute: cuda:LOCAL_RANK % GPUs, the CPU, or auto (CUDA if any)",
        ("auto", "cpu", "cuda"),
    )
    keep_heap: bool = _opt(
        True,
        "CPU ranks keep the memory a step frees for the next step's activations instead of "
        "handing it back to the OS and faulting it in again (glibc's malloc thresholds)",
    )
    activation_checkpoint: str = _opt(
        "none",
        "keep less of the forward for backward and compute it again there: selective (gpt: "
        "the LayerNorms' outputs, attention's core and the MLP's activation; no projection is "
        "recomputed) or full (each layer keeps only its input and runs its forward again)",
        ("none", "selective", "full"),
    )
    # model and data
    model: str = _opt("gpt", "model", MODELS)
    layers: int = _opt(0, "layers (0: the model's default: gpt 4 blocks, mlp 4, wait 8)")
    dim: int = _opt(128, "gpt: width")
    heads: int = _opt(4, "gpt: attention heads")
    seq_len: int = _opt(64, "gpt: tokens per sample")
    hidden: int = _opt(256, "mlp: hidden width")
    experts: int = _opt(8, "moe: experts in each mixture-of-experts MLP")
    top_k: int = _opt(2, "moe: experts each token goes to (1: Switch, 2: GShard/Mixtral)", (1, 2))
    moe_every: int = _opt(1, "moe: every K-th block has a mixture of experts, the rest an MLP")
    capacity_factor: float = _opt(
        0.0,
        "moe: an expert takes at most factor x tokens x top_k / experts of a micro-batch's "
        "token slots, the rest dropped and counted (0: no limit, no token dropped)",
    )
    aux_loss_coeff: float = _opt(1e-2, "moe: weight of Switch's load-balancing loss")
    z_loss_coeff: float = _opt(1e-3, "moe: weight of the router z-loss")
    text: str = _opt("", "gpt: a UTF-8 text file (default: the Python docs bundled with CPython)")
    data: str = _opt(
        "",
        "gpt: a token file (uint16/uint32 ids, as nanoGPT writes; `clawcomm tokenize` makes one), "
        "each replica reading its own samples",
    )
    data_val: str = _opt("", "gpt: a held-out token file, for the validation loss")
    data_dtype: str = _opt(
        "auto",
        "token files' ids: auto (meta.json's dtype, else uint16); one that contradicts a "
        "meta.json is refused",
        ("auto", "uint16", "uint32"),
    )
    prefetch: int = _opt(2, "batches prepared ahead on a background thread (0: none)")
    eval_every: int = _opt(0, "held-out loss (--data-val) every N steps (0: after the last only)")
    eval_batches: int = _opt(4, "held-out batches (of the global batch) per evaluation")
    wait_ms: str = _opt("4,4,4", "wait: forward, input-gradient, weight-gradient ms per layer")
    wait_width: int = _opt(256, "wait: width of each layer's (square) weight")
    # optimisation
    steps: int = _opt(200, "optimizer steps")
    seed: int = _opt(0, "seed for the weights and the data order")
    optimizer: str = _opt("adamw", "optimizer", ("adamw", "sgd"))
    lr: float = _opt(1e-3, "learning rate at --base-batch")
    lr_scaling: str = _opt(
        "none", "scale the LR with the effective batch (Goyal et al.)", ("none", "linear", "sqrt")
    )
    base_batch: int = _opt(0, "the batch --lr is meant for (0: the effective batch)")
    warmup_steps: int = _opt(0, "linear LR warm-up steps")
    lr_decay: str = _opt("cosine", "decay after warm-up", ("cosine", "linear", "none"))
    min_lr_ratio: float = _opt(0.1, "final LR as a fraction of the peak")
    weight_decay: float = _opt(0.0, "weight decay")
    momentum: float = _opt(0.9, "SGD momentum")
    clip: float = _opt(1.0, "clip gradients to this global norm (0: off)")
    # data-parallel reduction
    compression: str = _opt("", "gradient compression spec (fp16, topk:0.01, ...; '': none)")
    compression_warmup: int = _opt(0, "dense steps before compressing")
    sync: str = _opt(
        "every-step",
        "when data-parallel replicas meet: every-step (gradients averaged every step), "
        "local-sgd:H (parameters averaged every H steps) or diloco:H (an outer Nesterov step on "
        "the averaged pseudo-gradient every H steps; --compression compresses it)",
    )
    outer_lr: float = _opt(0.7, "diloco: outer learning rate")
    outer_momentum: float = _opt(0.9, "diloco: outer Nesterov momentum")
    fragments: int = _opt(
        1, "local-sgd/diloco: meet in this many fragments, one every H/F steps (Streaming DiLoCo)"
    )
    sync_delay: int = _opt(
        0,
        "local-sgd/diloco: inner steps a meeting's exchange runs behind, on a thread of its own "
        "(Streaming DiLoCo's tau, < H; 0: the replicas wait for it)",
    )
    sync_mix: float = _opt(
        0.0,
        "with --sync-delay: the share of its own parameters a replica keeps when the delayed "
        "result lands (Streaming DiLoCo's alpha; 0: it takes the outer result, as torchft does)",
    )
    bucket_cap_mb: float = _opt(25.0, "gradient bucket size")
    overlap: bool = _opt(True, "reduce buckets while the pipeline drains")
    deterministic: bool = _opt(
        False,
        "bitwise the same losses and weights at every dp x pp x ZeRO stage (powers of two; "
        "docs/deterministic.md): micro-batch gradients summed in a fixed tree, no overlap",
    )
    zero: int = _opt(
        0,
        "ZeRO stage: 0 (every dp replica holds all the optimizer state), 1 (each holds "
        "1/dp of it: gradients reduce-scattered, parameters all-gathered), 2 (gradients "
        "too are kept as 1/dp between steps) or 3 (parameters too: each layer is gathered "
        "when the schedule needs it and freed again, see --reshard-after-forward)",
        (0, 1, 2, 3),
    )
    reshard_after_forward: bool | None = _opt(
        None,
        "zero 3: free each layer's gathered parameters after every forward and regather them "
        "for its backward (less memory, more all-gathers); --no-reshard-after-forward keeps them "
        "across the round's micro-batches. Default: on at pp 1, so that --zero 3 holds less "
        "than --zero 0 (its shard and about two layers, as FSDP2 does), off at pp > 1, where "
        "every micro-batch of a round uses every layer and regathering would multiply the "
        "all-gathers (as torchtitan does)",
        kind=bool,
        default_text="auto",
    )
    param_compression: str = _opt(
        "none",
        "what the ZeRO parameter all-gather sends (every rank keeps float32 master shards): "
        "none (float32), fp16, bf16 or int8 (blocks of 256 with a scale each)",
        ("none", "fp16", "bf16", "int8"),
    )
    max_memory_mb: float = _opt(
        0.0,
        "stop every rank when one holds more MB than this in parameters, gradients and "
        "optimizer state, each at its peak in the step, and on a GPU its communicators' CUDA "
        "IPC buffers (0: no limit)",
    )
    # checkpoints
    checkpoint_dir: str = _opt(
        "", "save atomic checkpoints here after the last step (DCP; `latest` names the newest)"
    )
    checkpoint_every: int = _opt(0, "also save every this many steps (0: after the last only)")
    keep_checkpoints: int = _opt(2, "checkpoints kept (older ones are removed)")
    async_checkpoint: bool = _opt(
        False, "save asynchronously: training goes on while the files are written"
    )
    resume: bool = _opt(False, "continue from --checkpoint-dir's latest checkpoint, if any")
    kill_rank: int = _opt(
        -1, "fault drill: this rank SIGKILLs itself (first torchrun attempt only)"
    )
    kill_at_step: int = _opt(0, "fault drill: ... after this step (see examples/recovery.py)")
    # output
    metrics: str = _opt("", "write per-step metrics as JSON lines to this file")
    trace: str = _opt("", "write a Chrome/Perfetto trace of every step, all ranks (JSON)")
    tensorboard: str = _opt("", "write the per-step metrics for TensorBoard to this folder")
    timeline: str = _opt("", "draw the last step, ranks against time (PNG; needs matplotlib)")
    chakra: str = _opt(
        "", "write the last step, all ranks, as a Chakra execution trace in this folder"
    )
    quiet: bool = _opt(False, "no progress bar")

    def __post_init__(self):
        if self.layers == 0:
            self.layers = {"mlp": 4, "wait": 8}.get(self.model, 4)
        per = self.round_batch
        if self.global_batch > 0 and per > 0 and self.global_batch % per == 0:
            self.accumulation = self.global_batch // per  # check() refuses one that does not split

    @property
    def round_batch(self) -> int:
        """Samples in one schedule run, all replicas: a global batch is a whole number of them."""
        return self.micro_batch_size * self.microbatches * self.dp

    @property
    def reshards_after_forward(self) -> bool:
        """``reshard_after_forward`` as set, or by default: at ZeRO-3 with
        pp 1 (the rule lives here alone)."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.zero == 3 and self.pp == 1

    @property
    def sequence_parallel_on(self) -> bool:
        """``sequence_parallel`` as set, or by default: at tp > 1 on a model with tokens."""
        if self.tp == 1:
            return False
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return self.is_gpt or self.model == "wait"

    @property
    def tp_overlap_on(self) -> bool:
        """``tp_overlap`` as set, or by default: on for the wait model."""
        if not self.sequence_parallel_on:
            return False
        if self.tp_overlap is not None:
            return self.tp_overlap
        return self.model == "wait"

    @property
    def is_gpt(self) -> bool:
        """The model is the GPT (with or without experts): it reads text or tokens."""
        return self.model in ("gpt", "moe")

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def averaged_over(self) -> int:
        """The ranks each gradient is averaged over: every replica's cp ranks."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.microbatches * self.accumulation * self.dp

    def wait_times(self) -> tuple[float, float, float]:
        try:
            f, i, w = (float(x) for x in self.wait_ms.split(","))
        except ValueError:
            raise ValueError(f"wait_ms {self.wait_ms!r} is not three numbers F,I,W") from None
        return f, i, w

    def lr_factor(self, step: int) -> float:
        """The LR multiplier at ``step`` (0-based): batch scaling x warm-up x decay."""
        cfg = self
        scale = self.batch_scale()
        if step < cfg.warmup_steps:
            return scale * (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        lo = cfg.min_lr_ratio
        decay = {
            "none": 1.0,
            "linear": 1.0 - (1.0 - lo) * progress,
            "cosine": lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress)),
        }[cfg.lr_decay]
        return scale * decay

    def check_batch(self, batch) -> tuple:
        """(inputs, targets, whole) of ``batch``: the effective batch (whole),
        or a ``tokens.ReplicaSlice``, this replica's rows of it (tensors None
        on a rank that needs neither)."""
        n = self.effective_batch
        whole = not hasattr(batch, "items")
        x, y = batch if whole else (batch.x, batch.y)
        rows = n if whole else n // self.dp
        if any(t is not None and t.shape[0] != rows for t in (x, y)):
            what = "the effective batch" if whole else "this replica's share of the batch"
            raise ValueError(
                f"clawcomm.train: a batch must hold {what}, {rows} samples "
                f"({self.micro_batch_size} x {self.microbatches} x {self.accumulation}"
                + (f" x dp {self.dp}" if whole else "")
                + f"); got inputs {None if x is None else tuple(x.shape)} and targets "
                f"{None if y is None else tuple(y.shape)}"
            )
        return x, y, whole

    def batch_scale(self) -> float:
        """The LR multiplier for the effective batch against ``base_batch``."""
        cfg = self
        ratio = cfg.effective_batch / (cfg.base_batch or cfg.effective_batch)
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]

    def check(self, world_size: int | None = None) -> None:
        """Raises ValueError naming the first setting that is wrong."""
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{f.name} {value!r} is not one of {', '.join(map(str, choices))}")
            if isinstance(f.default, int) and not isinstance(f.default, bool):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{f.name} must be an integer, got {value!r}")
        positive = (
            "dp",
            "tp",
            "pp",
            "microbatches",
            "virtual_stages",
            "accumulation",
            "micro_batch_size",
            "steps",
            "layers",
            "dim",
            "heads",
            "seq_len",
            "hidden",
            "ep",
            "cp",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch < 0:
            raise ValueError(f"global_batch must be >= 0, got {self.global_batch}")
        if self.global_batch and self.global_batch != self.effective_batch:
            raise ValueError(
                f"global_batch {self.global_batch} is not a whole number of schedule runs of "
                f"micro_batch_size x microbatches x dp = {self.micro_batch_size} x "
                f"{self.microbatches} x {self.dp} = {self.round_batch} samples; choose a multiple "
                f"of {self.round_batch}, or another micro_batch_size or microbatches"
            )
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        for name, needs in (("checkpoint_every", "where to save"), ("resume", "what to load")):
            if getattr(self, name) and not self.checkpoint_dir:
                raise ValueError(f"--{name.replace('_', '-')} needs --checkpoint-dir ({needs})")
        for name in (
            "warmup_steps",
            "base_batch",
            "compression_warmup",
            "checkpoint_every",
            "max_memory_mb",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "bucket_cap_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.zero and self.compression:
            from clawcomm.compression import get_compressor

            if not get_compressor(self.compression).reduces_scatter:
                raise ValueError(
                    f"zero {self.zero} with compression {self.compression!r} is not supported: "
                    "the compressor has no reduce-scatter; use zero 0 for it"
                )
        from clawcomm.train import outer

        outer.check(self)
        if self.param_compression != "none" and not self.zero:
            raise ValueError(
                f"param_compression {self.param_compression!r} compresses the ZeRO parameter "
                "all-gather: it needs zero 1, 2 or 3"
            )
        if self.reshard_after_forward and self.zero != 3:
            raise ValueError(
                f"reshard_after_forward frees gathered parameters: it needs zero 3, not zero "
                f"{self.zero}"
            )
        if not self.clip >= 0:
            raise ValueError(f"clip must be >= 0, got {self.clip}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if world_size is not None and self.world != world_size:
            cp = " * cp" if self.cp > 1 else ""
            cpv = f" * {self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"dp{cp} * tp * pp = {self.dp}{cpv} * {self.tp} * {self.pp} = {self.world} ranks, "
                f"but the world has {world_size}; choose dp{cp}, tp and pp with "
                f"dp{cp} * tp * pp == {world_size}"
            )
        self.check_tp()
        from clawcomm.train import deterministic

        deterministic.check(self)
        check_schedule_args(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        if self.model == "wait":
            self.wait_times()
        self.check_files()
        from clawcomm.train import device

        device.check(self.device)
        if self.compression:
            from clawcomm.compression import get_compressor

            get_compressor(self.compression)

    def check_tp(self) -> None:
        """The tensor-parallel settings suit the model and the other flags."""
        from clawcomm.parallel import tensor

        if self.sequence_parallel and self.tp > 1 and self.model == "mlp":
            raise ValueError(
                "sequence_parallel splits tokens, and the mlp has none: give "
                "--no-sequence-parallel or leave it unset"
            )
        if self.tp_overlap and self.tp > 1 and not self.sequence_parallel_on:
            raise ValueError(
                "tp_overlap overlaps the sequence-parallel all-gathers and reduce-scatters: it "
                "needs sequence_parallel"
            )
        tensor.check(
            self.model, self.tp, self.heads, self.seq_len // self.cp, self.sequence_parallel_on
        )
        from clawcomm.parallel import context

        context.check(self)
        from clawcomm.train import recompute

        recompute.check(self.activation_checkpoint, self.model)
        from clawcomm.train import moe

        moe.check(self)

    def check_files(self) -> None:
        """The corpus files named exist and suit the model (what they hold is
        ``clawcomm.train.cli.read_corpus``'s to check)."""
        import os

        if self.is_gpt and self.text and not os.path.isfile(self.text):
            raise ValueError(f"text {self.text!r} is not a file (gpt trains on a UTF-8 text)")
        for name in ("data", "data_val"):
            path = getattr(self, name)
            if path and not self.is_gpt:
                raise ValueError(f"{name} is a token file for gpt, not for model {self.model}")
            if path and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file (a token file of uint16/32 ids)")
        if self.data and self.text:
            raise ValueError("give text or data, not both: gpt trains on one corpus")
        if self.data_val and not self.data:
            raise ValueError("data_val is the held-out part of --data: give data too")
