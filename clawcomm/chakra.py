"""Chakra execution traces: the format ASTRA-sim and the MLCommons tools read.

A trace is one file per rank, ``<prefix>.<rank>.et``: a ``GlobalMetadata``
message, then one ``Node`` message per operation, each preceded by its
length as a varint (Chakra's ``protolib.encodeMessage``). A node is a
compute (``COMP_NODE``, with ``duration_micros``), a collective
(``COMM_COLL_NODE``: attributes ``comm_type``, ``comm_size`` in bytes and
``pg_name``, its process group) or a send or receive (``COMM_SEND_NODE``,
``COMM_RECV_NODE``: ``comm_src``, ``comm_dst``, ``comm_size``,
``comm_tag``), with the nodes it waits for in ``data_deps`` and
``ctrl_deps``. ``comm_group.json`` beside the files maps each ``pg_name``
to its ranks, as ASTRA-sim's ``--comm-group-configuration`` takes it.
Integer attributes are written in the types ASTRA-sim's trace feeder reads
(``comm_src``, ``comm_dst`` and ``comm_tag`` as int32, the others as
int64); any numeric type reads back.

The messages are those of Chakra's ``schema/protobuf/et_def.proto`` (same
package, names and field numbers), built here from a descriptor so that
no generated code and no Chakra install is needed; protobuf itself is the
optional dependency (``pip install protobuf``, or ``clawcomm[chakra]``).
Only the fields clawcomm reads or writes are declared: others (tensor
and storage details, list attributes other than booleans) are skipped
when a trace is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from clawcomm._optional import require

SCHEMA_VERSION = "0.0.4"
COMM_GROUP_FILE = "comm_group.json"

# NodeType and CollectiveCommType, as numbered in et_def.proto.
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7
NODE_TYPES = {
    0: "INVALID_NODE",
    1: "METADATA_NODE",
    2: "MEM_LOAD_NODE",
    3: "MEM_STORE_NODE",
    COMP_NODE: "COMP_NODE",
    COMM_SEND_NODE: "COMM_SEND_NODE",
    COMM_RECV_NODE: "COMM_RECV_NODE",
    COMM_COLL_NODE: "COMM_COLL_NODE",
    8: "STORAGE_NODE",
    9: "BATCH_NODE",
    10: "CHECKPOINT_NODE",
}
COLLECTIVES = {
    "all_reduce": 0,
    "reduce": 1,
    "all_gather": 2,
    "gather": 3,
    "scatter": 4,
    "broadcast": 5,
    "all_to_all": 6,
    "reduce_scatter": 7,
    "reduce_scatter_block": 8,
    "barrier": 9,
}
COLLECTIVE_NAMES = {v: k for k, v in COLLECTIVES.items()}

# AttributeProto's scalar members of its `value` oneof: (name, number, type).
_ATTR_SCALARS = [
    ("double_val", 3, "DOUBLE"),
    ("float_val", 5, "FLOAT"),
    ("int32_val", 7, "INT32"),
    ("int64_val", 9, "INT64"),
    ("uint32_val", 11, "UINT32"),
    ("uint64_val", 13, "UINT64"),
    ("sint32_val", 15, "SINT32"),
    ("sint64_val", 17, "SINT64"),
    ("fixed32_val", 19, "FIXED32"),
    ("fixed64_val", 21, "FIXED64"),
    ("sfixed32_val", 23, "SFIXED32"),
    ("sfixed64_val", 25, "SFIXED64"),
    ("bool_val", 27, "BOOL"),
    ("string_val", 29, "STRING"),
    ("bytes_val", 31, "BYTES"),
]
_messages = None


def _schema():
    """The message classes (GlobalMetadata, Node, AttributeProto, BoolList),
    built once in a descriptor pool of their own."""
    global _messages
    if _messages is not None:
        return _messages
    require("google.protobuf", "Chakra traces (train --chakra, simulate --chakra)")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="clawcomm_chakra_et_def.proto", package="ChakraProtoMsg", syntax="proto3"
    )

    def message(name, fields, oneof=None):
        m = fdp.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name=oneof)
        for fname, number, ftype, *rest in fields:
            f = m.field.add(name=fname, number=number, label=F.LABEL_OPTIONAL)
            f.type = getattr(F, "TYPE_" + ftype)
            if rest and rest[0] == "repeated":
                f.label = F.LABEL_REPEATED
            elif rest and rest[0].startswith("."):
                f.type_name = rest[0]
            if oneof and fname not in ("name", "doc_string"):
                f.oneof_index = 0
        return m

    message("BoolList", [("values", 1, "BOOL", "repeated")])
    message(
        "AttributeProto",
        [("name", 1, "STRING"), ("doc_string", 2, "STRING")]
        + _ATTR_SCALARS
        + [("bool_list", 28, "MESSAGE", ".ChakraProtoMsg.BoolList")],
        oneof="value",
    )
    message(
        "GlobalMetadata",
        [("version", 1, "STRING"), ("attr", 2, "MESSAGE", ".ChakraProtoMsg.AttributeProto")],
    )
    fdp.message_type[-1].field[1].label = F.LABEL_REPEATED
    message("IOInfo", [("values", 1, "STRING"), ("shapes", 2, "STRING"), ("types", 3, "STRING")])
    node = message(
        "Node",
        [
            ("id", 1, "UINT64"),
            ("name", 2, "STRING"),
            ("type", 3, "INT32"),
            ("ctrl_deps", 4, "UINT64", "repeated"),
            ("data_deps", 5, "UINT64", "repeated"),
            ("start_time_micros", 6, "UINT64"),
            ("duration_micros", 7, "UINT64"),
            ("inputs", 8, "MESSAGE", ".ChakraProtoMsg.IOInfo"),
            ("outputs", 9, "MESSAGE", ".ChakraProtoMsg.IOInfo"),
            ("attr", 10, "MESSAGE", ".ChakraProtoMsg.AttributeProto"),
        ],
    )
    node.field[-1].label = F.LABEL_REPEATED
    # Node.type is the enum NodeType in et_def.proto: an enum and an int32
    # have the same encoding on the wire (a varint).
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    get = lambda n: message_factory.GetMessageClass(pool.FindMessageTypeByName(n))  # noqa: E731
    names = ("GlobalMetadata", "Node", "AttributeProto", "BoolList")
    _messages = {n: get("ChakraProtoMsg." + n) for n in names}
    return _messages


# ---- nodes as plain Python ---------------------------------------------------


@dataclass
class Node:
    """One node of a rank's trace. ``attrs`` holds every attribute by name
    (numbers, strings, booleans, lists of booleans)."""

    id: int
    name: str
    type: int
    duration_us: int = 0
    data_deps: list[int] = field(default_factory=list)
    ctrl_deps: list[int] = field(default_factory=list)
    start_us: int = 0
    attrs: dict = field(default_factory=dict)

    @property
    def deps(self) -> list[int]:
        return self.data_deps + self.ctrl_deps

    @property
    def comm_size(self) -> int:
        return int(self.attrs.get("comm_size", 0))

    @property
    def collective(self) -> str:
        return COLLECTIVE_NAMES.get(int(self.attrs.get("comm_type", -1)), "unknown")


@dataclass
class Trace:
    """Every rank's nodes, the process groups (pg_name -> ranks) and each
    rank's global metadata attributes (clawcomm writes ``host``)."""

    ranks: dict[int, list[Node]]
    groups: dict[str, list[int]]
    metadata: dict[int, dict] = field(default_factory=dict)


def _attr_value(a):
    which = a.WhichOneof("value")
    if which is None:
        return None
    v = getattr(a, which)
    return list(v.values) if which == "bool_list" else v


def _attrs(attrs) -> dict:
    """Attributes by name; kinds this module does not declare are left out."""
    out = {a.name: _attr_value(a) for a in attrs}
    return {k: v for k, v in out.items() if v is not None}


# The attributes ASTRA-sim's trace feeder reads as int32 (attr.int32_val());
# every other integer is written as int64, which it reads for comm_type,
# comm_size and num_ops, as Chakra's own converters write them.
_INT32_ATTRS = {"comm_src", "comm_dst", "comm_tag", "comm_priority", "tensor_loc"}


def _make_attr(M, name: str, value):
    a = M["AttributeProto"](name=name)
    if isinstance(value, bool):
        a.bool_val = value
    elif isinstance(value, int) and name in _INT32_ATTRS:
        if not -(1 << 31) <= value < 1 << 31:
            raise ValueError(f"Chakra attribute {name}={value} does not fit an int32")
        a.int32_val = value
    elif isinstance(value, int):
        a.int64_val = value
    elif isinstance(value, float):
        a.double_val = value
    elif isinstance(value, str):
        a.string_val = value
    elif isinstance(value, list | tuple) and all(isinstance(x, bool) for x in value):
        a.bool_list.values.extend(value)
    else:
        raise TypeError(f"Chakra attribute {name!r}: cannot store {value!r}")
    return a


# ---- files ---------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_messages(data: bytes):
    pos = 0
    while pos < len(data):
        size = shift = 0
        while True:
            if pos >= len(data):
                raise ValueError("Chakra trace: the file ends inside a message's length")
            b = data[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if pos + size > len(data):
            raise ValueError(f"Chakra trace: a {size}-byte message runs past the file's end")
        yield data[pos : pos + size]
        pos += size


def write(directory: str, trace: Trace, prefix: str = "clawcomm") -> list[str]:
    """Writes ``<directory>/<prefix>.<rank>.et`` for every rank and
    ``comm_group.json``; returns the paths written."""
    M = _schema()
    os.makedirs(directory, exist_ok=True)
    paths = []
    for rank, nodes in sorted(trace.ranks.items()):
        meta = M["GlobalMetadata"](version=SCHEMA_VERSION)
        for k, v in trace.metadata.get(rank, {}).items():
            meta.attr.append(_make_attr(M, k, v))
        out = [meta.SerializeToString()]
        for n in nodes:
            msg = M["Node"](
                id=n.id,
                name=n.name,
                type=n.type,
                duration_micros=max(0, int(n.duration_us)),
                start_time_micros=max(0, int(n.start_us)),
            )
            msg.data_deps.extend(n.data_deps)
            msg.ctrl_deps.extend(n.ctrl_deps)
            for k, v in n.attrs.items():
                msg.attr.append(_make_attr(M, k, v))
            out.append(msg.SerializeToString())
        path = os.path.join(directory, f"{prefix}.{rank}.et")
        with open(path, "wb") as f:
            for blob in out:
                f.write(_varint(len(blob)) + blob)
        paths.append(path)
    path = os.path.join(directory, COMM_GROUP_FILE)
    with open(path, "w") as f:
        json.dump({k: sorted(v) for k, v in sorted(trace.groups.items())}, f, indent=1)
    return paths + [path]


def read(directory: str) -> Trace:
    """Reads every ``*.<rank>.et`` in ``directory`` (one prefix) and its
    ``comm_group.json`` if there is one."""
    M = _schema()
    files: dict[int, str] = {}
    for name in sorted(os.listdir(directory)):
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[2] == "et" and parts[1].isdigit():
            rank = int(parts[1])
            if rank in files:
                raise ValueError(
                    f"Chakra trace in {directory}: two files for rank {rank} "
                    f"({os.path.basename(files[rank])}, {name}); keep one prefix per folder"
                )
            files[rank] = os.path.join(directory, name)
    if not files:
        raise FileNotFoundError(f"no Chakra trace files (<prefix>.<rank>.et) in {directory}")
    trace = Trace(ranks={}, groups={})
    for rank, path in sorted(files.items()):
        with open(path, "rb") as f:
            blobs = list(_read_messages(f.read()))
        if not blobs:
            raise ValueError(f"Chakra trace {path}: empty (no GlobalMetadata)")
        meta = M["GlobalMetadata"]()
        meta.ParseFromString(blobs[0])
        trace.metadata[rank] = _attrs(meta.attr)
        nodes = []
        for blob in blobs[1:]:
            m = M["Node"]()
            m.ParseFromString(blob)
            nodes.append(
                Node(
                    id=m.id,
                    name=m.name,
                    type=m.type,
                    duration_us=m.duration_micros,
                    data_deps=list(m.data_deps),
                    ctrl_deps=list(m.ctrl_deps),
                    start_us=m.start_time_micros,
                    attrs=_attrs(m.attr),
                )
            )
        trace.ranks[rank] = nodes
    groups = os.path.join(directory, COMM_GROUP_FILE)
    if os.path.exists(groups):
        with open(groups) as f:
            trace.groups = {str(k): [int(r) for r in v] for k, v in json.load(f).items()}
    return trace
