"""Token files (``--data``, clawcomm/train/tokens.py): ``clawcomm tokenize``
writes the trainer's own character ids; a token file trains like one
process whatever the layout, each replica reading only its own rows; the
held-out loss is the same on every layout; the prefetching loader keeps
order and passes errors on; bad files and settings are refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from _training import _check_against_reference, _config, _reference

from clawcomm.launch import run_ranks
from clawcomm.train import Trainer, tokens
from clawcomm.train import models as train_models
from clawcomm.train.cli import _batches, _held_out
from clawcomm.train.data import CharText, global_batches, step_indices

TEXT = "Sphinx of black quartz, judge my vow. Überprüfung: 7 Zeichen — ok!\n" * 60


@pytest.fixture
def corpus(tmp_path):
    tokens.tokenize(TEXT, str(tmp_path), val_fraction=0.2)
    return tmp_path


def test_tokenize_writes_the_trainers_own_character_ids(corpus):
    meta = json.loads((corpus / tokens.META).read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "chars"
    train = np.fromfile(corpus / "train.bin", np.uint16)
    val = np.fromfile(corpus / "val.bin", np.uint16)
    assert train.size + val.size == len(TEXT) and val.size == round(0.2 * len(TEXT))
    # the ids --text training gives the same text
    chars = CharText(TEXT, 8)
    assert meta["vocab"] == chars.vocab and meta["chars"] == "".join(chars.chars)
    ids = np.concatenate([train, val])
    np.testing.assert_array_equal(ids, [chars.chars.index(c) for c in TEXT])
    ds = tokens.TokenFile(str(corpus / "train.bin"), 16)
    assert ds.vocab == chars.vocab and ds.decode(train[:20]) == TEXT[:20]


def test_without_meta_the_vocabulary_is_the_largest_id_plus_one(tmp_path):
    ids = np.array([3, 9, 1, 70000, 2] * 10, np.uint32)
    ids.tofile(tmp_path / "ids.bin")
    ds = tokens.TokenFile(str(tmp_path / "ids.bin"), 4, dtype="uint32")
    assert ds.vocab == 70001
    x, y = ds.batch(torch.tensor([0, 2]))
    assert x.dtype == torch.int64 and x.tolist() == [[3, 9, 1, 70000], [1, 70000, 2, 3]]
    assert y.tolist() == [[9, 1, 70000, 2], [70000, 2, 3, 9]]
    with pytest.raises(ValueError, match="no characters known"):
        ds.decode([1])


def test_bad_token_files_and_settings_are_refused(tmp_path, corpus):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="3 bytes is not a whole number of uint16 ids"):
        tokens.TokenFile(str(tmp_path / "odd.bin"), 4)
    (tmp_path / "short.bin").write_bytes(np.arange(5, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="5 tokens, too few for samples of 4 \\+ 1"):
        tokens.TokenFile(str(tmp_path / "short.bin"), 4)
    with pytest.raises(ValueError, match="val fraction 1.0"):
        tokens.tokenize("abc", str(tmp_path / "x"), 1.0)
    train = str(corpus / "train.bin")
    for kw, message in [
        (dict(data=train, model="mlp"), "token file for gpt, not for model mlp"),
        (dict(data=str(tmp_path / "nope.bin")), "is not a file"),
        (dict(data=train, text=train), "give text or data, not both"),
        (dict(data_val=train), "give data too"),
    ]:
        with pytest.raises(ValueError, match=message):
            _config(**kw).check(1)


class _Counting(tokens.TokenFile):
    """A token file that counts the rows it reads."""

    read = 0

    def batch(self, index):
        type(self).read += len(index)
        return super().batch(index)


def test_each_replica_reads_only_its_rows_and_together_they_are_the_batch(corpus):
    ds = _Counting(str(corpus / "train.bin"), 16)
    whole = next(global_batches(ds, 8, seed=3, start=5))
    parts = []
    for r in range(2):
        _Counting.read = 0
        part = next(tokens.replica_batches(ds, 8, 3, slice(4 * r, 4 * r + 4), True, start=5))
        assert _Counting.read == 4 and part.items == 8 * 16
        parts.append(part)
    torch.testing.assert_close(torch.cat([p.x for p in parts]), whole[0])
    torch.testing.assert_close(torch.cat([p.y for p in parts]), whole[1])
    _Counting.read = 0  # a middle pipeline stage reads nothing
    idle = next(tokens.replica_batches(ds, 8, 3, slice(0, 4), False))
    assert idle.x is None and idle.y is None and _Counting.read == 0


def test_the_prefetcher_keeps_order_and_raises_the_loaders_error():
    def batches():
        for i in range(5):
            yield torch.full((2,), i), torch.zeros(2)
        raise OSError("disk gone")

    it = tokens.Prefetcher(batches(), depth=2)
    assert [int(next(it)[0][0]) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    it.close()
    done = tokens.Prefetcher(iter([(torch.ones(1), torch.ones(1))]), depth=1)
    assert len(list(done)) == 1
    done.close()


def _train_on_tokens(rank, world, cfg):
    model, loss_fn, make_opt, ds, tok, sample = train_models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tok, sample=sample)
    batches = _batches(cfg, trainer, ds, 0)
    try:
        metrics = trainer.fit(batches, progress=False, val_batches=_held_out(cfg, trainer, ds))
    finally:
        batches.close()
    with trainer.whole_params():
        params = {trainer.names[id(p)]: p.detach().clone() for p in trainer.params}
    trainer.close()
    return metrics, params


def _reference_val_loss(cfg, weights) -> float:
    """The held-out loss of ``weights`` in one process, on the whole batches."""
    model, loss_fn, *_ = train_models.build(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        val = tokens.TokenFile(cfg.data_val, cfg.seq_len)
        total = items = 0.0
        for k in range(cfg.eval_batches):
            index = step_indices(len(val), cfg.effective_batch, cfg.seed + tokens.VAL_SEED, k)
            x, y = val.batch(index)
            total += float(loss_fn(model(x), y))
            items += y.numel()
    return total / items


LAYOUTS = [(1, 1, "1f1b", 1), (2, 1, "1f1b", 1), (2, 2, "zb1", 1), (1, 2, "interleaved", 2)]


@pytest.mark.parametrize("dp,pp,schedule,v", LAYOUTS)
def test_a_token_file_trains_like_one_process_on_every_layout(corpus, dp, pp, schedule, v):
    """Each replica reading its own rows (prefetched): the losses, norms and
    weights of one process on the whole batch, and the held-out loss of the
    final weights computed in one process; every step's wait for data in
    the metrics."""
    cfg = _config(data=str(corpus / "train.bin"), data_val=str(corpus / "val.bin"),
                  dp=dp, pp=pp, schedule=schedule, virtual_stages=v, microbatches=4,
                  micro_batch_size=8 // (4 * dp), eval_every=2, eval_batches=2)  # fmt: skip
    results = run_ranks(_train_on_tokens, dp * pp, cfg)
    _check_against_reference(results, cfg)
    want = _reference_val_loss(cfg, _reference(cfg)[2])
    for metrics, _ in results:
        assert [("val_loss" in m) for m in metrics] == [False, True, True]  # steps 2 and 3
        assert all(m["data_wait_ms"] >= 0 for m in metrics)
        assert metrics[-1]["val_loss"] == pytest.approx(want, rel=1e-5)
    assert 2.0 < want < 5.0


def test_the_cli_trains_from_a_token_file_and_reports_the_wait(corpus, tmp_path):
    from clawcomm.train import cli

    out = tmp_path / "m.jsonl"
    rc = cli.main(["--data", str(corpus / "train.bin"), "--data-val", str(corpus / "val.bin"),
                   "--dp", "2", "--steps", "3", "--dim", "32", "--layers", "1", "--seq-len", "16",
                   "--quiet", "--metrics", str(out)])  # fmt: skip
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 3 and "data_wait_ms" in lines[0] and "val_loss" in lines[-1]
    assert os.path.getsize(corpus / "train.bin") > 0
