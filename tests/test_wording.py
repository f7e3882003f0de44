"""Printed text that is a contract: what a user reads at the start of a run,
under a bench table, in a flight report and in `clawcomm simulate`'s lines."""

from __future__ import annotations

from clawcomm import flight
from clawcomm.bench.report import format_tables
from clawcomm.bench.torch_worker import reference_algo
from clawcomm.simulate import cli as simulate
from clawcomm.train.config import TrainConfig
from clawcomm.train.grid import describe


def test_the_start_of_a_run_says_stages_layers_and_compression():
    one = describe(TrainConfig(model="mlp", layers=4), [0, 4], 1e-3, False)
    assert "1 stage (layers 0-3)" in one and "stages" not in one
    two = describe(TrainConfig(model="mlp", layers=3, pp=2), [0, 1, 3], 1e-3, False)
    assert "2 stages (0: layer 0, 1: layers 1-2)" in two
    on = describe(TrainConfig(model="mlp", dp=2, compression="topk:0.01"), [0, 4], 1e-3, False)
    assert "compression topk:0.01 on the gradients between replicas" in on
    off = describe(TrainConfig(model="mlp", compression="fp16"), [0, 4], 1e-3, False)
    assert "compression fp16 is off: at dp 1 no replicas exchange" in off
    assert one.startswith("global batch 32 = micro-batch 8 x 4 micro-batches")


def _record(variant, size=1024, t=10.0):
    return {"collective": "all_reduce", "redop": "sum", "variant": variant, "size": size,
            "count": size // 4, "dtype": "float32", "root": -1, "time_us": t, "algbw": 1.0,
            "busbw": 1.0, "wrong": 0}  # fmt: skip


def test_a_bench_table_explains_its_ratio_column_only_when_it_has_one():
    alone = format_tables([_record("clawcomm")], lambda _c: "clawcomm", 2)
    assert "ratio" not in alone
    both = format_tables([_record("clawcomm"), _record("gloo", t=20.0)], lambda _c: "clawcomm", 2)
    assert "# ratio = that variant's time / the first variant's time" in both
    assert "# all_reduce (sum), 2 ranks" in both  # a title names the reduction


def test_algorithms_are_compared_in_the_order_given():
    assert reference_algo(["ring", "tree", "auto"]) == "ring"


def test_a_barrier_in_a_flight_report_has_no_element_count():
    barrier = {"op": "barrier", "seq": 8, "count": 0, "dtype": "uint8"}
    assert flight._describe(barrier) == "barrier #8"
    reduce = {"op": "all_reduce", "seq": 2, "count": 4, "dtype": "float32"}
    assert flight._describe(reduce) == "all_reduce #2 of 4 float32 elements"


def test_sizes_are_binary_and_counts_decimal():
    assert simulate._size(1 << 30) == "1 GiB" and simulate._size(64 << 10) == "64 KiB"
    assert simulate.parse_count("1.3G") == 1_300_000_000 and simulate._count(1.3e9) == "1.3G"
