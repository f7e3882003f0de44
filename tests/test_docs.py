"""The documentation: the site builds with ``mkdocs build --strict`` (a
broken link, a missing file or a page left out of the build fails), the
README stays a page, and every figure the docs show names the command and
the committed file that made it."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (bash .ci/setup installs it)")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    site = tmp_path / "site"
    assert (site / "api" / "index.html").read_text().count("GradReducer") > 0
    for png in ("pipeline.png", "timeline_zb1.png", "collectives_2ranks.png"):
        assert (site / "bench-results" / png).exists(), png


def test_every_page_is_in_the_navigation():
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    pages = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))}
    missing = sorted(p for p in pages if f": {p}" not in nav)
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


def test_the_readme_is_a_page():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert text.count("\n") <= 250
    assert "bash .ci/setup" in text and "docs/" in text


def _figures(path: str) -> list[tuple[str, str]]:
    """(image target, the text right after it) for each figure in a page."""
    text = open(path).read()
    return [(m.group(1), text[m.end() : m.end() + 600]) for m in IMAGE.finditer(text)]


def test_every_figure_names_its_command_and_file():
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    seen = 0
    for page in pages:
        for target, after in _figures(page):
            seen += 1
            name = os.path.basename(target)
            committed = os.path.normpath(os.path.join(os.path.dirname(page), target))
            assert os.path.exists(committed), f"{page}: {target} is not committed"
            caption = after.lstrip("\n").split("\n\n")[0]
            assert caption.startswith("*Made by"), f"{page}: {name} has no 'Made by' line"
            assert re.search(r"`(clawcomm|python3) ", caption), f"{page}: {name}: no command"
            assert f"bench/results/{name}" in caption, f"{page}: {name}: another file named"
    assert seen >= 6


def test_a_figure_without_its_command_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("![plot](../bench/results/pipeline.png)\n\nSome text.\n")
    [(target, after)] = _figures(str(page))
    assert not after.lstrip("\n").startswith("*Made by")


def test_mkdocs_is_optional_for_the_package():
    # The site's tools are an extra, never a dependency of the package.
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "mkdocs" not in deps and "docs = [" in text


def test_the_glossarys_modules_exist():
    """Every module the glossary names imports: a rename that forgets the
    glossary fails here."""
    import importlib

    text = open(os.path.join(ROOT, "docs", "glossary.md")).read()
    names = set(re.findall(r"`(clawcomm(?:\.[a-z_0-9]+)+)", text))
    assert len(names) > 10
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            module, _, attr = name.rpartition(".")
            assert hasattr(importlib.import_module(module), attr), name


def test_no_copy_paste_command_overwrites_the_committed_results():
    """The README's and docs' code blocks write into runs/; the commands
    that regenerate bench/results/ live in bench/README.md, marked so."""
    writes = re.compile(r"(--json|--plot|--trace|--timeline|--metrics|\| *tee|>) +bench/results/")
    pages = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    found = []
    for page in pages:
        for block in re.findall(r"```[a-z]*\n(.*?)```", open(page).read(), re.S):
            found += [f"{os.path.basename(page)}: {m.group(0)}" for m in writes.finditer(block)]
    assert not found, found
    bench = open(os.path.join(ROOT, "bench", "README.md")).read()
    assert "overwrite the files in `bench/results/`" in bench
