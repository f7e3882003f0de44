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

CUDA (csrc/cuda/: the kernels, their bindings ``clawcomm._C.cuda``): compiled
into ``_C`` when nvcc is found and the installed torch is a CUDA build, or
when CLAWCOMM_CUDA=1; CLAWCOMM_CUDA=0 leaves it out. CLAWCOMM_CUDA_ARCH picks
the GPU architectures (default 90, e.g. "80;90"). nvcc's flags are in
csrc/cuda/nvcc_flags.txt, which the CI compile check (tests/test_cuda_build.py)
uses too.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

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


engine_sources = [
    s for s in sources("csrc/**/*.cc") if not s.startswith(("csrc/torch/", "csrc/cuda/"))
]
adapter_sources = sources("csrc/torch/*.cc")


def cuda_home():
    """The CUDA toolkit: $CUDA_HOME, else where nvcc really lives, else /usr/local/cuda."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    for home in ([os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []) + [
        "/usr/local/cuda"
    ]:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def want_cuda():
    """CLAWCOMM_CUDA=1 or 0 decides; unset: nvcc is there and torch is a CUDA build."""
    choice = os.environ.get("CLAWCOMM_CUDA", "")
    if choice in ("0", "1"):
        return choice == "1"
    return bool(HAVE_TORCH and cuda_home() and getattr(torch.version, "cuda", None))


with open(os.path.join(HERE, "csrc", "cuda", "nvcc_flags.txt")) as f:
    NVCC_FLAGS = f.read().split()
use_cuda = want_cuda()
if use_cuda and not HAVE_TORCH:
    raise SystemExit("clawcomm: CLAWCOMM_CUDA=1 needs torch (its build_ext compiles the .cu files)")
if use_cuda:
    import torch.utils.cpp_extension as cpp

    # A CPU torch leaves CUDA_HOME unset and would refuse .cu files; with
    # CLAWCOMM_CUDA=1 and nvcc present, point it at the toolkit, so the CUDA
    # build can be compiled and linked (not run) on a machine without a GPU.
    if cpp.CUDA_HOME is None:
        cpp.CUDA_HOME = cuda_home()

# -ffp-contract=off: no fused multiply-add behind our back, so every SIMD
# build of a kernel rounds the same way and gives the same bits. No
# -fvisibility=hidden on the engine: the adapter links against its symbols
# (pybind11 hides its own).
cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-Wall", "-Wno-sign-compare"]

engine = dict(
    name="clawcomm._C",
    sources=engine_sources,
    include_dirs=[os.path.join(HERE, "csrc"), pybind11_include()],
    extra_compile_args=list(cxx_flags),
    libraries=["rt"],
    language="c++",
)
if use_cuda:
    # The CUDA kernels (csrc/cuda/, no torch headers) join the engine module.
    archs = os.environ.get("CLAWCOMM_CUDA_ARCH", "90").replace(",", ";").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    home = cuda_home()
    engine["sources"] = engine_sources + sources("csrc/cuda/*.cc") + sources("csrc/cuda/*.cu")
    engine["include_dirs"].append(os.path.join(home, "include"))
    engine["library_dirs"] = [os.path.join(home, "lib64")]
    engine["libraries"] = ["rt", "cudart"]
    engine["define_macros"] = [("CLAWCOMM_WITH_CUDA", "1")]
    engine["extra_compile_args"] = {
        "cxx": cxx_flags + ["-DCLAWCOMM_WITH_CUDA=1"],
        "nvcc": NVCC_FLAGS + gencode + ["-DCLAWCOMM_WITH_CUDA=1"],
    }
extensions = [Extension(**engine)]
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
    """Gives ``_C`` a soname and links ``_C_torch`` against it.

    Objects are kept in one folder, build/temp.PLATFORM-PYTHON/, for every
    kind of build (setuptools gives an editable install a fresh temporary
    folder each time), and ninja decides what to recompile: a second
    ``pip install -e .``, or a wheel built after it, compiles only what
    changed (a build for another environment, whose include paths differ,
    compiles everything again). ``force``: the extension is always handed to ninja and linked
    again, since setuptools' own check looks at the .cc files' dates alone,
    not the headers', and would keep a stale module.

    A wheel or a plain ``pip install .`` links its modules without debug
    information (Python's CFLAGS compile with -g: 67 MB of modules, against
    3.5 MB stripped); an editable or in-place build keeps it for gdb, as does
    ``build_ext --debug``.
    """

    def finalize_options(self):
        chosen_temp = self.build_temp  # --build-temp given on the command line
        super().finalize_options()
        if chosen_temp is None:
            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(HERE, "build", f"temp.{tag}")
        self.force = True
        # Read here: run() clears inplace while it builds.
        self.strip_debug = not (self.inplace or self.debug)

    def build_extension(self, ext):
        if ext.name == "clawcomm._C":
            soname = os.path.basename(self.get_ext_fullpath(ext.name))
            ext.extra_link_args = [f"-Wl,-soname,{soname}"]
        elif ext.name == "clawcomm._C_torch":
            ext.extra_link_args = [self.get_ext_fullpath("clawcomm._C"), "-Wl,-rpath,$ORIGIN"]
        if self.strip_debug:
            ext.extra_link_args.append("-Wl,--strip-debug")
        super().build_extension(ext)
        if ext.name == "clawcomm._C":
            check_libstdcxx_is_shared(self.get_ext_fullpath(ext.name))


def check_libstdcxx_is_shared(path):
    """Refuses a ``_C`` that carries its own copy of libstdc++.

    Some toolchains (a GCC under /opt whose libstdc++ exists only as a static
    archive, as on the GPU machines' image, where CXX=/opt/gcc/bin/g++) link
    libstdc++ into the module. torch has already loaded the system's
    libstdc++.so, and the two copies' locale tables do not mix: the first
    number formatted into a string segfaults (seen in rendezvous).
    """
    try:
        out = subprocess.run(
            ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return  # no nm here: nothing to check with
    if " _ZNSt6locale7classicEv" in out:
        raise SystemExit(
            f"clawcomm: the C++ compiler ({os.environ.get('CXX', 'c++')}) linked its own static "
            "copy of libstdc++ into clawcomm._C, which crashes next to the libstdc++ that torch "
            "loads. Build with the system compiler that torch matches, e.g.: "
            "CC=gcc CXX=g++ pip install --no-build-isolation -e ."
        )


setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
