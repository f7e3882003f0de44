"""Bad input, tried as a new user would: every file ``clawcomm train`` and
``clawcomm tokenize`` read is checked before any rank starts, and what is
wrong is one line naming the file, with exit status 2 and no traceback. A
token file says what it was read as; a checkpoint whose newest step is
damaged is named, and the run goes on from the intact step before it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _training import _save_at

from clawcomm.cli import main
from clawcomm.train import tokens
from clawcomm.train.cli import read_corpus
from clawcomm.train.config import TrainConfig

RNG = np.random.default_rng(0)


def _run(capfd, *argv) -> tuple[int, str, str]:
    """``clawcomm ARGV`` in this process: (status, stdout, stderr), forked
    ranks' output included."""
    capfd.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's refusal
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


def _refused(capfd, *argv) -> str:
    """The one line ``clawcomm ARGV`` refuses it with, before any rank starts."""
    code, out, err = _run(capfd, *argv)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "parameters" not in out, out  # rank 0 would have said the model's size
    return err.strip()


def _file(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, np.ndarray):
        content.tofile(path)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    return str(path)


def _ids(dtype, top: int, n: int = 4096) -> np.ndarray:
    return RNG.integers(0, top, n).astype(dtype)


TEXT = "Sphinx of black quartz, judge my vow.\n" * 10

BAD = {
    # --text: a file that cannot be trained on
    "empty text": (["--text", ("e.txt", "")], "{}: 0 characters, too few for samples of 64 + 1"),
    "short text": (["--text", ("s.txt", "hello\n")], "{}: 6 characters, too few for samples"),
    "binary text": (
        ["--text", ("b.txt", b"\x89PNG\r\n\x1a\n\x00\xff" * 40)],
        "{}: not UTF-8 text (byte 0x89 at offset 0); a binary file?",
    ),
    # --data: what cannot be ids of the dtype it is read as
    "odd-sized data": (["--data", ("o.bin", b"\x01\x00\x02")], "token file {}: 3 bytes is not"),
    "empty data": (["--data", ("e.bin", b"")], "token file {}: empty"),
    "short data": (["--data", ("s.bin", _ids(np.uint16, 9, 40))], "token file {}: 40 tokens, too"),
    "float32 data": (
        ["--data", ("f.bin", RNG.random(4096).astype(np.float32))],
        "token file {}: float32 numbers, not uint16 ids (100% of its 4-byte words are floats",
    ),
    "float32 data as uint32": (
        [
            "--data",
            ("f.bin", RNG.standard_normal(4096).astype(np.float32)),
            "--data-dtype",
            "uint32",
        ],
        "token file {}: float32 numbers, not uint32 ids",
    ),  # fmt: skip
    "float64 data": (
        ["--data", ("d.bin", RNG.random(4096))],
        "token file {}: float64 numbers, not uint16 ids",
    ),
    "uint32 data read as uint16": (
        ["--data", ("u.bin", _ids(np.uint32, 60))],
        "token file {}: read as uint16, the ids in odd places reach 0 and the others 59: these "
        "are uint32 ids; give --data-dtype uint32 (or a meta.json)",
    ),
    "uint16 data read as uint32": (
        ["--data", ("u.bin", _ids(np.uint16, 50257)), "--data-dtype", "uint32"],
        "token file {}: read as uint32, the ids' high halves reach",
    ),
    "a vocabulary past any tokeniser's": (
        ["--data", ("v.bin", _ids(np.uint32, 5_000_000)), "--data-dtype", "uint32"],
        "token file {}: its largest uint32 id is 4,99",
    ),
    # --resume and --checkpoint-every need a folder: said with the flags' names
    "resume without a folder": (["--resume"], "--resume needs --checkpoint-dir (what to load)"),
    "a checkpoint folder that is a file": (
        ["--resume", "--checkpoint-dir", ("ck", "not a folder")],
        "--checkpoint-dir {}: is a file, not a folder",
    ),
    "checkpoint-every without a folder": (
        ["--checkpoint-every", "5"],
        "--checkpoint-every needs --checkpoint-dir (where to save)",
    ),
}


@pytest.mark.parametrize("args,message", BAD.values(), ids=BAD.keys())
def test_a_bad_input_is_one_line_naming_it_before_any_rank_starts(tmp_path, capfd, args, message):
    argv, path = [], ""
    for a in args:
        if isinstance(a, tuple):
            a = path = _file(tmp_path, *a)
        argv.append(a)
    model = [] if "--data" in argv or "--text" in argv else ["--model", "mlp"]
    line = _refused(capfd, "train", *model, *argv, "--steps", "1")
    assert line.startswith("clawcomm train: error: " + message.format(path)), line


def _tokenized(tmp_path) -> str:
    tokens.tokenize(TEXT, str(tmp_path / "data"), val_fraction=0.2, seq_len=16)
    return str(tmp_path / "data")


def test_a_dtype_that_contradicts_meta_json_is_refused(tmp_path, capfd):
    data = _tokenized(tmp_path)
    line = _refused(capfd, "train", "--data", f"{data}/train.bin", "--data-dtype", "uint32")
    assert line == (
        f"clawcomm train: error: token file {data}/train.bin: --data-dtype uint32 contradicts "
        f"{data}/meta.json, which says uint16: drop --data-dtype"
    )


def test_a_held_out_file_past_the_vocabulary_is_refused(tmp_path, capfd):
    train = _file(tmp_path, "t.bin", _ids(np.uint16, 50))
    val = _file(tmp_path, "v.bin", _ids(np.uint16, 90))
    line = _refused(capfd, "train", "--data", train, "--data-val", val)
    assert line.startswith(
        f"clawcomm train: error: --data-val {val} holds ids up to 89, past"
    ), line


def test_what_a_token_file_was_read_as_is_said(tmp_path):
    data = _tokenized(tmp_path)
    vocab = len(set(TEXT))
    bare = _file(tmp_path, "bare/ids.bin", _ids(np.uint16, 60))
    wide = _file(tmp_path, "wide/ids.bin", _ids(np.uint32, 70_000))
    cfg = TrainConfig(data=f"{data}/train.bin", data_val=f"{data}/val.bin", seq_len=16)
    assert read_corpus(cfg) == [
        f"clawcomm train: --data {data}/train.bin: 304 tokens, uint16 ids (meta.json), "
        f"vocabulary {vocab} (meta.json)",
        f"clawcomm train: --data-val {data}/val.bin: 76 tokens, uint16 ids (meta.json), "
        f"vocabulary {vocab} (meta.json)",
    ]
    top = int(np.fromfile(bare, np.uint16).max())
    assert read_corpus(TrainConfig(data=bare)) == [
        f"clawcomm train: --data {bare}: 4,096 tokens, uint16 ids (no meta.json: the default), "
        f"vocabulary {top + 1} (the largest id + 1)"
    ]
    top = int(np.fromfile(wide, np.uint32).max())
    assert read_corpus(TrainConfig(data=wide, data_dtype="uint32")) == [
        f"clawcomm train: --data {wide}: 4,096 tokens, uint32 ids (--data-dtype), "
        f"vocabulary {top + 1:,} (the largest id + 1)"
    ]


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "{}: empty"),
        ("hello\n", "{}: 6 characters leave train.bin 5 tokens, too few for one sample of "
         "--seq-len 64 (66 tokens): tokenise a longer text, or give --seq-len 3 or less here "
         "and to clawcomm train"),
        ("x" * 100, "{}: 100 characters leave val.bin 10 tokens, too few for one sample of "
         "--seq-len 64 (66 tokens): tokenise a longer text, or give --seq-len 8 or less here "
         "and to clawcomm train, or a larger --val-fraction (0: no held-out file)"),
        (b"\x00\x9f\x92\x96", "{}: not UTF-8 text (byte 0x9f at offset 1); a binary file?"),
    ],
    ids=["empty", "short", "short held-out part", "binary"],
)  # fmt: skip
def test_tokenize_refuses_what_it_could_not_train_on_and_writes_nothing(
    tmp_path, capfd, text, message
):
    path = _file(tmp_path, "corpus.txt", text)
    out = tmp_path / "out"
    code, stdout, err = _run(capfd, "tokenize", path, str(out))
    assert code == 2 and stdout == "", (stdout, err)
    assert err.strip() == "clawcomm tokenize: error: " + message.format(path), err
    assert not out.exists()


def test_tokenize_names_its_files_without_a_double_slash(tmp_path, capfd):
    path = _file(tmp_path, "corpus.txt", TEXT)
    out = f"{tmp_path}/runs/data/"
    code, stdout, _ = _run(capfd, "tokenize", path, out, "--seq-len", "16")
    assert code == 0 and "//" not in stdout, stdout
    assert f"train with --data {out}train.bin --data-val {out}val.bin" in stdout, stdout
    meta = json.loads((tmp_path / "runs" / "data" / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == len(TEXT)


MLP = ["train", "--model", "mlp", "--hidden", "32", "--quiet"]


def test_a_damaged_checkpoint_is_named_and_the_run_goes_on_from_the_step_before(tmp_path, capfd):
    root = str(tmp_path / "ck")
    _save_at(TrainConfig(model="mlp", hidden=32), root, [2, 4])
    shard = os.path.join(root, "step-00000004", "__0_0.distcp")
    os.truncate(shard, 1000)
    code, out, err = _run(capfd, *MLP, "--steps", "4", "--checkpoint-dir", root, "--resume")
    assert code == 0, (out, err)
    said = out.splitlines()[0]
    assert said.startswith(f"clawcomm train: --resume: {shard}: cut short, 1000 bytes"), out
    assert said.endswith(f"; going on from {root}/step-00000002, the newest intact checkpoint")
    assert "resumed from step 2" in out and "at step 4, after 2 steps resumed from step 2" in out
    assert os.path.getsize(shard) > 1000  # saved again, over the damaged one


def test_no_intact_checkpoint_is_one_line_before_any_rank_starts(tmp_path, capfd):
    root = str(tmp_path / "ck")
    _save_at(TrainConfig(model="mlp", hidden=32), root, [2])
    os.truncate(os.path.join(root, "step-00000002", "__0_0.distcp"), 1000)
    line = _refused(capfd, *MLP, "--steps", "4", "--checkpoint-dir", root, "--resume")
    assert line.startswith(f"clawcomm train: error: --resume: no intact checkpoint in {root}: ")
    assert line.endswith("; without --resume the run starts from step 0 (its saves replace them)")
