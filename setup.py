"""Builds clawcomm's compiled core, ``clawcomm._C``.

The engine under csrc/ (everything but csrc/torch/) is plain C++17 with no
torch headers; only csrc/torch/process_group.cc includes torch. Build against
the torch that is already installed:

    pip install --no-build-isolation -e .

CLAWCOMM_CUDA=1 adds the CUDA sources under csrc/cuda/ (none yet: they come
with the GPU issue).
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def sources(pattern):
    return sorted(
        os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True)
    )


cpp_sources = [s for s in sources("csrc/**/*.cc")]
cuda_sources = sources("csrc/cuda/**/*.cu")
use_cuda = os.environ.get("CLAWCOMM_CUDA", "0") == "1" and cuda_sources

# -ffp-contract=off: no fused multiply-add behind our back, so every SIMD
# build of a kernel rounds the same way and gives the same bits.
extra = {
    "cxx": ["-O3", "-ffp-contract=off", "-Wall", "-Wno-sign-compare", "-fvisibility=hidden"],
}
Extension = CppExtension
if use_cuda:
    Extension = CUDAExtension
    extra["nvcc"] = ["-O3"]

setup(
    ext_modules=[
        Extension(
            name="clawcomm._C",
            sources=cpp_sources + (cuda_sources if use_cuda else []),
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args=extra,
            libraries=["rt"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
