"""The trainer's models, each an ``nn.Sequential`` of layers that pipeline
stages cut between:

- ``gpt``: a small GPT (token and position embedding, pre-norm transformer
  blocks, a final norm and an output projection tied to the token
  embedding), character-level on a text corpus;
- ``mlp``: an MLP on scikit-learn's digits (64 -> hidden x layers -> 10);
- ``wait``: layers that hold the host without computing, as layers on an
  accelerator do (forward, input-gradient and weight-gradient passes each
  sleep a set time), so that two CPU cores can show a pipeline's bubbles and
  overlap honestly. Its gradients are "computed elsewhere": the W pass only
  says they are ready.

A model's loss returns the sum over the micro-batch (the trainer divides by
the number of items in the effective batch).

``build(cfg)`` makes the model a config names, its loss, optimizer and data;
``cut_into_stages`` cuts an ``nn.Sequential`` into pipeline stages of
balanced cost, and ``parameter_names`` names every parameter as the whole
model does (what checkpoints key on).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from clawcomm.pipeline.weight_grad import defer_weight_grad, notify_grad
from clawcomm.train.stage_cuts import balanced_cuts, measured_costs, parameter_costs

# ---- GPT ------------------------------------------------------------------------


class Embedding(nn.Module):
    """Tokens and positions. ``token_positions``: the positions of the tokens
    this rank holds under context parallelism (parallel.context; None:
    0 .. t-1)."""

    token_positions: torch.Tensor | None = None

    def __init__(self, vocab: int, dim: int, block: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(block, dim)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(held_positions(self, idx))


def held_positions(emb, idx: torch.Tensor) -> torch.Tensor:
    """The positions of ``idx``'s tokens: 0 .. t-1, or where context
    parallelism put them (``token_positions``)."""
    if emb.token_positions is not None:
        return emb.token_positions.to(idx.device)
    return torch.arange(idx.shape[1], device=idx.device)


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)).

    ``recompute`` (selective activation checkpointing, train/recompute.py):
    the LayerNorms' outputs, attention's core and the MLP's activation are
    not kept for backward but computed again there from what is kept anyway;
    the projections are not recomputed."""

    recompute = False
    # Attention over a context-parallel group, fn(q, k, v) (parallel.context);
    # None: over this rank's tokens, which are the whole sequence.
    attention_across = None

    def __init__(self, dim: int, heads: int, moe: nn.Module | None = None):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        if moe is not None:  # a mixture of experts in place of the MLP (train/moe.py)
            self.moe = moe
        else:
            self.fc = nn.Linear(dim, 4 * dim)
            self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        # Widths come from the layers' outputs, so the block also runs split
        # over a tensor-parallel group (clawcomm.parallel.tensor): its own
        # heads, and with sequence parallelism x holds a slice of the tokens.
        again = recomputed_when_saved if self.recompute else _kept
        n1 = self.norm1(x)
        with again(n1, lambda x=x: self.norm1(x)):
            qkv = self.qkv(n1)
        b, t, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = (
            z.view(b, t, self.heads, width // self.heads).transpose(1, 2)
            for z in qkv.split(width, dim=2)
        )
        if self.recompute:
            y = checkpoint(_attend, q, k, v, self.attention_across, use_reentrant=False)
        else:
            y = _attend(q, k, v, self.attention_across)
        x = x + self.proj(y)
        n2 = self.norm2(x)
        if "moe" in self._modules:
            return x + self.moe(n2)
        with again(n2, lambda x=x: self.norm2(x)):
            h = self.fc(n2)
        a = F.gelu(h)
        with again(a, lambda h=h: F.gelu(h)):
            return x + self.out(a)


def _attend(q, k, v, across=None):
    """Causal attention's core: [b, heads, t, d] each -> [b, t, heads * d]
    (``across``: over a context-parallel group)."""
    y = (
        across(q, k, v)
        if across is not None
        else F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    b, _, t, _ = y.shape
    return y.transpose(1, 2).reshape(b, t, -1)


@contextlib.contextmanager
def _kept(_tensor, _make):
    yield


@contextlib.contextmanager
def recomputed_when_saved(tensor: torch.Tensor, make):
    """Inside, a layer that saves ``tensor`` for backward keeps instead a
    note to compute it again with ``make()`` when backward needs it (once:
    a zero-bubble W pass keeps what the I pass unpacked). As Megatron's
    CheckpointWithoutOutput, for outputs that are cheap to make again from
    tensors that are kept anyway."""

    # Only its address and size: autograd keeps the pack hook as long as
    # what it packed, so the hook must not hold the tensor itself.
    ptr, numel = (tensor.data_ptr(), tensor.numel()) if tensor.is_contiguous() else (0, -1)
    del tensor

    def pack(t):
        # The layer may save a view of it (a linear layer flattens the tokens).
        same = t.data_ptr() == ptr and t.numel() == numel and t.is_contiguous()
        return _Again(make, t.shape) if same else t

    def unpack(obj):
        if isinstance(obj, _Again):
            with torch.no_grad():
                return obj.make().view(obj.shape)
        return obj

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _Again:
    __slots__ = ("make", "shape")

    def __init__(self, make, shape):
        self.make, self.shape = make, shape


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)
        self.apart: list | None = None  # see keep_apart

    def keep_apart(self) -> list:
        """From now on the projection's weight gradient is appended to the
        list returned instead of reaching ``.grad`` (deterministic training
        adds it to the tied embedding's last: clawcomm.train.deterministic)."""
        self.apart = []
        return self.apart

    def forward(self, x):
        if self.apart is None:
            return self.proj(self.norm(x))
        return nn.functional.linear(self.norm(x), _KeptApart.apply(self.proj.weight, self.apart))


class _KeptApart(torch.autograd.Function):
    """The identity on a weight whose gradient goes to ``sink.append``
    instead of the weight's ``.grad``."""

    @staticmethod
    def forward(ctx, weight, sink):
        ctx.sink = sink
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append(grad)
        return None, None


def gpt(
    vocab: int,
    dim: int = 128,
    layers: int = 4,
    heads: int = 4,
    block: int = 64,
    moe: Callable[[], nn.Module] | None = None,
    moe_every: int = 1,
):
    """[embedding, blocks..., head]; the head's projection is the token
    embedding's weight (tied: the same Parameter in the first and last
    layer, which the trainer keeps in sync across stages). ``moe`` makes a
    mixture-of-experts MLP for every ``moe_every``-th block (the last of
    each ``moe_every``), the others keep the dense MLP."""
    if dim % heads:
        raise ValueError(f"gpt: dim {dim} is not a multiple of heads {heads}")
    emb = Embedding(vocab, dim, block)
    head = Head(dim, vocab)
    head.proj.weight = emb.tokens.weight
    blocks = (
        Block(dim, heads, moe() if moe is not None and (i + 1) % moe_every == 0 else None)
        for i in range(layers)
    )
    model = nn.Sequential(emb, *blocks, head)
    for name, p in model.named_parameters():  # GPT-2's initialisation
        if p.dim() >= 2:
            std = (
                0.02 / math.sqrt(2 * layers)
                if name.endswith(("proj.weight", "out.weight", "experts.w2"))
                else 0.02
            )
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    return model


def gpt_loss(logits, targets):
    """Cross-entropy summed over every token of the micro-batch."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


# ---- MLP ------------------------------------------------------------------------


def mlp(inputs: int = 64, hidden: int = 256, layers: int = 4, classes: int = 10):
    """``layers`` blocks: (Linear, ReLU) x (layers - 1), then Linear."""
    if layers < 1:
        raise ValueError(f"mlp: layers must be >= 1, got {layers}")
    widths = [inputs] + [hidden] * (layers - 1) + [classes]
    blocks = [
        nn.Sequential(nn.Linear(widths[i], widths[i + 1]), nn.ReLU()) for i in range(layers - 1)
    ]
    return nn.Sequential(*blocks, nn.Linear(widths[-2], classes))


def classification_loss(logits, targets):
    return F.cross_entropy(logits, targets, reduction="sum")


# ---- layers that wait ----------------------------------------------------------------


class _Waiting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.layer = layer
        time.sleep(layer.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        time.sleep(layer.input_s)

        def weight_pass():
            time.sleep(layer.weight_s)
            notify_grad(layer.weight)  # computed "on the device": nothing to add here

        defer_weight_grad(weight_pass)
        return grad.contiguous(), None, None  # a dense gradient, as a real layer makes


class WaitingLayer(nn.Module):
    """Holds the host ``forward_ms`` in forward, ``input_ms`` for the input
    gradient and ``weight_ms`` for the weight gradient, with a
    ``width`` x ``width`` weight whose gradient is taken as computed
    elsewhere (left as it is, and reported ready)."""

    def __init__(self, width: int, forward_ms: float, input_ms: float, weight_ms: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, width))
        self.forward_s, self.input_s, self.weight_s = (
            forward_ms / 1e3,
            input_ms / 1e3,
            weight_ms / 1e3,
        )

    def forward(self, x):
        return _Waiting.apply(x, self.weight, self)


def waiting(
    layers: int = 8,
    width: int = 256,
    forward_ms: float = 4.0,
    input_ms: float = 4.0,
    weight_ms: float = 4.0,
    first_width: int | None = None,
):
    """``layers`` waiting layers; ``first_width`` makes the first layer's
    weight smaller (its gradient comes last in backward, so its reduction is
    the one nothing can hide)."""
    out = []
    for i in range(layers):
        w = first_width if (i == 0 and first_width) else width
        out.append(WaitingLayer(w, forward_ms, input_ms, weight_ms))
    return nn.Sequential(*out)


def waiting_loss(out, targets):
    return out.sum() * 0.0 + targets.float().sum() * 0.0


# ---- building from a config, and cutting into stages ---------------------------


def build(cfg):
    """The model (built from cfg.seed), its loss, the optimizer factory, the
    data set, items per sample for tokens/s, and a sample micro-batch."""
    from clawcomm.train import data

    torch.manual_seed(cfg.seed)
    if cfg.is_gpt:
        if cfg.data:
            from clawcomm.train import tokens

            ds = tokens.TokenFile(cfg.data, cfg.seq_len, cfg.data_dtype)
        else:
            text = data.read_text(cfg.text) if cfg.text else data.default_text()
            ds = data.CharText(text, cfg.seq_len, source=cfg.text or "the Python docs")
        experts = None
        if cfg.model == "moe":
            from clawcomm.train import moe

            experts = moe.maker(cfg)
        model = gpt(ds.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq_len, experts, cfg.moe_every)
        loss, tokens_per_sample = gpt_loss, cfg.seq_len
    elif cfg.model == "mlp":
        ds = data.Digits(cfg.seed)
        model = mlp(64, cfg.hidden, cfg.layers, 10)
        loss, tokens_per_sample = classification_loss, 0
    else:
        f, i, w = cfg.wait_times()
        ds = data.Noise(16)
        model = waiting(cfg.layers, cfg.wait_width, f, i, w)
        loss, tokens_per_sample = waiting_loss, 0

    def optimizer(params):
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
            )
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    sample = ds.batch(torch.arange(cfg.micro_batch_size))[0]
    return model, loss, optimizer, ds, tokens_per_sample, sample


def unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def cut_into_stages(
    model, num_stages: int, balance: str, sample
) -> tuple[list[nn.Module], list[int]]:
    if isinstance(model, nn.Sequential):
        layers = list(model)
        if num_stages > len(layers):
            raise ValueError(
                f"clawcomm.train: {num_stages} stages (pp x v) but the model has only "
                f"{len(layers)} layers; use fewer stages or more layers"
            )
        if balance == "time":
            if sample is None:
                raise ValueError("clawcomm.train: balance='time' needs a sample micro-batch")
            costs = measured_costs(layers, sample)
            if dist.is_initialized():  # timings differ: every rank takes rank 0's
                t = torch.tensor(costs, dtype=torch.float64)
                dist.broadcast(t, 0)
                costs = t.tolist()
        else:
            costs = parameter_costs(layers)
        cuts = balanced_cuts(costs, num_stages)
        return [nn.Sequential(*layers[cuts[s] : cuts[s + 1]]) for s in range(num_stages)], cuts
    stages = list(model)
    if len(stages) != num_stages:
        raise ValueError(
            f"clawcomm.train: {len(stages)} stage modules given for {num_stages} stages (pp x v)"
        )
    return stages, list(range(num_stages + 1))


def parameter_shapes(model, stages) -> dict[str, list[int]]:
    """Every parameter's shape in the whole model (a tensor-parallel slice's
    whole tensor's), by its name."""
    from clawcomm.parallel.split import whole_shape

    params = {id(p): p for p in (model.parameters() if isinstance(model, nn.Sequential) else ())}
    for s in stages:
        params.update({id(p): p for p in s.parameters()})
    names = parameter_names(model, stages)
    return {names[i]: whole_shape(p) for i, p in params.items()}


def parameter_names(model, stages) -> dict[int, str]:
    """id(param) -> its name in the whole model (what checkpoints key on)."""
    pairs = (
        model.named_parameters(remove_duplicate=False)
        if isinstance(model, nn.Sequential)
        else ((f"{s}.{n}", p) for s, m in enumerate(stages) for n, p in m.named_parameters())
    )
    names: dict[int, str] = {}
    for n, p in pairs:
        names.setdefault(id(p), n)  # a tied parameter keeps its first name
    return names
