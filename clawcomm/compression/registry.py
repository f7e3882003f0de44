"""Compressor specs: strings such as "fp16", "topk:0.01", "powersgd:4",
"dgc:0.001:warmup=200" and combinations such as "topk:0.01+fp16".

Grammar: ``BASE[+VALUES][+ec[:always]]`` where BASE is one of

* ``none``, ``fp16``, ``bf16`` (compressors.py);
* ``int8[:BLOCK]``, ``int4[:BLOCK]``, ``qsgd:BITS[:BLOCK]``,
  ``terngrad[:BLOCK]``, ``sign[:BLOCK]`` (block-quantised, quantized.py);
* ``powersgd:RANK`` (powersgd.py);
* ``topk:K[:exact|:sampled]``, ``randomk:K`` (compressors.py),
  ``threshold:V``, ``dgc:RATIO[:momentum=M][:warmup=STEPS][:clip=C]``
  (sparsified.py);

K is a ratio in (0, 1] (written with a decimal point, "0.01") or a count
(an integer, "1000"), and VALUES (``fp16`` or ``bf16``) sets the type the
values travel in: the sparse values of topk, randomk, threshold and dgc, or
PowerSGD's factors. The quantisers have no float values to send that way,
and say so. ``+ec`` codes what the sparse methods (topk, threshold, dgc)
and the quantisers send losslessly, where it pays on the group's links;
``+ec:always`` codes every message (entropy.py, coding.py).

Researchers add their own with ``register_compressor(name, factory)``: the
factory receives the spec's arguments (the parts after ``name:``) as strings
and returns a ``Compressor``.
"""

from __future__ import annotations

from collections.abc import Callable

from clawcomm.compression.base import Compressor

_FACTORIES: dict[str, Callable[..., Compressor]] = {}


def register_compressor(name: str, factory: Callable[..., Compressor]) -> None:
    """Makes ``name[:arg...]`` a valid spec. Raises ValueError if taken."""
    if not name.isidentifier():
        raise ValueError(f"compressor name {name!r} is not an identifier")
    if name in _FACTORIES:
        raise ValueError(f"a compressor named {name!r} is already registered")
    _FACTORIES[name] = factory


def available() -> list[str]:
    return sorted(_FACTORIES)


def parse_k(text: str, spec: str) -> float | int:
    """'0.01' -> ratio 0.01; '1000' -> count 1000."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise ValueError(
            f"compressor spec {spec!r}: k {text!r} is not a ratio or a count"
        ) from None
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"compressor spec {spec!r}: ratio {value} is not in (0, 1]")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"compressor spec {spec!r}: count {value} is not at least 1")
    return value


def get_compressor(spec: str | Compressor) -> Compressor:
    """The compressor a spec names (a Compressor is returned unchanged)."""
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compressor spec {spec!r} is empty; try one of {', '.join(available())}")
    base, *extra = [p.strip() for p in spec.split("+")]
    name, *args = base.split(":")
    if name not in _FACTORIES:
        raise ValueError(
            f"compressor spec {spec!r}: unknown compressor {name!r} "
            f"(known: {', '.join(available())})"
        )
    values, coded = None, ""
    for item in extra:
        if item in ("fp16", "bf16") and values is None and not coded:
            values = item
        elif item in ("ec", "ec:auto", "ec:always") and not coded:
            coded = item.partition(":")[2] or "auto"
        else:
            raise ValueError(
                f"compressor spec {spec!r}: after a compressor may come '+fp16' or '+bf16', "
                "then '+ec' (coded where it pays) or '+ec:always'"
            )
    compressor = _FACTORIES[name](*args, spec=spec)
    if values is not None:
        compressor = compressor.with_values(values, spec)
    if coded:
        compressor = compressor.with_coding(spec, coded)
    return compressor
