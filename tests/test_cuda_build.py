"""A compile-only check of the CUDA code, so it can never rot on machines
without a GPU: every ``csrc/cuda/*.cu`` through nvcc with the flags setup.py
uses (csrc/cuda/nvcc_flags.txt), and every ``csrc/cuda/*.cc`` and the CUDA
kernels' bindings (``csrc/python/cuda_bindings.cc``, compiled to nothing in a
build without CUDA) through the host compiler against the CUDA headers. Skips
where nvcc is missing.

The default suite compiles to PTX for compute_90 (nvcc's front end and
device code generation: every C++ and CUDA error and warning), which takes
half the time of the whole sm_90 build; CLAWCOMM_LONG_TESTS=1 also runs
ptxas to sm_90 machine code, as setup.py and the GPU session's build do.
Running the kernels is tests/test_gpu_kernels.py's job (GPU only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "csrc", "cuda")
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _files(ext):
    return sorted(f for f in os.listdir(CUDA) if f.endswith(ext))


def _cuda_include():
    """The toolkit's headers, found as setup.py finds them."""
    homes = [
        os.environ.get("CUDA_HOME", ""),
        os.path.dirname(os.path.dirname(os.path.realpath(NVCC))),
    ]
    for home in homes + ["/usr/local/cuda"]:
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    pytest.skip("the CUDA headers are not found (set CUDA_HOME)")


@pytest.fixture(scope="module")
def nvcc_runs(tmp_path_factory):
    """Every .cu file's compile, started together: nvcc spends most of a
    minute in one file, on one core, and the machine has two."""
    with open(os.path.join(CUDA, "nvcc_flags.txt")) as f:
        flags = f.read().split()
    long = os.environ.get("CLAWCOMM_LONG_TESTS") == "1"
    sass = ["-c", "-gencode=arch=compute_90,code=sm_90"]
    target = sass if long else ["--ptx", "-arch=compute_90"]
    runs = {}
    for name in _files(".cu"):
        out = tmp_path_factory.mktemp("nvcc")
        cmd = [NVCC, *target, *flags, "-DCLAWCOMM_WITH_CUDA=1"]
        cmd += ["-I", os.path.join(ROOT, "csrc"), os.path.join(CUDA, name), "-o", str(out / "x.o")]
        log = open(out / "stderr", "w+")  # a file: a pipe left unread could fill and stall nvcc
        runs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log), log)
    yield runs
    for proc, log in runs.values():
        proc.kill()
        proc.wait()
        log.close()


@pytest.mark.parametrize("name", _files(".cu"))
def test_cu_file_compiles_for_compute90(name, nvcc_runs):
    proc, log = nvcc_runs[name]
    code = proc.wait(timeout=600)
    log.seek(0)
    err = log.read()
    assert code == 0, err[-4000:]
    assert "warning" not in err.lower(), err[-4000:]


HOST_FILES = [os.path.join("csrc", "cuda", f) for f in _files(".cc")] + [
    os.path.join("csrc", "python", "cuda_bindings.cc")
]


@pytest.mark.parametrize("name", HOST_FILES)
def test_cuda_host_file_compiles(name):
    import pybind11

    cxx = shutil.which("c++") or shutil.which("g++")
    cmd = [cxx, "-fsyntax-only", "-std=c++17", "-Wall", "-DCLAWCOMM_WITH_CUDA=1"]
    cmd += ["-I", os.path.join(ROOT, "csrc"), "-I", _cuda_include(), "-I", pybind11.get_include()]
    cmd += ["-I", sysconfig.get_paths()["include"], os.path.join(ROOT, name)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
