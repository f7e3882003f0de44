"""The compression lab's two tasks, each a model, an optimizer factory, a
batch sampler and an evaluation returning (loss, accuracy); every rank
builds the same weights from the seed and draws its own batches.

- ``mlp``: scikit-learn's bundled digits (1797 8x8 images, 10 classes), an
  MLP (64-256-256-10, 85k parameters), SGD; final loss on the whole training
  set, accuracy on the test set.
- ``gpt``: ``clawcomm train``'s character-level GPT (4 blocks of width 128,
  0.8M parameters, 64-character context) on the Python documentation
  bundled with CPython, AdamW; loss and next-character accuracy on 32 fixed
  batches of the held-out 10%.
"""

from __future__ import annotations


def digits(seed: int):
    import numpy as np

    from clawcomm import digits as bundled

    data, target = bundled.load()
    x = (data / 16.0).astype(np.float32)
    y = target
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def mlp_task(cfg: dict, rank: int):
    """The model, an optimizer factory, a batch sampler, and an evaluation
    returning (loss, accuracy) of the task."""
    import torch

    dev = cfg.get("device", "cpu")
    xtr, ytr, xte, yte = (torch.from_numpy(a).to(dev) for a in digits(cfg["seed"]))
    torch.manual_seed(cfg["seed"])
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)

    def make_opt(params):
        return torch.optim.SGD(
            params, lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"]
        )

    def batch():
        idx = torch.randint(0, len(xtr), (cfg["batch"],), generator=gen).to(dev)
        return xtr[idx], ytr[idx]

    def evaluate():
        with torch.no_grad():
            loss = float(loss_fn(model(xtr), ytr))
            accuracy = float((model(xte).argmax(1) == yte).float().mean())
        return loss, accuracy

    return model, loss_fn, make_opt, batch, evaluate


def gpt_held_out(ds, dev):
    """32 fixed batches of 16 sequences from the held-out 10%."""
    import torch

    return [
        tuple(
            t.to(dev)
            for t in ds.batch(
                torch.randint(
                    0, len(ds.val) - 65, (16,), generator=torch.Generator().manual_seed(i)
                ),
                "val",
            )
        )
        for i in range(32)
    ]


def gpt_evaluate(model, held_out) -> tuple[float, float]:
    """Loss and next-character accuracy of ``model`` on ``held_out``."""
    import torch

    from clawcomm.train import models

    total = correct = tokens = 0.0
    with torch.no_grad():
        for x, y in held_out:
            logits = model(x)
            total += float(models.gpt_loss(logits, y))
            correct += float((logits.argmax(-1) == y).sum())
            tokens += y.numel()
    return total / tokens, correct / tokens


def gpt_task(cfg: dict, rank: int):
    import torch

    from clawcomm.train import data, models

    ds = data.CharText(data.default_text(), 64)
    torch.manual_seed(cfg["seed"])
    model = models.gpt(ds.vocab, 128, 4, 4, 64)

    def loss_fn(logits, y):
        return models.gpt_loss(logits, y) / y.numel()

    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    dev = cfg.get("device", "cpu")
    held_out = gpt_held_out(ds, dev)

    def make_opt(params):
        return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])

    def batch():
        x, y = ds.batch(torch.randint(0, len(ds), (cfg["batch"],), generator=gen))
        return x.to(dev), y.to(dev)

    def evaluate():
        return gpt_evaluate(model, held_out)

    return model, loss_fn, make_opt, batch, evaluate
