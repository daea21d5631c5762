"""One worker thread over a queue of jobs: what the transfer engine and the L3 tier each run their jobs on.

Jobs run one at a time, in the order they were queued, on a daemon thread the
worker owns; ``None`` is never a job (it stops the thread). The thread that owns
the worker queues, waits and stops; only the worker's thread runs ``handle``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

J = TypeVar("J")


class JobWorker(Generic[J]):
    """``handle(job)`` for each job queued by :meth:`put`. ``maxsize``: a bound on queued jobs (0: none)."""

    def __init__(self, handle: Callable[[J], None], *, name: str, maxsize: int = 0):
        self._handle = handle
        self._queue: queue.Queue[J | None] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: J, *, timeout_s: float | None = None) -> None:
        """Queue ``job``; a full queue raises :class:`queue.Full`, at once or after ``timeout_s``."""
        if timeout_s is None:
            self._queue.put_nowait(job)
        else:
            self._queue.put(job, timeout=timeout_s)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._handle(job)
            finally:
                self._queue.task_done()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job has run (at most ``timeout_s``); True when idle."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def take_queued(self) -> list[J]:
        """The jobs queued and not started, taken off the queue (they will not run)."""
        out = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return out
            if job is not None:
                out.append(job)
            self._queue.task_done()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the thread once the jobs queued before this call have run (at most ``timeout_s``: a job
        stuck in ``handle`` keeps its daemon thread)."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
