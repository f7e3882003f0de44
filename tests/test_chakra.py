"""Chakra execution traces: reading traces other tools wrote, writing ours,
replaying them with the cost model, and the trainer's own traces.

tests/data/chakra_reference/ was written by Chakra's own encoding: the
messages compiled by protoc from Chakra's et_def.proto (node types,
field numbers and attribute kinds as there; comm_size as uint64, as
Chakra's converters write it) and protolib's varint-prefixed framing.
Two ranks: rank 0 runs fwd (100 us), sends 64 KiB to rank 1 and runs bwd
(200 us); rank 1 receives, runs fwd (150 us) and bwd (300 us); both then
all-reduce 1 MiB in group "0".
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("google.protobuf")

from clawcomm import chakra  # noqa: E402
from clawcomm.cost_model import CostModel, Topology, predict  # noqa: E402
from clawcomm.launch import run_ranks  # noqa: E402
from clawcomm.simulate.replay import replay  # noqa: E402

HERE = os.path.dirname(__file__)
REFERENCE = os.path.join(HERE, "data", "chakra_reference")
MODEL = CostModel(shm_alpha=5e-6, shm_beta=1 / 4e9, net_alpha=40e-6, net_beta=1 / 1e9, gamma=1e-10)


def test_a_trace_written_by_chakras_own_encoding_reads_back():
    t = chakra.read(REFERENCE)
    assert sorted(t.ranks) == [0, 1] and t.groups == {"0": [0, 1]}
    assert t.metadata[0]["schema"] == "1.0.2-chakra.1.0.0"
    r0 = {n.name: n for n in t.ranks[0]}
    assert r0["fwd"].type == chakra.COMP_NODE and r0["fwd"].duration_us == 100
    assert r0["bwd"].ctrl_deps == [1] and r0["send_act"].data_deps == [1]
    assert r0["send_act"].attrs == {"comm_src": 0, "comm_dst": 1, "comm_size": 65536, "comm_tag": 3}
    ar = r0["all_reduce_grads"]
    assert ar.type == chakra.COMM_COLL_NODE and ar.collective == "all_reduce"
    assert ar.comm_size == 1 << 20 and ar.attrs["pg_name"] == "0"
    assert ar.attrs["involved_dim"] == [True] and ar.attrs["is_cpu_op"] is False


def test_written_traces_read_back_the_same(tmp_path):
    nodes = {
        0: [
            chakra.Node(0, "F0", chakra.COMP_NODE, duration_us=12, start_us=3, attrs={"a": 1.5}),
            chakra.Node(1, "ar", chakra.COMM_COLL_NODE, data_deps=[0], ctrl_deps=[0], attrs={
                "comm_type": 7, "comm_size": 1 << 40, "pg_name": "dp0", "dims": [True, False]}),
        ],
        3: [chakra.Node(7, "x", chakra.COMM_RECV_NODE, attrs={"comm_src": 0, "flag": True})],
    }  # fmt: skip
    trace = chakra.Trace(nodes, {"dp0": [0, 3]}, {0: {"host": 0}, 3: {"host": 2, "l": "r3"}})
    paths = chakra.write(str(tmp_path), trace, prefix="run")
    assert sorted(os.path.basename(p) for p in paths) == ["comm_group.json", "run.0.et", "run.3.et"]
    back = chakra.read(str(tmp_path))
    assert back.ranks == trace.ranks and back.groups == trace.groups
    assert back.metadata == trace.metadata


def test_attributes_are_written_in_the_types_astra_sims_feeder_reads(tmp_path):
    """Its feeder reads comm_src, comm_dst and comm_tag with int32_val() and
    comm_type and comm_size with int64_val(): another type reads as 0."""
    attrs = {"comm_src": 3, "comm_dst": 1, "comm_tag": 7, "comm_size": 1 << 33, "comm_type": 2,
             "is_cpu_op": True, "pg_name": "dp0"}  # fmt: skip
    trace = chakra.Trace({0: [chakra.Node(0, "s", chakra.COMM_SEND_NODE, attrs=attrs)]}, {})
    chakra.write(str(tmp_path), trace)
    M = chakra._schema()
    blobs = list(chakra._read_messages((tmp_path / "clawcomm.0.et").read_bytes()))
    node = M["Node"]()
    node.ParseFromString(blobs[1])
    kinds = {a.name: a.WhichOneof("value") for a in node.attr}
    assert kinds == {"comm_src": "int32_val", "comm_dst": "int32_val", "comm_tag": "int32_val",
                     "comm_size": "int64_val", "comm_type": "int64_val",
                     "is_cpu_op": "bool_val", "pg_name": "string_val"}  # fmt: skip
    with pytest.raises(ValueError, match="int32"):
        bad = chakra.Node(0, "s", chakra.COMM_SEND_NODE, attrs={"comm_tag": 1 << 40})
        chakra.write(str(tmp_path), chakra.Trace({0: [bad]}, {}))


def test_the_reference_replays_to_the_step_worked_by_hand():
    """One rank per host: the message crosses the link, the all-reduce is
    the model's for 2 hosts x 1; rank 1 is the critical path."""
    result = replay(chakra.read(REFERENCE), MODEL, host_of=lambda r: r)
    message = MODEL.net_alpha + 65536 * MODEL.net_beta
    allreduce = predict("all_reduce", "auto", 1 << 20, Topology(2, 1), MODEL)
    want = 100e-6 + message + 150e-6 + 300e-6 + allreduce
    assert result.step == pytest.approx(want, rel=1e-9)
    path = [(s.rank, s.node.name) for s in result.critical]
    assert path[:5] == [(0, "fwd"), (0, "send_act"), (1, "recv_act"), (1, "fwd"), (1, "bwd")]
    assert len(path) == 6 and path[5][1] == "all_reduce_grads", path
    share = result.share()
    assert share["compute"] == pytest.approx(550e-6) and share["message"] == pytest.approx(message)
    assert share["collective"] == pytest.approx(allreduce)
    # One host: shared memory, a cheaper message and all-reduce.
    local = replay(chakra.read(REFERENCE), MODEL, host_of=lambda r: 0)
    assert local.step < result.step


def _node(i, name, kind, **kw):
    return chakra.Node(i, name, kind, **kw)


def test_a_rank_runs_one_compute_at_a_time_and_a_group_one_collective_at_a_time():
    coll = dict(attrs={"comm_type": 0, "comm_size": 1 << 20, "pg_name": "g"})
    ranks = {
        0: [_node(0, "a", 4, duration_us=100), _node(1, "b", 4, duration_us=100),
            _node(2, "c1", 7, data_deps=[0], **coll), _node(3, "c2", 7, data_deps=[0], **coll)],
        1: [_node(0, "a", 4, duration_us=10),
            _node(2, "c1", 7, data_deps=[0], **coll), _node(3, "c2", 7, data_deps=[0], **coll)],
    }  # fmt: skip
    result = replay(chakra.Trace(ranks, {"g": [0, 1]}), MODEL, host_of=lambda r: r)
    ar = predict("all_reduce", "auto", 1 << 20, Topology(2, 1), MODEL)
    spans = {(s.rank, s.node.name): s for s in result.spans.values()}
    assert spans[(0, "b")].start == pytest.approx(100e-6)  # after a: one compute at a time
    assert spans[(0, "c1")].start == pytest.approx(100e-6)  # once rank 0 reaches it
    assert spans[(1, "c1")].start == pytest.approx(100e-6)  # the group waits for its last
    assert spans[(0, "c2")].start == pytest.approx(100e-6 + ar)  # after c1 in the group
    assert result.step == pytest.approx(max(200e-6, 100e-6 + 2 * ar))


@pytest.mark.parametrize(
    "ranks,groups,message",
    [
        ({0: [_node(0, "r", 6, attrs={"comm_src": 1, "comm_tag": 9})], 1: []}, {}, "never ran"),
        ({0: [_node(0, "x", 4, data_deps=[5])]}, {}, "depends on node 5"),
        ({0: [_node(0, "c", 7, attrs={"comm_type": 0, "pg_name": "g"})], 1: []}, {"g": [1]},
         "do not include it"),
        ({0: [_node(0, "c", 7, attrs={"comm_type": 0, "pg_name": "g"})], 1: []}, {"g": [0, 1]},
         "never ran"),
        ({0: [_node(0, "c", 7, attrs={"comm_type": 42})]}, {}, "not one of Chakra's"),
    ],
)  # fmt: skip
def test_a_trace_that_cannot_run_is_an_error_that_names_the_node(ranks, groups, message):
    with pytest.raises(ValueError, match=message):
        replay(chakra.Trace(ranks, groups), MODEL, host_of=lambda r: r)


def test_a_folder_without_traces_or_with_two_prefixes_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Chakra trace"):
        chakra.read(str(tmp_path))
    for prefix in ("a", "b"):
        (tmp_path / f"{prefix}.0.et").write_bytes(b"")
    with pytest.raises(ValueError, match="two files for rank 0"):
        chakra.read(str(tmp_path))


def test_a_truncated_file_is_an_error(tmp_path):
    data = open(os.path.join(REFERENCE, "reference.0.et"), "rb").read()
    (tmp_path / "t.0.et").write_bytes(data[:-5])
    with pytest.raises(ValueError, match="past the file's end"):
        chakra.read(str(tmp_path))


def test_clawcomm_simulate_replays_a_folder_and_refuses_a_missing_one(tmp_path, capsys):
    from clawcomm.cli import main

    out = str(tmp_path / "o.json")
    argv = ["simulate", "--chakra", REFERENCE, "--ranks-per-host", "1", "--project-hosts", "64",
            "--json", out]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "predicted step: " in printed and "critical path" in printed
    assert "over 64 hosts" in printed
    assert os.path.exists(out)
    argv[2] = str(tmp_path / "missing")
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


# ---- the trainer's own traces ----------------------------------------------------


def _train(rank, n, layout, folder):
    from clawcomm.train.cli import train_rank
    from clawcomm.train.config import TrainConfig

    base = dict(model="mlp", hidden=32, steps=2, micro_batch_size=2, quiet=True, chakra=folder)
    cfg = TrainConfig(**{**base, **layout})
    return train_rank(cfg, announce=False)[-1]["step_ms"] / 1e3


# Two layouts in the default run; CLAWCOMM_LONG_TESTS=1 adds two (about 10 s).
LONG_ONLY = pytest.mark.skipif(
    os.environ.get("CLAWCOMM_LONG_TESTS") != "1", reason="CLAWCOMM_LONG_TESTS=1 runs it"
)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(dict(dp=2, pp=2, schedule="1f1b", microbatches=4), id="dp2-pp2-1f1b"),
        pytest.param(dict(dp=2, pp=1, compression="topk:0.1"), id="dp2-topk"),
        pytest.param(
            dict(dp=1, pp=2, schedule="zb1", microbatches=4, accumulation=2),
            id="pp2-zb1-accumulation",
            marks=LONG_ONLY,
        ),
        pytest.param(dict(dp=2, pp=1, zero=1), id="dp2-zero1", marks=LONG_ONLY),
        pytest.param(dict(dp=1, tp=2, pp=2, schedule="1f1b", microbatches=4), id="tp2-pp2"),
        pytest.param(
            dict(dp=2, ep=2, pp=1, model="moe", dim=32, layers=2, heads=2, seq_len=16, experts=4),
            id="moe-ep2",
        ),  # fmt: skip
        pytest.param(
            dict(
                dp=2,
                ep=2,
                tp=2,
                pp=1,
                model="moe",
                dim=32,
                layers=2,
                heads=2,
                seq_len=16,
                experts=4,
            ),
            id="moe-ep2-tp2",
        ),  # fmt: skip
    ],
)
def test_the_trainers_trace_replays_every_node(tmp_path, layout):
    """Every action of every rank is a node, every send meets its receive,
    every collective meets its group: the replay runs each node once."""

    world = layout["dp"] * layout.get("tp", 1) * layout["pp"]
    steps = run_ranks(_train, world, layout, str(tmp_path), timeout=240)
    trace = chakra.read(str(tmp_path))
    assert sorted(trace.ranks) == list(range(world))
    assert all(trace.metadata[r]["host"] == 0 for r in trace.ranks)
    rounds = layout.get("accumulation", 1)
    tp_nodes = 0
    for r, nodes in trace.ranks.items():
        kinds = [n.type for n in nodes]
        sends, recvs = kinds.count(chakra.COMM_SEND_NODE), kinds.count(chakra.COMM_RECV_NODE)
        if layout["pp"] > 1:
            assert sends == recvs == rounds * layout["microbatches"], (r, sends, recvs)
        colls = [n for n in nodes if n.type == chakra.COMM_COLL_NODE]
        if layout["dp"] > 1:
            assert colls and all(n.comm_size > 0 for n in colls), r
        if "compression" in layout:
            assert {n.collective for n in colls} == {"all_gather"}, r
        if layout.get("tp", 1) > 1:  # the mlp's column/row pairs' all-reduces, in the chain
            tp = [n for n in colls if n.attrs["pg_name"].startswith("tp")]
            assert all(trace.groups[n.attrs["pg_name"]] == [r - r % 2, r - r % 2 + 1]
                       for n in tp), r  # fmt: skip
            assert all(len(n.data_deps) == 1 for n in tp), r
            tp_nodes += len(tp)
        if layout.get("ep", 1) > 1:  # a layer and micro-batch: counts, tokens, back; backward 2
            ep = [n for n in colls if n.attrs["pg_name"].startswith("ep")]
            assert {n.collective for n in ep} == {"all_to_all"}, r
            tp = layout.get("tp", 1)  # (rank t of each TP group with its peers')
            want = [r % tp, r % tp + tp]
            assert all(trace.groups[n.attrs["pg_name"]] == want for n in ep), r
            assert len(ep) == (3 + 2) * layout["layers"] * 4, (r, len(ep))
    if layout.get("tp", 1) > 1:  # (the first stage's column layer sends nothing: its input is data)
        assert tp_nodes > 0
        assert sum(n.duration_us for n in nodes) > 0
    result = replay(trace, CostModel())
    assert len(result.spans) == sum(map(len, trace.ranks.values()))
    assert result.step > 0 and result.critical
    # The recorded compute is in the trace: the replayed step cannot be
    # shorter than the busiest rank's compute, nor far off the measured one.
    busiest = max(sum(n.duration_us for n in ns if n.type == chakra.COMP_NODE)
                  for ns in trace.ranks.values()) / 1e6  # fmt: skip
    assert result.step >= busiest * (1 - 1e-9)
    assert result.step <= 2 * max(steps) + 0.05, (result.step, steps)
