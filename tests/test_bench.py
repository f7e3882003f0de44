"""`clawcomm bench`: every collective runs and checks itself, the tables,
JSON and plot come out, bad flags are refused, and the #wrong column really
counts wrong results. (Timings are never asserted on.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from clawcomm.bench import cli, collectives
from clawcomm.bench.runners import Prepared
from clawcomm.bench.sweep import Config, Sync, measure_point

ALL = ",".join(collectives.COLLECTIVES)
FAST = ["-n", "2", "-w", "1", "--repeats", "1", "--quiet"]


def _bench(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-m", "clawcomm.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_every_collective_against_gloo_and_the_raw_engine(tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    p = _bench(
        "--nproc", "3", "-o", ALL, "-b", "8", "-e", "100K", "-f", "7", "-r", "1",
        "--compare", "gloo,raw", "--json", str(out_json), "--plot", str(out_png), *FAST,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out_json.read_text())
    records = data["records"]
    assert data["world_size"] == 3 and data["memcpy_GBps"] > 0
    for name in collectives.COLLECTIVES:
        for variant in ("clawcomm", "gloo", "raw"):
            rows = [r for r in records if r["collective"] == name and r["variant"] == variant]
            assert len(rows) == 5, (name, variant)  # 8 B x 7^k up to 100K
            for r in rows:
                if (name, variant) == ("all_to_allv", "raw"):  # (even splits only)
                    assert "even" in r["error"], r
                    continue
                assert "error" not in r, r
                assert r["wrong"] == 0 and r["oob"] == 0, r
                assert r["time_us"] > 0 and r["busbw"] >= 0
    roots = {r["root"] for r in records if r["collective"] in ("broadcast", "reduce")}
    assert roots == {1}
    # Sizes are rounded down to what splits evenly over 3 ranks.
    gathered = {r["size"] for r in records if r["collective"] == "all_gather"}
    assert gathered == {0, 48, 384, 2736, 19200}
    assert out_png.stat().st_size > 10_000
    table = p.stdout
    assert (
        "#       size      count      type  redop  root     time   algbw   busbw  #wrong" in table
    )
    assert table.count("# Out of bounds values : 0 OK") == len(collectives.COLLECTIVES)
    assert "# Avg bus bandwidth    :" in table and "memcpy ceiling" in table
    # Every ordered pair's single-copy size, as the engine reports it.
    pairs = {(s, r): b for s, r, b in data["single_copy"]}
    assert set(pairs) == {(s, r) for s in range(3) for r in range(3) if s != r}
    assert all(b is None or b in (64 << 10, 1 << 20) for b in pairs.values()), pairs
    from clawcomm.bench.report import single_copy_line

    assert single_copy_line(pairs) in table.splitlines()


def test_single_copy_line():
    from clawcomm.bench.report import single_copy_line

    line = single_copy_line({(0, 1): 65536, (1, 0): 1 << 20, (0, 2): None, (2, 0): 65536})
    assert line.endswith("from 64 KiB on 2 pairs, from 1 MiB on 1 pair, never on 1 pair")


def test_reduction_ops_types_and_algorithms():
    p = _bench("--nproc", "2", "-o", "all_reduce,reduce,all", "-d", "half", "-b", "1K",
               "-e", "1K", "--algo", "ring,tree,auto", "--compare", "gloo", *FAST)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "# all_reduce (sum), 2 ranks" in p.stdout and "# reduce (max), 2 ranks" in p.stdout
    for redop in collectives.REDOPS:
        assert f"half {redop:>6}" in p.stdout, redop
    assert "clawcomm/ring" in p.stdout and "clawcomm/tree" in p.stdout
    assert "# n/a  gloo: gloo has no AVG" in p.stdout


def test_tcp_transport_under_the_subcommand(capsys):
    from clawcomm import cli as top

    before = os.environ.get("CLAWCOMM_TRANSPORT")
    rc = top.main(["bench", "--transport", "tcp", "-o", "all_gather", "-b", "4K", "-e", "4K",
                   *FAST])  # fmt: skip
    assert rc == 0
    assert "transport tcp" in capsys.readouterr().out
    assert os.environ.get("CLAWCOMM_TRANSPORT") == before  # only the ranks got it


@pytest.mark.parametrize(
    "args,message",
    [
        (["-o", "all_reduc"], "-o 'all_reduc' is neither a collective"),
        (["-b", "1M", "-e", "1K"], "-e 1024 is smaller than -b 1048576"),
        (["-d", "float8"], "-d 'float8' is not one of"),
        (["-r", "5"], "-r 5 is not a rank of 2"),
        (["-f", "1"], "the step factor must be at least 2"),
    ],
)
def test_bad_flags_are_refused(args, message, capsys):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_bad_choices_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--compare", "nvshmem"])
    assert "backend nvshmem not one of gloo, mpi, raw, nccl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["-b", "lots"])
    assert "'lots' is not a size" in capsys.readouterr().err


def test_device_flags_are_checked_before_any_rank_starts(capsys):
    assert cli.main(["--compare", "nccl"]) == 2
    assert "--compare nccl needs --device cuda" in capsys.readouterr().err
    if not torch.cuda.device_count():
        assert cli.main(["--device", "cuda"]) == 2
        assert "--device cuda: no CUDA GPU" in capsys.readouterr().err


def test_sizes_follow_nccl_tests():
    parse = cli.parse_size
    assert [parse(s) for s in ("8", "64K", "1M", "2G", "1.5K")] == [
        8,
        65536,
        1 << 20,
        2 << 30,
        1536,
    ]
    args = cli.argparse.Namespace(minbytes=8, maxbytes=64, stepfactor=2, stepbytes=0)
    assert cli.sizes_from(args) == [8, 16, 32, 64]
    args.stepbytes = 20
    assert cli.sizes_from(args) == [8, 28, 48]


class _BrokenRunner:
    """An all-reduce that forgets to add one rank's contribution to every
    third element: the check must count exactly those elements."""

    name = "broken"

    def prepare(self, coll, count, dtype, redop, root):
        out = np.zeros(count, np.float32)

        def check():
            x = collectives.pattern(0, count, redop, 2) + collectives.pattern(1, count, redop, 2)
            x[::3] -= collectives.pattern(1, count, redop, 2)[::3]
            out[:] = x
            want = collectives.expected(coll, 0, count, redop, root, 2)
            return collectives.count_wrong(out, want, dtype), 0

        return Prepared(lambda: None, check)


def test_wrong_results_are_counted():
    cfg = Config(["all_reduce"], [4096], "float32", ["sum"], 0, 1, 2, True, repeats=1)
    sync = Sync(barrier=lambda: None, max=lambda v: v, sum=lambda v: v)
    coll = collectives.COLLECTIVES["all_reduce"]
    [record] = measure_point([_BrokenRunner()], coll, 4096, cfg, "sum", 2, sync)
    pattern1 = collectives.pattern(1, 1024, "sum", 2)
    assert record["wrong"] == int(np.count_nonzero(pattern1[::3]))
    assert record["wrong"] > 0


def test_expected_results_by_hand():
    ar, rs = collectives.COLLECTIVES["all_reduce"], collectives.COLLECTIVES["reduce_scatter"]
    a2a, sr = collectives.COLLECTIVES["all_to_all"], collectives.COLLECTIVES["sendrecv"]
    n, count = 3, 6
    ins = [collectives.pattern(r, count, "sum", n) for r in range(n)]
    np.testing.assert_array_equal(collectives.expected(ar, 1, count, "sum", -1, n), sum(ins))
    np.testing.assert_array_equal(collectives.expected(rs, 2, count, "sum", -1, n), sum(ins)[4:])
    np.testing.assert_array_equal(
        collectives.expected(a2a, 1, count, "sum", -1, n),
        np.concatenate([ins[0][2:4], ins[1][2:4], ins[2][2:4]]),
    )
    np.testing.assert_array_equal(collectives.expected(sr, 0, count, "sum", -1, n), ins[2])
    # Uneven: 3 ranks send 6 each, receivers weighted 1 : 1/2 : 1/3 -> 3, 1, 1 (+1 to rank 0).
    a2av = collectives.COLLECTIVES["all_to_allv"]
    np.testing.assert_array_equal(collectives.uneven_splits(6, 3, 1.0), [[4, 1, 1]] * 3)
    assert a2av.counts(count, n, 0) == (6, 12) and a2av.counts(count, n, 2) == (6, 3)
    np.testing.assert_array_equal(
        collectives.expected(a2av, 1, count, "sum", -1, n),
        np.concatenate([ins[0][4:5], ins[1][4:5], ins[2][4:5]]),
    )
    assert collectives.count_wrong(np.array([1.0, 2.0]), np.array([1.0, 2.5]), "int32") == 1
    assert ar.busbw_factor(4) == 1.5 and rs.busbw_factor(4) == 0.75 and sr.busbw_factor(4) == 1


@pytest.mark.skipif(cli._mpi_available() is not None, reason="OpenMPI or mpi4py not installed")
def test_mpi_comparison_runs_in_the_same_run():
    p = _bench("--nproc", "2", "-o", "all_reduce,all_gather,sendrecv,all_to_allv", "-b", "64",
               "-e", "64K",
               "-f", "32", "--compare", "mpi", *FAST)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mpi" in p.stdout and "skipped" not in p.stdout
