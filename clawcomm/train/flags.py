"""``TrainConfig`` read from the command line and a TOML file: one flag per
field (``--micro-batch-size`` for ``micro_batch_size``, booleans as
``--x/--no-x``), ``--config FILE.toml`` with the same names (``-`` or
``_``). Defaults, then the file, then the flags given: flags win."""

from __future__ import annotations

import argparse
from dataclasses import fields

from clawcomm.train.config import TrainConfig


def _kind(f) -> type:
    """A field's type: its default's, or (a default of None, resolved by a
    property) the one it names."""
    return f.metadata.get("kind") or type(f.default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field; defaults are None so that a --config file's
    values survive unless a flag is given."""
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([f.metadata["flag"]] if f.metadata.get("flag") else [])
        # argparse %-formats help strings: a literal % must be doubled.
        default = f.metadata.get("default_text", repr(f.default))
        help_text = f"{f.metadata['help']} ({default})".replace("%", "%%")
        if _kind(f) is bool:
            p.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            p.add_argument(
                *names,
                type=type(f.default),
                default=None,
                choices=f.metadata.get("choices"),
                help=help_text,
            )


def from_args(args: argparse.Namespace, toml_path: str | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given."""
    values: dict = {}
    if toml_path:
        values.update(load_toml(toml_path))
    for f in fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    if values.get("global_batch") and values.get("accumulation", 1) != 1:
        raise ValueError(
            f"global_batch {values['global_batch']} and accumulation {values['accumulation']}: "
            "give one of them (the global batch decides the accumulation)"
        )
    return TrainConfig(**values)


def load_toml(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the settings: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(
                f"{path}: unknown setting {key!r}; settings are {', '.join(sorted(known))}"
            )
        want = _kind(known[name])
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            kinds = {int: "an integer", float: "a number", bool: "true or false"}
            kind = kinds.get(want, "a string")
            raise ValueError(f"{path}: {key} = {value!r} is not {kind}")
        out[name] = value
    return out
