"""DDP comm hooks that compress gradients with clawcomm's compressors.

    from torch.nn.parallel import DistributedDataParallel as DDP
    from clawcomm.hooks import CompressionHookState, compression_hook

    model = DDP(model)
    state = CompressionHookState("topk:0.01", warmup_steps=20)
    model.register_comm_hook(state, compression_hook)
    ...
    torch.save({"model": ..., "hook": state.state_dict()}, path)   # residuals too

Works with stock ``DistributedDataParallel.register_comm_hook`` on CPU
tensors. Error-feedback residuals are keyed by DDP's bucket index; for the
first ``warmup_steps`` iterations gradients are reduced densely (as Deep
Gradient Compression warms up). Gradients are averaged, as DDP's own
all-reduce does. The hook reduces synchronously and returns a completed
future; for compressed reductions that overlap backward, use
``clawcomm.parallel.DataParallel`` (its compressed buckets run on a
reduction thread).
"""

# No `from __future__ import annotations`: DDP checks the hook's return
# annotation object, which must be torch.futures.Future[torch.Tensor].
import torch

from clawcomm.compression import Compressor, CompressorState, get_compressor

__all__ = ["CompressionHookState", "compression_hook"]


class CompressionHookState:
    def __init__(self, compressor: "str | Compressor", group=None, warmup_steps: int = 0):
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"CompressionHookState: warmup_steps {warmup_steps!r} must be >= 0")
        self.compressor = get_compressor(compressor)
        self.group = group
        self.warmup_steps = warmup_steps
        self.compression = CompressorState()
        self.dense = get_compressor("none")

    @property
    def step(self) -> int:
        """Iterations (backward passes) completed."""
        return self.compression.step

    def state_dict(self) -> dict:
        return {"spec": self.compressor.spec, "compression": self.compression.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["spec"] != self.compressor.spec:
            raise ValueError(
                f"CompressionHookState: checkpoint was made with {state['spec']!r}, "
                f"this state uses {self.compressor.spec!r}"
            )
        self.compression.load_state_dict(state["compression"])


def compression_hook(state: CompressionHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the bucket's gradients averaged over the group,
    compressed after the warm-up."""
    buf = bucket.buffer()
    compressor = state.dense if state.step < state.warmup_steps else state.compressor
    if getattr(compressor, "uses_shapes", False):  # PowerSGD: the bucket's matrices
        state.compression.shapes[bucket.index()] = [g.shape for g in bucket.gradients()]
    compressor.all_reduce_mean(buf, state.compression, bucket.index(), state.group)
    if bucket.is_last():
        state.compression.step += 1
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut
