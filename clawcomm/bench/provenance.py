"""Where and when a result was measured: the ``provenance`` field every
JSON the benchmarks write carries (``report.write_json`` adds it), so a
figure can be traced to a date, a commit and a machine::

    {"date": "2026-12-07T03:12:09Z", "commit": "3518913...", "tree": "5d0c...",
     "gpu": "NVIDIA H100 80GB HBM3, 580.82.07, 81559 MiB", "host": "vm",
     "cpu": "Intel(R) Xeon(R) Processor", "cores": 16, "load": [0.5, 0.3, 0.2]}

``commit`` is ``git rev-parse HEAD`` (with ``+modified`` where tracked files
differ from it), else ``$CLAWCOMM_COMMIT`` (the GPU machines get a copy of
the working tree without ``.git``: bench/gpu_check.sh passes it), else
"not recorded". ``tree`` is a hash of the sources that decide a result
(``tree_hash``), the same here and on a machine without git, so a copy can
be matched to a commit afterwards. ``gpu`` is the first line
``nvidia-smi`` prints for the GPU (name, driver, memory), "none" without one.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What decides a result: the engine, the package, the build, the benchmarks.
TREE = ("csrc", "clawcomm", "bench", "setup.py")
_SOURCE_EXT = (".py", ".h", ".cc", ".cu", ".cuh", ".txt", ".sh")


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def commit() -> str:
    head = _run(["git", "rev-parse", "HEAD"])
    if head:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        return head + ("+modified" if dirty else "")
    return os.environ.get("CLAWCOMM_COMMIT", "") or "not recorded"


def tree_hash(root: str = ROOT) -> str:
    """sha1 over the paths and contents of TREE's source files, in sorted
    order (build outputs and results left out)."""
    h = hashlib.sha1()
    for top in TREE:
        path = os.path.join(root, top)
        files = [path] if os.path.isfile(path) else []
        for d, dirs, names in os.walk(path):
            dirs[:] = sorted(x for x in dirs if x not in ("results", "__pycache__"))
            files += [os.path.join(d, n) for n in names if n.endswith(_SOURCE_EXT)]
        for f in sorted(files):
            h.update(os.path.relpath(f, root).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def gpu() -> str:
    if shutil.which("nvidia-smi"):
        line = _run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
            ]
        )
        if line:
            return line.splitlines()[0]
    return "none"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def provenance() -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {
        "date": now.isoformat().replace("+00:00", "Z"),
        "commit": commit(),
        "tree": tree_hash(),
        "gpu": gpu(),
        "host": platform.node(),
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "load": [round(x, 2) for x in os.getloadavg()],
    }


if __name__ == "__main__":
    # For a shell script, without importing clawcomm (which needs the build):
    #   python3 clawcomm/bench/provenance.py [--tree]
    import json
    import sys

    print(tree_hash() if "--tree" in sys.argv else json.dumps(provenance()))
