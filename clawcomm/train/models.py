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
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from clawcomm.pipeline.weight_grad import defer_weight_grad, notify_grad

# ---- GPT ------------------------------------------------------------------------


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, block: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(block, dim)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(pos)


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def gpt(vocab: int, dim: int = 128, layers: int = 4, heads: int = 4, block: int = 64):
    """[embedding, blocks..., head]; the head's projection is the token
    embedding's weight (tied: the same Parameter in the first and last
    layer, which the trainer keeps in sync across stages)."""
    if dim % heads:
        raise ValueError(f"gpt: dim {dim} is not a multiple of heads {heads}")
    emb = Embedding(vocab, dim, block)
    head = Head(dim, vocab)
    head.proj.weight = emb.tokens.weight
    model = nn.Sequential(emb, *(Block(dim, heads) for _ in range(layers)), head)
    for name, p in model.named_parameters():  # GPT-2's initialisation
        if p.dim() >= 2:
            std = (
                0.02 / math.sqrt(2 * layers)
                if name.endswith(("proj.weight", "out.weight"))
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
