"""What a wheel of clawcomm would carry, without building one: setuptools'
own build_py, configured from pyproject.toml as a build configures it, must
pick every .py file and every other file git tracks under clawcomm/. Every
other test runs on the editable install, which sees the whole folder, so a
subpackage or a data file left out of the wheel would pass them all.
(.ci/wheel_smoke builds the wheel, installs it and runs it.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a child with the repository as its folder: build_py resolves the
# packages' folders from there, and importing setuptools here would swap
# the test process's distutils.
_WHAT_BUILD_PY_TAKES = """
import json, warnings
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

warnings.simplefilter("ignore")  # setuptools' deprecations of pyproject keys
dist = Distribution({"script_name": "setup.py"})
apply_configuration(dist, "pyproject.toml")
dist.include_package_data = False  # package-data alone: no MANIFEST.in, no egg-info written
build_py = dist.get_command_obj("build_py")
build_py.ensure_finalized()
print(json.dumps({
    "packages": dist.packages,
    "modules": [path for _, _, path in build_py.find_all_modules()],
    "data": [f"{src}/{f}" for _, src, _, files in build_py.data_files for f in files],
}))
"""


@pytest.fixture(scope="module")
def took() -> dict[str, list[str]]:
    """The packages, modules and data files build_py takes."""
    proc = subprocess.run(
        [sys.executable, "-c", _WHAT_BUILD_PY_TAKES],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _tracked(pattern: str) -> set[str]:
    """git's files (committed, or new and not ignored: built modules are)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {os.path.normpath(p) for p in out.split()}


def test_every_file_of_the_package_goes_into_the_wheel(took):
    tracked = _tracked("clawcomm")
    assert len(tracked) > 90
    py = {p for p in tracked if p.endswith(".py")}
    others = tracked - py

    modules = {os.path.normpath(p) for p in took["modules"]}
    left_out = sorted(py - modules)
    folders = sorted({os.path.dirname(p) for p in left_out})
    assert not left_out, (
        f"modules the wheel would leave out: {left_out}. A folder of modules needs an "
        f"__init__.py to be found as a package ({folders}; pyproject.toml: "
        "[tool.setuptools.packages.find])"
    )
    data = {os.path.normpath(p) for p in took["data"]}
    left_out = sorted(others - data)
    assert not left_out, (
        f"files the wheel would leave out: {left_out}. Add their pattern to "
        "[tool.setuptools.package-data] in pyproject.toml"
    )
    assert "clawcomm/_C.pyi" in data and "clawcomm/py.typed" in data


def test_the_packages_are_found_not_listed(took):
    # A hand-written list is what let a new subpackage fall out of the wheel.
    folders = {
        os.path.dirname(p).replace(os.sep, ".") for p in _tracked("clawcomm") if p.endswith(".py")
    }
    assert set(took["packages"]) == folders
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert "[tool.setuptools.packages.find]" in text and "\npackages = [" not in text
