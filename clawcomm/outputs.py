"""The files and folders a command writes: checked before any rank starts,
named as they are written.

``check`` makes an output's folder (or the folder itself, for an output
that is a folder) and proves it can be written, so that a path that cannot
be written fails in one line naming the flag and the path, at once, instead
of a traceback after the whole run. ``wrote`` is the one line a command
prints for each file it writes.
"""

from __future__ import annotations

import os
import sys
import tempfile


class OutputError(ValueError):
    """An output path that cannot be written; the message names the flag."""


def check(flag: str, path: str, folder: bool = False) -> None:
    """Raises OutputError unless ``path`` (a file, or with ``folder`` a
    folder) can be written: its folder is made where it can be; nothing is
    left behind that was not there before."""
    if not path:
        return
    where = path if folder else (os.path.dirname(os.path.abspath(path)) or ".")
    try:
        if not folder and os.path.isdir(path):
            raise OutputError(f"{flag} {path}: is a folder, not a file")
        if folder and os.path.exists(path) and not os.path.isdir(path):
            raise OutputError(f"{flag} {path}: is a file, not a folder")
        os.makedirs(where, exist_ok=True)
        if folder:
            fd, probe = tempfile.mkstemp(prefix=".clawcomm-probe-", dir=where)
            os.close(fd)
            os.unlink(probe)
        else:
            existed = os.path.exists(path)
            with open(path, "a"):
                pass
            if not existed:
                os.unlink(path)
    except OSError as e:
        blocker = file_in_the_way(where)
        if blocker:
            raise OutputError(f"{flag} {path}: {blocker} is a file, not a folder") from None
        reason = e.strerror or str(e)
        raise OutputError(f"{flag} {path}: cannot write there ({reason})") from None


def file_in_the_way(folder: str) -> str:
    """The file that stands where ``folder`` or one of its parents must be
    a folder ('' when none does): what makedirs' "File exists" and "Not a
    directory" mean."""
    here = os.path.abspath(folder)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if os.path.isdir(here):
        return ""
    rel = os.path.relpath(here)
    return rel if not rel.startswith("..") else here


def wrote(prog: str, what: str, path: str) -> None:
    """The line a command prints when it has written ``path``."""
    print(f"{prog}: wrote {what} {path}", flush=True)


def failed(prog: str, flag: str, path: str, error: Exception) -> None:
    """The line for a write that failed at the end (the run's figures are
    printed already)."""
    print(f"{prog}: could not write {flag} {path}: {error}", file=sys.stderr, flush=True)
