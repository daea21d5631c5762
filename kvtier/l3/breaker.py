"""The L3 circuit breaker: after a backend fault, treat the store as down, and find out off the
engine's thread when it is back.

A dead or stalled server then costs one deadline, not one per request::

    CLOSED --a call faults--> OPEN (back-off: cooldown_s x 2^(faults-1), capped at max_cooldown_s, +-20% jitter)
    OPEN --back-off elapsed--> PROBING: one probe call on a helper thread; callers still see "down"
    PROBING --probe ok--> CLOSED        PROBING --probe faults--> OPEN (the next, longer back-off)

While the breaker is not closed, :attr:`available` is False at once: lookups answer "absent" and
reads and writes fail without a call, so the thread that asks (the engine's) never waits on the
store. Without a probe (``probe=None``) the first call after the back-off is the probe, on the
caller's thread -- the back-off still doubles while the fault persists.

The back-off parameters have one home, :class:`~kvtier.config.StorageConfig` (``cooldown_s``,
``max_cooldown_s``); SGLang's extra config takes the same fields.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from kvtier.l3.base import BackendStats, map_storage_errors

_JITTER = 0.2


class CircuitBreaker:
    def __init__(self, stats: BackendStats, cooldown_s: float, max_cooldown_s: float, probe: Callable[[], object] | None = None):
        self.stats = stats
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max(max_cooldown_s, cooldown_s)
        self.probe = probe
        self._lock = threading.Lock()
        self._closed = True
        self._down_until = 0.0
        self._faults = 0  # consecutive: the back-off doubles with each
        self._probing = False
        self._rng = random.Random()
        #: times the breaker opened, and probes run (observability and tests)
        self.opened = 0
        self.probes = 0

    @property
    def available(self) -> bool:
        if self._closed:  # the hot path: one attribute read
            return True
        if time.monotonic() < self._down_until:
            return False
        if self.probe is None:
            return True  # the next call is the probe
        self._start_probe()
        return False

    @property
    def backoff_s(self) -> float:
        """The back-off the next fault opens the breaker for (without jitter)."""
        return min(self.max_cooldown_s, self.cooldown_s * 2 ** self._faults)

    def trip(self) -> None:
        """A fault (seen by :meth:`call`, a probe, or an exception the backend did not map): open the
        breaker for the next back-off."""
        with self._lock:
            wait = min(self.max_cooldown_s, self.cooldown_s * 2 ** self._faults) * self._rng.uniform(1 - _JITTER, 1 + _JITTER)
            self._faults = min(self._faults + 1, 64)
            self._down_until = time.monotonic() + wait
            self._closed = False
            self.opened += 1

    def _succeeded(self) -> None:
        if not self._closed:
            with self._lock:
                self._closed = True
                self._faults = 0

    def call(self, fn, *args):
        """Run a backend call; a fault it counts (``stats.errors``) opens the breaker."""
        errors = self.stats.errors
        result = fn(*args)
        if self.stats.errors != errors:
            self.trip()
        else:
            self._succeeded()
        return result

    def _start_probe(self) -> None:
        with self._lock:
            if self._probing or self._closed:
                return
            self._probing = True
        threading.Thread(target=self._probe_once, name="kvtier-l3-probe", daemon=True).start()

    def _probe_once(self) -> None:
        self.probes += 1
        try:
            errors = self.stats.errors
            try:
                self.probe()
                ok = self.stats.errors == errors
            except Exception:  # the probe's own deadline, a refused connection: still down
                ok = False
            if ok:
                self._succeeded()
            else:
                self.trip()
        finally:
            self._probing = False


def probe_store(backend, key: str) -> None:
    """The probe the tiers use: one ``exists`` of a key under the backend's whole-call deadline; a
    fault is counted in its stats (which is how the breaker sees it)."""
    with map_storage_errors(backend.stats, "probe", lambda _e: None):
        backend.exists([key])
