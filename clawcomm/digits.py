"""scikit-learn's bundled digits (1797 8x8 images, 10 classes), the data of
the ``mlp`` model of ``clawcomm train`` and of the compression lab.

Read straight from the CSV file scikit-learn ships, without importing
scikit-learn: that import takes about 3.5 s of CPU, and every rank of every
run paid it. Where the file is not found (another scikit-learn layout),
``sklearn.datasets.load_digits`` reads it.
"""

from __future__ import annotations

import importlib.util
import os


def load() -> tuple:
    """(images as float64 in [0, 16], shape (1797, 64); labels as int64)."""
    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = os.path.join(root, "datasets", "data", "digits.csv.gz")
            if os.path.exists(path):
                rows = np.loadtxt(path, delimiter=",")
                return rows[:, :-1], rows[:, -1].astype(np.int64)
    from clawcomm._optional import require

    d = require("sklearn.datasets", "the mlp model (the digits data)").load_digits()
    return d.data, d.target.astype(np.int64)
