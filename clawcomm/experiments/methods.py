"""What a lab method spec names: a compressor alone (gradients averaged every
step through it), a sync mode of ``clawcomm train --sync`` with its options
and a compressor for the pseudo-gradient, or ``compute`` (nothing exchanged):

    int8                                    every step, int8
    diloco:32+int8                          DiLoCo every 32 steps, int8 pseudo-gradients
    diloco:32:fragments=4:delay=2:mix=0.5   Streaming DiLoCo: 4 fragments, each
                                            landing 2 steps late, mixed half and half
    local-sgd:8                             parameter averaging every 8 steps

The options are ``clawcomm train``'s ``--fragments``, ``--sync-delay`` and
``--sync-mix``, per method so that one run can set variants side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

COMPUTE = "compute"  # the pseudo-method that exchanges nothing
_OPTIONS = {"fragments": int, "delay": int, "mix": float}


@dataclass
class Method:
    spec: str
    sync: str = "every-step"  # every-step, local-sgd:H or diloco:H
    compressor: str = "none"
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0

    def outer_settings(self, cfg: dict):
        """The settings ``clawcomm.train.outer.OuterSync`` reads."""
        return SimpleNamespace(
            sync=self.sync, outer_lr=cfg["outer_lr"], outer_momentum=cfg["outer_momentum"],
            fragments=self.fragments, sync_delay=self.delay, sync_mix=self.mix, zero=0,
            compression="" if self.compressor == "none" else self.compressor, steps=cfg["steps"],
        )  # fmt: skip


def parse_method(spec: str, cfg: dict | None = None) -> Method:
    """The method ``spec`` names; raises ValueError naming what is wrong
    (with ``cfg``, also what the sync settings refuse)."""
    from clawcomm.compression import get_compressor
    from clawcomm.train import outer

    if spec == COMPUTE:
        return Method(spec)
    if spec.partition("+")[0].split(":")[0] not in ("diloco", "local-sgd"):
        get_compressor(spec)
        return Method(spec, compressor=spec)
    head, _, compressor = spec.partition("+")
    mode, *rest = head.split(":")
    method = Method(spec, ":".join([mode, *rest[:1]]), compressor or "none")
    opts = rest[1:]
    outer.parse_sync(method.sync)
    for opt in opts:
        name, eq, text = opt.partition("=")
        if not eq or name not in _OPTIONS:
            raise ValueError(
                f"method {spec!r}: {opt!r} is not fragments=F, delay=STEPS or mix=ALPHA"
            )
        try:
            setattr(method, name, _OPTIONS[name](text))
        except ValueError:
            raise ValueError(f"method {spec!r}: {name} {text!r} is not a number") from None
    if method.compressor != "none":
        get_compressor(method.compressor)
    if cfg is not None:
        try:
            outer.check(method.outer_settings(cfg))
        except ValueError as e:
            raise ValueError(f"method {spec!r}: {e}") from None
    return method
