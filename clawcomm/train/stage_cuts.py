"""How a model's layers are cut into pipeline stages: each layer's cost (its
parameters, or its measured time) and the contiguous cut that balances the
stages' costs."""

from __future__ import annotations

import torch
from torch import nn


def parameter_costs(layers: list[nn.Module]) -> list[float]:
    """Each layer's parameter count (shared parameters counted where they
    first appear), plus one so that a layer without parameters still costs
    something."""
    seen: set[int] = set()
    costs = []
    for layer in layers:
        n = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        costs.append(float(n) + 1.0)
    return costs


def measured_costs(layers: list[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each layer's forward + backward time (seconds, best of ``repeats``)
    on ``sample``, run through the layers in order."""
    import time

    costs = [float("inf")] * len(layers)
    for _ in range(repeats):
        x = sample
        for i, layer in enumerate(layers):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out))
            costs[i] = min(costs[i], time.perf_counter() - t0)
            x = out.detach()
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    return costs


def balanced_cuts(costs: list[float], parts: int) -> list[int]:
    """Boundaries ``[0, c1, ..., len(costs)]`` of ``parts`` contiguous,
    non-empty blocks that minimise the largest block's cost (the classic
    linear-partition DP; ties go to the earlier cut)."""
    n = len(costs)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} stages: more stages than layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible max block cost of layers[:i] in k blocks.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds = [n]
    i = n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]
