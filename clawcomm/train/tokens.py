"""Token files: a corpus as a flat file of token ids, as nanoGPT and
Megatron read them, and the loader that streams it to the trainer.

    clawcomm tokenize corpus.txt data/           # data/train.bin, val.bin, meta.json
    clawcomm train --data data/train.bin --data-val data/val.bin

A token file is the ids one after another, uint16 (vocabularies up to
65,536) or uint32, no header; nanoGPT's ``prepare.py`` writes the same. A
``meta.json`` beside it (written by ``clawcomm tokenize``) gives the dtype,
the vocabulary size and the characters the ids stand for; without one the
dtype is ``--data-dtype`` and the vocabulary the largest id plus one (read
once, in chunks).

A sample is ``seq_len + 1`` consecutive tokens from a uniformly drawn start
(inputs, and targets shifted by one). Each step's starts are drawn as the
trainer's other data sets draw theirs (seeded by seed and step, the whole
effective batch), so the same seed and global batch give the same samples
whatever the layout; each data-parallel replica then reads only its own
rows, and ranks of a replica that need neither inputs nor targets (the
middle pipeline stages) read nothing. Each sample is one positioned read
(``preadv``) straight into the batch: the file stays in the kernel's page
cache, never in the process, whose resident memory so grows neither with
the file nor with what it read. (A memory map, as nanoGPT reads, maps the
page cache's folios into the process: on this machine's kernel those are
2 MB, so a 32-sample batch read through a map raised the resident set by
63 MB until it was unmapped.)

``Prefetcher`` prepares the next batches on a background thread while the
step runs; the trainer times how long each step waits for its batch
(``data_wait_ms``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading

import numpy as np
import torch

META = "meta.json"
DTYPES = ("uint16", "uint32")
_SCAN_CHUNK = 1 << 24  # ids per read when looking for the largest one


@dataclasses.dataclass
class ReplicaSlice:
    """This data-parallel replica's rows of one effective batch: inputs and
    targets (None on a rank that needs neither), and the items (tokens) in
    the whole effective batch, which the loss is averaged over."""

    x: torch.Tensor | None
    y: torch.Tensor | None
    items: int


def read_meta(path: str) -> dict:
    """The ``meta.json`` beside token file ``path``, or {}."""
    meta = os.path.join(os.path.dirname(os.path.abspath(path)), META)
    if not os.path.isfile(meta):
        return {}
    with open(meta) as f:
        return json.load(f)


class TokenFile:
    """The token ids in ``path`` as samples of ``block`` tokens (and the
    same shifted by one)."""

    def __init__(self, path: str, block: int, dtype: str = "uint16"):
        meta = read_meta(path)
        self.dtype = np.dtype(meta.get("dtype", dtype))
        if self.dtype.name not in DTYPES:
            raise ValueError(f"token file {path}: dtype {self.dtype.name} is not uint16 or uint32")
        size = os.path.getsize(path)
        if size % self.dtype.itemsize:
            raise ValueError(
                f"token file {path}: {size} bytes is not a whole number of {self.dtype.name} ids"
            )
        self.path, self.block = path, block
        self.tokens = size // self.dtype.itemsize
        if self.tokens < block + 2:
            raise ValueError(
                f"token file {path}: {self.tokens} tokens, too few for samples of {block} + 1"
            )
        self.vocab = int(meta["vocab"]) if "vocab" in meta else self._largest_id() + 1
        self.chars = meta.get("chars")

    def _largest_id(self) -> int:
        top = 0
        with open(self.path, "rb") as f:
            while True:
                ids = np.fromfile(f, self.dtype, _SCAN_CHUNK)
                if ids.size == 0:
                    return top
                top = max(top, int(ids.max()))

    def __len__(self) -> int:
        return self.tokens - self.block - 1

    def batch(self, index: torch.Tensor):
        """(inputs, targets) of the samples starting at ``index``, int64."""
        rows = np.empty((len(index), self.block + 1), self.dtype)
        width = self.dtype.itemsize
        with open(self.path, "rb", buffering=0) as f:
            for row, start in zip(rows, index.tolist(), strict=True):
                got = os.preadv(f.fileno(), [row], start * width)
                if got != row.nbytes:
                    raise OSError(f"token file {self.path}: {got} bytes read at token {start}, "
                                  f"not {row.nbytes} (was it cut short?)")  # fmt: skip
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def decode(self, ids) -> str:
        if self.chars is None:
            raise ValueError(f"token file {self.path}: no characters known (no {META})")
        return "".join(self.chars[int(i)] for i in ids)


VAL_SEED = 7_777_777  # added to --seed for the held-out batches' draw


def held_out(val, batch: int, seed: int, rows: slice, need: bool, count: int) -> list:
    """``count`` held-out ReplicaSlices of token file ``val``: the same at
    every evaluation, drawn with a seed of their own."""
    draws = replica_batches(val, batch, seed + VAL_SEED, rows, need)
    return [next(draws) for _ in range(count)]


def replica_batches(ds, batch: int, seed: int, rows: slice, need: bool, start: int = 0):
    """ReplicaSlices for steps start, start+1, ...: the effective batch's
    starts drawn as ``data.global_batches`` draws them, this replica's
    ``rows`` of them read (when ``need``)."""
    from clawcomm.train.data import step_indices

    step = start
    while True:
        index = step_indices(len(ds), batch, seed, step)[rows]
        x, y = ds.batch(index) if need else (None, None)
        yield ReplicaSlice(x, y, batch * ds.block)
        step += 1


class Prefetcher:
    """Iterates over ``batches`` on a background thread, ``depth`` items
    ahead (pinned, for a copy to a GPU, where ``pin``). An error in the
    thread is raised by the ``next`` that would have got its item."""

    _END = object()

    def __init__(self, batches, depth: int = 2, pin: bool = False):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._pin = pin
        self._thread = threading.Thread(
            target=self._fill, args=(iter(batches),), name="clawcomm-prefetch", daemon=True
        )
        self._thread.start()

    def _fill(self, it) -> None:
        try:
            for item in it:
                if self._pin:
                    item = _pinned(item)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._END)
        except BaseException as e:  # handed to the consumer
            self._queue.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _pinned(item):
    if isinstance(item, ReplicaSlice):
        return dataclasses.replace(
            item,
            x=None if item.x is None else item.x.pin_memory(),
            y=None if item.y is None else item.y.pin_memory(),
        )
    return tuple(t.pin_memory() for t in item)


# ---- clawcomm tokenize --------------------------------------------------------------------


def tokenize(text: str, out_dir: str, val_fraction: float = 0.1) -> dict:
    """Writes ``text`` as token files with the trainer's character
    tokeniser (the ids ``--text`` training uses): ``train.bin``, ``val.bin``
    (the last ``val_fraction``) and ``meta.json``; returns the meta."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val fraction {val_fraction} is not in [0, 1)")
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    chars, ids = np.unique(points, return_inverse=True)
    dtype = "uint16" if chars.size <= 1 << 16 else "uint32"
    ids = ids.astype(dtype)
    cut = int(round(ids.size * (1 - val_fraction)))
    os.makedirs(out_dir, exist_ok=True)
    ids[:cut].tofile(os.path.join(out_dir, "train.bin"))
    ids[cut:].tofile(os.path.join(out_dir, "val.bin"))
    meta = {
        "tokenizer": "chars",
        "dtype": dtype,
        "vocab": int(chars.size),
        "chars": "".join(map(chr, chars.tolist())),
        "train_tokens": cut,
        "val_tokens": int(ids.size - cut),
    }
    with open(os.path.join(out_dir, META), "w") as f:
        json.dump(meta, f)
    return meta


def add_arguments(p) -> None:
    p.add_argument("text", help="a UTF-8 text file")
    p.add_argument("out_dir", help="where train.bin, val.bin and meta.json go")
    p.add_argument(
        "--val-fraction", type=float, default=0.1, help="the tail kept for held-out loss (0.1)"
    )


def run(args) -> int:
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
        meta = tokenize(text, args.out_dir, args.val_fraction)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"clawcomm tokenize: error: {e}")
        return 2
    print(
        f"clawcomm tokenize: {meta['train_tokens']} + {meta['val_tokens']} tokens "
        f"({meta['vocab']} characters, {meta['dtype']}) in {args.out_dir}/train.bin and val.bin; "
        f"train with --data {args.out_dir}/train.bin --data-val {args.out_dir}/val.bin"
    )
    return 0
