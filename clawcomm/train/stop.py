"""Stopping a run on SIGTERM or SIGINT without losing it.

A scheduler's preemption (SIGTERM) or Ctrl-C (SIGINT) asks every rank to
stop. The first signal only raises a flag: the rank finishes the step it is
in, every rank learns of the flag through the step's own all-gather of
figures (so all of them stop after the same step, with no extra collective),
the trainer saves a checkpoint when it has a folder, and the run ends with
exit status 128 + the signal's number. The first signal also puts both
signals back to their default action, so a second one stops the rank at
once.

Under ``clawcomm train --nproc N`` the launcher takes the signal for its
ranks (they ignore SIGINT, which a terminal sends to the whole process
group): it sends each rank one SIGTERM, and on a second signal kills them.
Under torchrun, torchrun forwards its SIGTERM to every rank itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def name(signum: int) -> str:
    return signal.Signals(signum).name


def request_line(signum: int, checkpoint_dir: str) -> str:
    """What a stop request says when it is taken: what was asked, not what
    will be done (a rank can still fail before its save; the run's last
    line says what was)."""
    save = (
        f" and save it in {checkpoint_dir}"
        if checkpoint_dir
        else "; nothing is saved (no --checkpoint-dir)"
    )
    return (
        f"clawcomm train: {name(signum)}: asking every rank to stop after the step it is "
        f"in{save} (a second signal stops them at once)"
    )


def exit_status(signum: int) -> int:
    """The shell's convention for a process a signal ended: 128 + its number."""
    return 128 + signum


class StopRequest:
    """The flag a rank's first SIGTERM or SIGINT raises (``signum``, 0 until
    then). ``install()`` works in the main thread only (elsewhere signals
    stay as they are); ``on_signal`` is called once, in the handler."""

    def __init__(self, on_signal=None):
        self.signum = 0
        self._on_signal = on_signal
        self._old: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in SIGNALS:
            if signal.getsignal(s) is signal.SIG_IGN:
                continue  # a launcher that takes this signal for us (SIGINT below clawcomm train)
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        for s in self._old:
            signal.signal(s, signal.SIG_DFL)  # a second signal: the default, at once
        self.signum = signum
        if self._on_signal is not None:
            self._on_signal(signum)

    def uninstall(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}


class Launcher:
    """``clawcomm train --nproc``'s side: while its ranks run, the first
    SIGTERM or SIGINT is passed on to every rank as one SIGTERM, a second
    one kills them. ``signum`` is the first signal's number (0: none). It
    says the signal the user sent; its ranks, which hear SIGTERM, say
    nothing of it."""

    def __init__(self, checkpoint_dir: str = ""):
        self.signum = 0
        self.killed = False
        self.checkpoint_dir = checkpoint_dir
        self._old: dict[int, object] = {}

    def __enter__(self) -> Launcher:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        children = multiprocessing.active_children()
        if self.signum:
            self.killed = True
            for p in children:
                os.kill(p.pid, signal.SIGKILL)
            print(f"clawcomm train: a second {name(signum)}: ranks killed", file=sys.stderr)
            return
        self.signum = signum
        print(request_line(signum, self.checkpoint_dir), file=sys.stderr, flush=True)
        for p in children:
            os.kill(p.pid, signal.SIGTERM)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def ignore_sigint() -> None:
    """A rank below the launcher: the terminal's SIGINT is the launcher's to
    pass on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
