"""Data for the trainer, all offline.

- Text: a character-level corpus. By default the Python documentation that
  ships with every CPython (``pydoc_data.topics``, about 460 KB of English
  prose and code); ``--text FILE`` trains on any UTF-8 file instead
  (``read_text``: a file that is not UTF-8 is refused, naming the byte).
- Digits: scikit-learn's bundled 8x8 digits (1797 images, 10 classes).
- Waiting: a small random tensor per sample (the waiting model ignores it).
- Token files (``--data``): ``tokens.py``.

``global_batches`` yields one effective batch per step: ``batch`` samples
drawn with a generator seeded by (seed, step). Every layout draws the same
samples for the same step and cuts them the same way (replica, then
accumulation round, then micro-batch), so the same seed and effective batch
give the same loss curve whatever dp, pp and the schedule are.
"""

from __future__ import annotations

import itertools

import torch


class CharText:
    """Characters of ``text`` as token ids; a sample is ``block`` tokens and
    the same shifted by one."""

    def __init__(self, text: str, block: int, split: float = 0.9, source: str = "the text"):
        self.check(text, block, source)
        self.chars = sorted(set(text))
        self.vocab = len(self.chars)
        self.block = block
        table = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([table[c] for c in text], dtype=torch.int64)
        cut = int(split * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]

    @staticmethod
    def check(text: str, block: int, source: str) -> None:
        """Refuses a text too short for a sample in each part, naming ``source``."""
        need = 2 * (block + 1)
        if len(text) < need:
            raise ValueError(
                f"{source}: {len(text)} characters, too few for samples of {block} + 1 (at "
                f"least {need}: one to train on, one held out; --seq-len {block})"
            )

    def __len__(self) -> int:
        return len(self.train) - self.block - 1

    def batch(self, index: torch.Tensor, split: str = "train"):
        data = self.train if split == "train" else self.val
        offsets = index.unsqueeze(1) + torch.arange(self.block + 1)
        rows = data[offsets % len(data)]
        return rows[:, :-1], rows[:, 1:]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def read_text(path: str) -> str:
    """The UTF-8 text in file ``path``; a ValueError naming the file where
    it is not text."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); a "
            "binary file?"
        ) from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None


def default_text() -> str:
    """The Python documentation topics bundled with CPython (offline)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


class Digits:
    def __init__(self, seed: int = 0, split: float = 0.8):
        import numpy as np

        from clawcomm import digits

        data, target = digits.load()
        x = torch.from_numpy((data / 16.0).astype(np.float32))
        y = torch.from_numpy(target)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        cut = int(split * len(x))
        self.x, self.y = x[order[:cut]], y[order[:cut]]
        self.x_test, self.y_test = x[order[cut:]], y[order[cut:]]

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, index: torch.Tensor):
        return self.x[index], self.y[index]


class Noise:
    """Inputs for the waiting model: ``width`` random numbers per sample."""

    def __init__(self, width: int = 16):
        self.width = width

    def __len__(self) -> int:
        return 1 << 20

    def batch(self, index: torch.Tensor):
        return torch.ones(len(index), self.width), torch.zeros(len(index), dtype=torch.int64)


def replica_rows(cfg, dp_rank: int) -> slice:
    """Replica ``dp_rank``'s rows of each effective batch."""
    per = cfg.effective_batch // cfg.dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def rounds(cfg, dp_rank: int, x, y, whole: bool, inputs: bool, targets: bool, device):
    """(accumulation round, its micro-batches' inputs or None, targets or
    None) of replica ``dp_rank``'s slice of a batch (``whole``: ``x`` and
    ``y`` are the effective batch; else the replica's slice), on ``device``:
    the cut every layout makes, replica, then round, then micro-batch."""
    mine = replica_rows(cfg, dp_rank)
    per_replica = mine.stop - mine.start
    lo = mine.start if whole else 0

    def cut(t, a: int):
        rows = slice(lo + a * per_replica // cfg.accumulation,
                     lo + (a + 1) * per_replica // cfg.accumulation)  # fmt: skip
        return list(t[rows].to(device, non_blocking=True).chunk(cfg.microbatches))

    for a in range(cfg.accumulation):
        yield a, cut(x, a) if inputs else None, cut(y, a) if targets else None


def step_indices(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """The ``batch`` sample indices of ``step``, drawn uniformly from
    [0, n) with a generator seeded from seed and step: the one draw every
    data source and layout shares."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n, (batch,), generator=g)


def global_batches(dataset, batch: int, seed: int, start: int = 0):
    """Effective batches for steps start, start+1, ...: ``step_indices``."""
    for step in itertools.count(start):
        yield dataset.batch(step_indices(len(dataset), batch, seed, step))
