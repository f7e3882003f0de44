"""Optional dependencies: imported where a feature needs them, with a message
that names the feature and the extra that installs them."""

from __future__ import annotations

import importlib

# module -> (pip extra, what it is for)
EXTRAS = {
    "matplotlib": ("plot", "plots (--plot, --timeline)"),
    "sklearn": ("experiments", "the bundled digits data set"),
    "numba": ("codecs", "JIT-compiled codecs"),
    "cupy": ("cuda", "GPU arrays"),
    "tensorboard": ("tensorboard", "TensorBoard logs"),
    "google": ("chakra", "Chakra execution traces (protobuf)"),
    "torchft": ("torchft", "torchft's fault-tolerant replica groups"),
}


def require(module: str, feature: str):
    """Imports ``module`` or raises ImportError saying which feature needs it
    and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra, _ = EXTRAS.get(top, (None, None))
        how = f"pip install 'clawcomm[{extra}]'" if extra else f"pip install {top}"
        raise ImportError(f"clawcomm: {feature} needs {top}, which is not installed ({how})") from e
