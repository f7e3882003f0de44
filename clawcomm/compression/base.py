"""The compressor interface and the per-bucket state it keeps."""

from __future__ import annotations

import copy
import statistics
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed


class CompressorState:
    """What a compressor remembers between steps: one error-feedback residual
    per key (a DDP bucket index, a parameter name...), and a step counter that
    is the same on every rank (random-k seeds its choice from it).

    ``momenta`` holds a second per-element buffer where a method needs one
    (DGC's momentum), moved and checkpointed with the residuals; ``memory``
    holds tensors of other shapes under (key, name) (PowerSGD's Q, the
    error feedback of a rank's part in EF-SignSGD's second stage).

    ``state_dict()``/``load_state_dict()`` make it part of a checkpoint, so
    error feedback survives a restart.
    """

    def __init__(self):
        self.residuals: dict = {}
        self.momenta: dict = {}
        self.memory: dict = {}
        self.shapes: dict = {}  # key -> the parameter shapes laid out in it (PowerSGD)
        self.calls: dict = {}  # key -> how many times it was reduced
        self.step = 0

    def tick(self, key) -> int:
        """How many times `key` was reduced before (and count this one): the
        same on every rank, so it can seed choices that ranks must share."""
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return n

    def residual(self, key, like: torch.Tensor) -> torch.Tensor:
        return zeros_like_in(self.residuals, key, like)

    def momentum(self, key, like: torch.Tensor) -> torch.Tensor:
        return zeros_like_in(self.momenta, key, like)

    def per_element(self) -> dict[str, dict]:
        """The buffers that run parallel to a key's tensor, by kind: what a
        caller that re-lays buckets out or cuts a checkpoint by parameter
        moves element by element."""
        return {"residual": self.residuals, "momentum": self.momenta}

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "calls": dict(self.calls),
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "momenta": {k: v.clone() for k, v in self.momenta.items()},
            "memory": {k: v.clone() for k, v in self.memory.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.calls = dict(state.get("calls", {}))
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.momenta = {k: v.clone() for k, v in state.get("momenta", {}).items()}
        self.memory = {k: v.clone() for k, v in state.get("memory", {}).items()}


def flat_f32(tensor: torch.Tensor, op: str) -> None:
    """Raises ValueError (naming ``op``) unless ``tensor`` is a contiguous
    float32 CPU or CUDA tensor."""
    if (
        tensor.dtype != torch.float32
        or not tensor.is_contiguous()
        or tensor.device.type not in ("cpu", "cuda")
    ):
        raise ValueError(
            f"clawcomm.compression.{op}: needs a contiguous float32 CPU or CUDA tensor, got "
            f"{tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ' (strided)'}"
        )


def zeros_like_in(buffers: dict, key, like: torch.Tensor) -> torch.Tensor:
    """``buffers[key]``, made float32 zeros shaped like ``like`` if missing or
    of another shape."""
    b = buffers.get(key)
    if b is None or b.shape != like.shape:
        b = buffers[key] = torch.zeros_like(like, dtype=torch.float32)
    return b


def shared_seed(state: CompressorState | None, key) -> int:
    """Equal on every rank for the same key and call (and counts the call):
    Python's own hash() of a string differs between processes, crc32 does
    not."""
    calls = state.tick(key) if state is not None else 0
    return calls * 1_000_003 + zlib.crc32(repr(key).encode())


@dataclass(frozen=True)
class Wire:
    """What one reduction of a float32 gradient puts on the wire, for a cost
    model to price (``clawcomm.plan`` does): its collectives in order, each
    as (name, bytes per rank as nccl-tests counts them: an all-reduce's
    buffer, an all-gather's output, a reduce-scatter's or an all-to-all's
    input), and how many encode-and-decode passes over the gradient it
    makes (each costs ``Compressor.codec_seconds``)."""

    collectives: tuple[tuple[str, float], ...]
    codec_passes: int = 0


def median_seconds(run, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``run(i)``, ``i`` the
    call's index; a call may return a ``perf_counter`` time to start the
    clock from (after its own set-up)."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        started = run(i)
        times.append(time.perf_counter() - (started or t0))
    return statistics.median(times)


class Compressor:
    """Sums a float32 tensor over a group, compressing what it sends.

    Subclasses implement ``all_reduce``; ``spec`` is the string that rebuilds
    the compressor. ``with_values`` returns a variant whose values travel in
    16 bits (``+fp16``/``+bf16``), when the compressor has values to send.

    A compressor also says what it costs, for the planner: ``wire`` (what
    one reduction sends), ``codec_seconds`` (what encoding and decoding
    take here) and ``state_bytes`` (what it keeps between steps).
    """

    spec = "none"
    uses_error_feedback = False
    keeps_momentum = False  # a per-element momentum in the state too (DGC)

    def all_reduce(self, tensor: torch.Tensor, state: CompressorState | None, key, group) -> None:
        """In place: ``tensor`` becomes the sum over the group of every rank's
        (compressed) tensor."""
        raise NotImplementedError

    def all_reduce_mean(self, tensor: torch.Tensor, state: CompressorState | None, key, group):
        """In place: the mean over the group. Compressors that can fold the
        division into their own passes override this."""
        self.all_reduce(tensor, state, key, group)
        tensor.div_(torch.distributed.get_world_size(group))

    # Whether reduce_scatter_mean is implemented (ZeRO's sharded reduction).
    reduces_scatter = False

    def reduce_scatter_mean(
        self, tensor: torch.Tensor, out: torch.Tensor, state: CompressorState | None, key, group
    ) -> None:
        """``out`` becomes this rank's part of the mean over the group
        (``tensor``'s length a multiple of the group's size; rank k's part
        is the k-th of as many equal slices). ``tensor`` may be used as
        scratch."""
        raise NotImplementedError(
            f"clawcomm.compression: {self.spec} has no reduce-scatter (every built-in "
            "compressor has)"
        )

    def wire(self, elems: int, world: int, sharded: bool = False, shapes=None) -> Wire | None:
        """What one reduction of ``elems`` float32 values over ``world``
        ranks sends (``sharded``: ZeRO's ``reduce_scatter_mean``; ``shapes``:
        the parameters laid out in the tensor, where the method reads them),
        or None where the values decide it (threshold, DGC, a coded ``+ec``
        wire): what those send, the compression lab measures."""
        return None

    def codec_seconds(self, elems: int, world: int, shapes=None, repeats: int = 5) -> float:
        """One encode of ``elems`` float32 values and the decode of what
        ``world`` ranks send, on this machine (the median of ``repeats``):
        what each of ``wire``'s codec passes costs. 0 where nothing is coded
        in Python or C++ beside the collectives (a 16-bit wire is converted
        inside the engine's ring)."""
        return 0.0

    def state_bytes(self, elems: int) -> float:
        """The bytes this method keeps between steps for a gradient of
        ``elems`` values: its error-feedback residual and its momentum, each
        the gradient's size."""
        return 4.0 * elems * (int(self.uses_error_feedback) + int(self.keeps_momentum))

    def with_values(self, values: str, spec: str) -> Compressor:
        raise ValueError(f"compressor spec {spec!r}: {self.spec} has no values to send as {values}")

    # Whether ``+ec`` can code what its all-reduce sends losslessly
    # (entropy.py: the sparse methods' pairs, the quantisers' codes), and
    # whether it does.
    codable = False
    coded = ""  # "", or coding.py's "auto" (+ec) or "always" (+ec:always)

    def with_coding(self, spec: str, mode: str = "auto") -> Compressor:
        """The same method with ``+ec``: what its all-reduce sends coded
        losslessly on the wire where it pays (``mode`` auto) or always (CPU
        tensors)."""
        if not self.codable:
            raise ValueError(
                f"compressor spec {spec!r}: {self.spec} has no coded wire (+ec codes the pairs "
                "of topk, threshold and dgc and the codes of int8, int4, qsgd, terngrad and sign)"
            )
        coded = copy.copy(self)
        coded.coded = mode
        coded.spec = f"{self.spec}+ec" + ("" if mode == "auto" else f":{mode}")
        return coded

    def check_coded_device(self, tensor: torch.Tensor) -> None:
        """Raises ValueError where ``+ec`` is asked of a CUDA tensor."""
        if self.coded and tensor.is_cuda:
            raise ValueError(
                f"clawcomm.compression: {self.spec} codes CPU tensors' messages; this one is on "
                f"{tensor.device} (drop +ec there)"
            )

    def __repr__(self) -> str:
        return f"<compressor {self.spec}>"
