"""Token files: a corpus as a flat file of token ids, as nanoGPT and
Megatron read them, and the loader that streams it to the trainer.

    clawcomm tokenize corpus.txt data/           # data/train.bin, val.bin, meta.json
    clawcomm train --data data/train.bin --data-val data/val.bin

A token file is the ids one after another, uint16 (vocabularies up to
65,536) or uint32, no header; nanoGPT's ``prepare.py`` writes the same. A
``meta.json`` beside it (written by ``clawcomm tokenize``) gives the dtype,
the vocabulary size and the characters the ids stand for, and a
``--data-dtype`` that contradicts it is refused; without one the dtype is
``--data-dtype`` (uint16 unless given) and the vocabulary the largest id
plus one (read once, in chunks), and a file whose values cannot be ids of
that dtype is refused (``TokenFile._check_ids``).

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
import sys
import threading

import numpy as np
import torch

META = "meta.json"
DTYPES = ("uint16", "uint32")
_SCAN_CHUNK = 1 << 24  # ids per read when looking for the largest one
# Past any tokeniser's vocabulary (the largest have about 260k entries): a
# file whose ids reach this is not ids, or not of the dtype it is read as.
MAX_VOCAB = 1 << 22


@dataclasses.dataclass
class ReplicaSlice:
    """This data-parallel replica's rows of one effective batch: inputs and
    targets (None on a rank that needs neither), and the items (tokens) in
    the whole effective batch, which the loss is averaged over."""

    x: torch.Tensor | None
    y: torch.Tensor | None
    items: int


def meta_path(path: str) -> str:
    """Where the ``meta.json`` of token file ``path`` is (beside it)."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), META)


def read_meta(path: str) -> dict:
    """The ``meta.json`` beside token file ``path``, or {}."""
    meta = meta_path(path)
    if not os.path.isfile(meta):
        return {}
    try:
        with open(meta) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta}: cannot be read as JSON ({e})") from None


class TokenFile:
    """The token ids in ``path`` as samples of ``block`` tokens (and the
    same shifted by one). ``dtype``: the ids' type, "auto" for meta.json's
    (uint16 without one); one that contradicts meta.json is refused.

    Without a meta.json nothing says the file holds ids of that dtype, so
    the file is read once and refused where its values cannot be: float
    bit patterns, the halves of uint32 ids read as uint16 (or the reverse),
    or a vocabulary past any tokeniser's (``_check_ids``)."""

    def __init__(self, path: str, block: int, dtype: str = "auto"):
        meta = read_meta(path)
        said = meta.get("dtype")
        if said and dtype != "auto" and dtype != said:
            raise ValueError(
                f"token file {path}: --data-dtype {dtype} contradicts {meta_path(path)}, which "
                f"says {said}: drop --data-dtype"
            )
        self.dtype = np.dtype(said or (dtype if dtype != "auto" else "uint16"))
        self.dtype_from = (
            META if said else ("--data-dtype" if dtype != "auto" else f"no {META}: the default")
        )
        if self.dtype.name not in DTYPES:
            raise ValueError(f"token file {path}: dtype {self.dtype.name} is not uint16 or uint32")
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"token file {path}: empty")
        if size % self.dtype.itemsize:
            raise ValueError(
                f"token file {path}: {size} bytes is not a whole number of {self.dtype.name} ids"
            )
        self.path, self.block = path, block
        self.tokens = size // self.dtype.itemsize
        if self.tokens < block + 2:
            raise ValueError(
                f"token file {path}: {self.tokens} tokens, too few for samples of {block} + 1 "
                f"(--seq-len {block})"
            )
        if "vocab" in meta:
            self.vocab, self.vocab_from = int(meta["vocab"]), META
        else:
            self.vocab, self.vocab_from = self._largest_id() + 1, "the largest id + 1"
        self.chars = meta.get("chars")

    def describe(self) -> str:
        """What the file was read as: tokens, dtype and vocabulary, and where each came from."""
        return (
            f"{self.path}: {self.tokens:,} tokens, {self.dtype.name} ids ({self.dtype_from}), "
            f"vocabulary {self.vocab:,} ({self.vocab_from})"
        )

    def _largest_id(self) -> int:
        """The largest id, the file read once in chunks; the first chunk
        must look like ids of this dtype (``_check_ids``)."""
        top, first = 0, True
        with open(self.path, "rb") as f:
            while True:
                ids = np.fromfile(f, self.dtype, _SCAN_CHUNK)
                if ids.size == 0:
                    break
                if first:
                    self._check_ids(ids)
                    first = False
                top = max(top, int(ids.max()))
        if top + 1 > MAX_VOCAB:
            raise ValueError(
                f"token file {self.path}: its largest {self.dtype.name} id is {top:,}, a "
                f"vocabulary past any tokeniser's: not token ids, or not {self.dtype.name} "
                "(--data-dtype)"
            )
        return top

    def _check_ids(self, ids: np.ndarray) -> None:
        """Refuses ``ids`` (the file's first chunk) where they are bit
        patterns that ids almost never make:

        - floats: a float32's exponent byte lands in a narrow band for
          numbers of ordinary size; uint16 ids make it ((id >> 7) & 0xFF of
          every second id) land there rarely and uint32 ids below 2**23
          never. Likewise float64.
        - uint32 ids read as uint16: every second id is a high half, 0 for
          ids below 65536, so the odd places stay far below the even ones.
        - uint16 ids read as uint32: the high halves are ids too, as large
          as the low ones, where real uint32 ids keep them below 64."""
        raw = ids.view(np.uint8)
        for width, exponent_bits, bias, band in ((4, 8, 127, 30), (8, 11, 1023, 60)):
            words = raw[: raw.size // width * width].view(f"<u{width}")
            bits = 8 * width - 1  # below the sign
            words = words[(words & ((1 << bits) - 1)) != 0]  # +-0 says nothing
            if words.size < 16:
                continue
            exponent = (words >> (bits - exponent_bits)) & ((1 << exponent_bits) - 1)
            share = float(np.mean(np.abs(exponent.astype(np.int64) - bias) <= band))
            if share >= 0.9:
                raise ValueError(
                    f"token file {self.path}: float{8 * width} numbers, not "
                    f"{self.dtype.name} ids ({100 * share:.0f}% of its {width}-byte words are "
                    "floats of ordinary size); a token file holds uint16 or uint32 ids"
                )
        if ids.size < 256:
            return
        if self.dtype == np.uint16:
            even, odd = int(ids[0::2].max()), int(ids[1::2].max())
            if odd * 16 < even:
                raise ValueError(
                    f"token file {self.path}: read as uint16, the ids in odd places reach "
                    f"{odd} and the others {even}: these are uint32 ids; give --data-dtype "
                    "uint32 (or a meta.json)"
                )
        else:
            low, high = int((ids & 0xFFFF).max()), int((ids >> 16).max())
            if high and high * 16 >= low:
                raise ValueError(
                    f"token file {self.path}: read as uint32, the ids' high halves reach {high} "
                    f"and their low halves {low}: these are pairs of uint16 ids; give "
                    "--data-dtype uint16 (or a meta.json)"
                )

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


def tokenize(text: str, out_dir: str, val_fraction: float = 0.1, seq_len: int = 64) -> dict:
    """Writes ``text`` as token files with the trainer's character
    tokeniser (the ids ``--text`` training uses): ``train.bin``, ``val.bin``
    (the last ``val_fraction``) and ``meta.json``; returns the meta. Refuses
    a text that leaves either file too short for one sample of ``seq_len``
    tokens (the trainer's --seq-len), before writing anything."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val fraction {val_fraction} is not in [0, 1)")
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    chars, ids = np.unique(points, return_inverse=True)
    cut = int(round(ids.size * (1 - val_fraction)))
    if not text:
        raise ValueError("empty")
    need = seq_len + 2  # one sample: seq_len + 1 tokens from a start drawn among >= 1
    held = ids.size - cut if val_fraction else need  # (val_fraction 0: no val.bin)
    for name, count in (("train.bin", cut), ("val.bin", held)):
        if count < need:
            fix = "tokenise a longer text"
            if count > 2:
                fix += f", or give --seq-len {count - 2} or less here and to clawcomm train"
            if name == "val.bin":
                fix += ", or a larger --val-fraction (0: no held-out file)"
            raise ValueError(
                f"{len(text)} characters leave {name} {count} tokens, too few for one sample "
                f"of --seq-len {seq_len} ({need} tokens): {fix}"
            )
    dtype = "uint16" if chars.size <= 1 << 16 else "uint32"
    ids = ids.astype(dtype)
    os.makedirs(out_dir, exist_ok=True)
    ids[:cut].tofile(os.path.join(out_dir, "train.bin"))
    if val_fraction:
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
        "--val-fraction",
        type=float,
        default=0.1,
        help="the tail kept for held-out loss (0.1; 0: no val.bin)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=64,
        help="the --seq-len you will train with: each file must hold a sample of it (64)",
    )


def run(args) -> int:
    from clawcomm.train.data import read_text

    try:
        text = read_text(args.text)  # (its errors name the file)
        try:
            meta = tokenize(text, args.out_dir, args.val_fraction, args.seq_len)
        except ValueError as e:
            raise ValueError(f"{args.text}: {e}") from None
        except OSError as e:
            from clawcomm.outputs import file_in_the_way

            blocker = file_in_the_way(args.out_dir)
            why = f"{blocker} is a file, not a folder" if blocker else e.strerror
            raise ValueError(f"{args.out_dir}: cannot write there ({why})") from None
    except ValueError as e:
        print(f"clawcomm tokenize: error: {e}", file=sys.stderr)
        return 2
    train, val = (os.path.join(args.out_dir, f) for f in ("train.bin", "val.bin"))
    held = f" + {meta['val_tokens']}" if meta["val_tokens"] else ""
    files = f"{train} and {val}" if meta["val_tokens"] else train
    print(
        f"clawcomm tokenize: {meta['train_tokens']}{held} tokens ({meta['vocab']} characters, "
        f"{meta['dtype']}) in {files}; train with --data {train}"
        + (f" --data-val {val}" if meta["val_tokens"] else "")
    )
    return 0
