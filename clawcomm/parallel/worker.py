"""The thread that reduces buckets while backward runs.

Backward hands it each full bucket, in launch order; it runs the bucket's
reduction (a compressor's all_reduce_mean, which waits in the engine with
the GIL released) while the autograd thread goes on computing the next
layers' gradients. Jobs run one at a time, in the order submitted, so every
rank issues the same collectives in the same order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class ReductionThread:
    def __init__(self, name: str = "clawcomm-buckets"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._done:
            self._submitted += 1
        self._jobs.put(job)

    def wait(self) -> None:
        """Blocks until every submitted job has run; raises the first error
        one of them raised (later jobs still ran, so ranks stay in step as
        far as this rank can keep them)."""
        with self._done:
            self._done.wait_for(lambda: self._finished == self._submitted)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self, timeout: float = 10.0) -> None:
        """Stops the thread once the jobs already submitted have run, and
        waits for it, at most ``timeout`` seconds. Called at the latest from
        atexit (DataParallel's weakref.finalize): the thread must be gone
        before the interpreter finalises, because a daemon thread that wakes
        then and frees a tensor is killed inside torch's deallocator, which
        aborts the process. The bound only matters when a job is stuck in a
        collective (the program was interrupted mid-backward): exit then goes
        on rather than wait for the group's timeout."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # handed to wait(), on the training thread
                with self._done:
                    self._error = self._error or e
            finally:
                # Drop the job (and the buckets it holds) here, while the
                # interpreter is surely alive, not at the next get().
                job = None
                with self._done:
                    self._finished += 1
                    self._done.notify_all()
