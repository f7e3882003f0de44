"""Builds clawcomm's two compiled modules.

* ``clawcomm._C``: the engine under csrc/ (everything but csrc/torch/), its
  kernels and their pybind11 bindings. Plain C++17, no torch headers: it
  builds (and runs, on numpy arrays) without torch.
* ``clawcomm._C_torch``: the torch.distributed adapter, csrc/torch/, the only
  code that includes torch. It links against ``_C`` (found next to it through
  an rpath of $ORIGIN), so the engine exists once in the process. Skipped when
  torch is not installed.

Build against the torch that is already installed (any of 2.11 to 2.13):

    pip install --no-build-isolation -e .

CUDA (csrc/cuda/*.cu): compiled into ``_C`` when nvcc is found and the
installed torch is a CUDA build, or when CLAWCOMM_CUDA=1; CLAWCOMM_CUDA=0
leaves it out. CLAWCOMM_CUDA_ARCH picks the GPU architectures (default 90).
"""

import glob
import os
import shutil

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def sources(pattern):
    return sorted(
        os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True)
    )


def pybind11_include():
    """pybind11's headers: the pip package's, else the copy torch ships."""
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        if HAVE_TORCH:
            return [p for p in include_paths() if p.endswith("include")][0]
        raise SystemExit(
            "clawcomm: building needs pybind11 (pip install pybind11) or torch"
        ) from None


engine_sources = [s for s in sources("csrc/**/*.cc") if not s.startswith("csrc/torch/")]
adapter_sources = sources("csrc/torch/*.cc")

# -ffp-contract=off: no fused multiply-add behind our back, so every SIMD
# build of a kernel rounds the same way and gives the same bits. No
# -fvisibility=hidden on the engine: the adapter links against its symbols
# (pybind11 hides its own).
cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-Wall", "-Wno-sign-compare"]

extensions = [
    Extension(
        name="clawcomm._C",
        sources=engine_sources,
        include_dirs=[os.path.join(HERE, "csrc"), pybind11_include()],
        extra_compile_args=list(cxx_flags),
        libraries=["rt"],
        language="c++",
    )
]
if HAVE_TORCH:
    extensions.append(
        CppExtension(
            name="clawcomm._C_torch",
            sources=adapter_sources,
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args=list(cxx_flags[:1] + cxx_flags[2:]) + ["-fvisibility=hidden"],
        )
    )

Base = BuildExtension.with_options(use_ninja=bool(shutil.which("ninja"))) if HAVE_TORCH else None
if Base is None:
    from setuptools.command.build_ext import build_ext as Base


class build_ext(Base):
    """Gives ``_C`` a soname and links ``_C_torch`` against it."""

    def build_extension(self, ext):
        if ext.name == "clawcomm._C":
            soname = os.path.basename(self.get_ext_fullpath(ext.name))
            ext.extra_link_args = [f"-Wl,-soname,{soname}"]
        elif ext.name == "clawcomm._C_torch":
            ext.extra_link_args = [self.get_ext_fullpath("clawcomm._C"), "-Wl,-rpath,$ORIGIN"]
        super().build_extension(ext)


setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
