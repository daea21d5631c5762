"""The policy core's whole view of the bytes: submit a plan, collect completions.

Every method is called from the one thread that owns the core. Completions
come back exactly once each, from :meth:`poll` or :meth:`wait`, in any order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from kvtier.core.plans import Completion, Transfer


class ExecutorPort(Protocol):
    #: True when plans may name the storage tier
    has_storage: bool
    #: False: completions only come back later (a scheduler whose workers run the
    #: plans next step), so the core never waits on this port: it plans what needs no answer, and a
    #: host pool full of pages still being saved gives fewer pages now instead of waiting for them
    can_wait: bool

    def submit(self, plan: Transfer) -> None:
        """Start ``plan``; never blocks on the bytes. A plan that cannot start completes as
        :class:`~kvtier.core.plans.Failed` (``Reason.SKIPPED``) at the next poll."""

    def poll(self) -> list[Completion]:
        """Completions of plans that finished since the last poll or wait (non-blocking)."""

    def wait(self, ops: Collection[int]) -> list[Completion]:
        """Block until every plan in ``ops`` finished; returns every completion not yet reported."""

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        """A storage fetch in flight: wait as the prefetch ``policy`` says (``wait_complete``,
        ``timeout`` up to ``budget_s``, ``best_effort``), cancel what is left, and return
        how many leading pages have arrived so far. Its completion still comes from poll."""

    def wait_layer(self, op: int, layer: int) -> None:
        """A host->device plan: block until layer ``layer`` of its pages is in place
        (CUDA: the current stream waits on it). Returns at once for a finished plan."""

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the storage tier holds (0 without one, or when it is down)."""

    def close(self) -> None:
        """Finish what was submitted and release the executor's resources."""
