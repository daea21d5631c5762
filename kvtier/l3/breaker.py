"""The L3 circuit breaker: after a backend fault, treat the store as down for a while.

A dead server then costs one timeout, not one per request: while the breaker
is open, lookups answer "absent" and reads and writes fail at once, without a
call. After ``cooldown_s`` the next call tries the store again.
"""

from __future__ import annotations

import time

from kvtier.l3.base import BackendStats


class CircuitBreaker:
    def __init__(self, stats: BackendStats, cooldown_s: float = 0.5):
        self.stats = stats
        self.cooldown_s = cooldown_s
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def trip(self) -> None:
        """A fault seen outside :meth:`call` (an exception the backend did not map): open the breaker."""
        self._down_until = time.monotonic() + self.cooldown_s

    def call(self, fn, *args):
        """Run a backend call; a fault it counts (``stats.errors``) opens the breaker for ``cooldown_s``."""
        errors = self.stats.errors
        result = fn(*args)
        if self.stats.errors != errors:
            self.trip()
        return result
