"""mkdocs hook: the figures the docs show live with the command that made
them, in bench/results/, outside docs/. Pages link them as
``../bench/results/<file>`` (which GitHub renders); the site gets a copy of
each figure a page links, under ``bench-results/``, and the links point
there. A link to a figure that is not committed stays as it is, and
``mkdocs build --strict`` then fails on it."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
LINK = re.compile(r"\]\(\.\./bench/results/([\w.\-]+)\)")


def on_files(files, config):
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith((".png", ".svg")):
            path = os.path.join(RESULTS, name)
            files.append(File.generated(config, f"bench-results/{name}", abs_src_path=path))
    return files


def on_page_markdown(markdown, page, config, files):
    def local(m: re.Match) -> str:
        name = m.group(1)
        if not os.path.exists(os.path.join(RESULTS, name)):
            return m.group(0)
        return f"](bench-results/{name})"

    return LINK.sub(local, markdown)
