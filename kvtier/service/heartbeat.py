"""An engine's heartbeat to the node service: a daemon thread that calls ``beat()`` every :data:`HEARTBEAT_S`.

An engine's calls to the service ride on its requests (a lookup, an allocation). An idle engine makes
none, so without a beat it would neither notice that its service died nor attach to the restarted
one until a prompt happened to arrive -- the operator would see no engine on the new service for as
long as the node stays quiet. The beat is what the attachment does between requests: check the
connection for a hang-up, and attach (again) when it is time (:class:`~kvtier.service.backoff.AttachBackoff`),
each step within the lookup deadline. The thread never touches the engine's state but through
``beat``, which takes the attachment's own lock.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)

#: seconds between two beats (a crashed service is noticed, and a restarted one attached, within about this, plus the backoff)
HEARTBEAT_S = 1.0


class Heartbeat:
    """``beat()`` every ``period_s`` seconds on a daemon thread named ``name`` until :meth:`stop`. A beat that
    raises is logged (once per kind of error) and the beats go on: the heartbeat never ends an engine. A bound
    method is held weakly: an attachment dropped without being closed ends its beat, instead of the beat keeping
    it (its session, its thread) alive."""

    def __init__(self, beat: Callable[[], None], name: str, period_s: float = HEARTBEAT_S):
        self._beat = weakref.WeakMethod(beat) if inspect.ismethod(beat) else lambda: beat
        self.period_s = period_s
        self._stop = threading.Event()
        self._errors: set[str] = set()
        #: beats run (for tests and status)
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            beat = self._beat()
            if beat is None:  # (its attachment is gone)
                return
            try:
                beat()
            except Exception as e:  # (a bug in a beat must not end the engine; said once per kind)
                kind = type(e).__name__
                if kind not in self._errors:
                    self._errors.add(kind)
                    log.exception("kvtier: the node service heartbeat failed (%s); it goes on", kind)
            del beat  # (not held between beats)
            self.beats += 1

    def stop(self, timeout_s: float = 5.0) -> None:
        """No beat after this returns (unless the one running outlives ``timeout_s``: it is bounded by the lookup deadline)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
