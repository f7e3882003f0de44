"""Regenerates clawcomm/_C.pyi from the built module (pip install pybind11-stubgen).
Run it against a CUDA build (CLAWCOMM_CUDA=1 builds one without a GPU), so the
stub covers the ``cuda`` submodule too.

pybind11-stubgen writes a package (_C/__init__.pyi, kernels.pyi, compress.pyi,
...); this folds it into one file, with each submodule as a class of static
functions, and runs ruff format on it::

    python3 .ci/gen_stub.py
"""

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEAD = '''"""Type stub for ``clawcomm._C``: the engine, its kernels and codecs, built
without torch (csrc/python/). ``kernels``, ``compress`` (and ``cuda`` in CUDA
builds) are submodules at run time; they are written as classes of static
functions here so that one stub file covers the module. Regenerate with
``python3 .ci/gen_stub.py`` after changing the bindings; tests/test_engine.py
checks that every public name is here.
"""

from __future__ import annotations

import typing

import numpy
import numpy.typing
import typing_extensions

'''


def _submodule(path: str, name: str) -> str:
    s = open(path).read()
    doc = re.search(r'^"""\n(.*?)\n"""', s, re.S).group(1).strip()
    fns = s[s.index("def ") :]
    out = [f"class {name}:", f'    """The ``clawcomm._C.{name}`` submodule: {doc}"""', ""]
    for block in re.split(r"\n(?=def )", fns):
        out.append("    @staticmethod")
        out += ["    " + line if line else line for line in block.rstrip().split("\n")]
    return "\n".join(out) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=HERE)
        subprocess.run(
            [sys.executable, "-m", "pybind11_stubgen", "clawcomm._C", "-o", tmp],
            env=env,
            check=True,
        )
        base = os.path.join(tmp, "clawcomm", "_C")
        main_stub = open(os.path.join(base, "__init__.pyi")).read()
        parts = [HEAD]
        for f in sorted(os.listdir(base)):
            if f != "__init__.pyi":
                parts.append(_submodule(os.path.join(base, f), f[:-4]) + "\n")
        parts.append(main_stub[main_stub.index("class Engine") :])
    out = os.path.join(HERE, "clawcomm", "_C.pyi")
    text = re.sub(
        r"cuda_built: bool = (True|False)",
        "cuda_built: bool  # True in CUDA builds, which add the `cuda` submodule",
        "".join(parts),
    )
    with open(out, "w") as f:
        f.write(text)
    subprocess.run(["ruff", "format", "-q", out], check=True)


if __name__ == "__main__":
    main()
