"""When an engine that lost the node service tries to attach again: one schedule for every client.

The first attempt is due :data:`RETRY_FIRST_S` after the loss; each failed attempt doubles the wait
up to :data:`RETRY_MAX_S`. A wait counts from the attempt's end, so an attempt that waited out its
whole deadline (a stalled service) is not due again at once. Attempts run on the engine's own calls
(a lookup, an allocation): nothing here sleeps or starts a thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: seconds before the first attempt to attach again after the service was lost; doubled per failed attempt
RETRY_FIRST_S = 0.1
#: the longest wait between two attempts
RETRY_MAX_S = 2.0


@dataclass
class AttachBackoff:
    """The reattach schedule of one attachment (an engine's host tier, one of SGLang's threads)."""

    due_at: float = 0.0
    wait_s: float = RETRY_FIRST_S

    def lost(self) -> None:
        """The service was just lost: the first attempt is due after :data:`RETRY_FIRST_S`."""
        self.due_at, self.wait_s = time.monotonic() + RETRY_FIRST_S, RETRY_FIRST_S

    def due(self) -> bool:
        return time.monotonic() >= self.due_at

    def failed(self, *, longest: bool = False) -> None:
        """An attempt failed (just now): the next is due after the current wait, which doubles; ``longest``:
        the service answered but cannot be used as it is, so wait the longest from here on."""
        if longest:
            self.wait_s = RETRY_MAX_S
        self.due_at = time.monotonic() + self.wait_s
        self.wait_s = min(2 * self.wait_s, RETRY_MAX_S)

    def attached(self) -> None:
        self.wait_s = RETRY_FIRST_S
