"""The random number generators' states a checkpoint keeps per rank, so
that a resume at the same layout draws what the uninterrupted run drew."""

from __future__ import annotations

import pickle
import random

import torch


def state() -> bytes:
    """torch's, Python's, numpy's and (where in use) CUDA's RNG states, pickled."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(states)


def restore(blob: bytes) -> None:
    """Sets the RNG states ``state()`` returned."""
    states = pickle.loads(blob)
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
