"""Plans out, completions in: the core's side of its executor port.

Every plan the core makes gets an op id and a tag (what it is for,
:mod:`kvtier.core.tags`); its completion is applied by the handler registered
for the tag's type (``self._on``). Completions are applied in :meth:`poll`
(every public call of the core polls first), or where the core must know an
outcome at once (an eviction's copy, :meth:`_await`), in which case the other
completions that arrived meanwhile wait for the next poll.
"""

from __future__ import annotations

import itertools
import logging

from kvtier.core.plans import Completion, CutShort, Done, Failed, Reason
from kvtier.core.state import CoreState
from kvtier.core.tags import JobTag, PrefetchHandle
from kvtier.errors import ExecutorError, InvalidStateError
from kvtier.radix import NO_PAGE

log = logging.getLogger(__name__)

#: what a completion may be (anything else from a port is counted and ignored)
_COMPLETIONS = frozenset({Done, CutShort, Failed})
_TIMEOUT = Reason.TIMEOUT


class PlanDispatch(CoreState):
    """The plan/completion bookkeeping every core is built on (the layer above :class:`CoreState`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ops = itertools.count(1)
        #: plans in flight: op -> what for
        self._inflight: dict[int, JobTag | PrefetchHandle] = {}
        #: completions collected while waiting for one plan, applied at the next poll
        self._deferred: list[Completion] = []
        #: completion handlers, by the type of the plan's tag (filled by the core)
        self._on: dict[type, object] = {}
        #: the last op submitted (quarantined pages wait for every plan up to it)
        self._last_op = 0
        self._closed = False
        #: why the executor port is gone (see :meth:`_ask`), or None
        self._lost: str | None = None
        #: plans that timed out -> the host pages held until their late answer (see PageAllocator.hold)
        self._held_for: dict[int, list[int]] = {}
        #: what waits for plans to finish (a core's quarantined pages; changed in place): while it holds
        #: anything, :meth:`_completions_applied` runs after each batch of completions
        self._waiting_for_plans: list = []

    def _submit(self, plan_of, tag: JobTag | PrefetchHandle, *args) -> int:
        op = self._last_op = next(self._ops)
        self._inflight[op] = tag
        if self._lost is None:
            try:
                self.port.submit(plan_of(op, *args))
            except ExecutorError as e:  # recorded in flight: failed with the rest at the next call, which raises
                self._lost = str(e)
        return op

    def poll(self) -> int:
        """Apply the completions of finished plans. Returns how many were applied. Every public call of
        the core polls first, so on a closed cache every one of them is an :class:`InvalidStateError`.
        With no plan in flight, none held for a late answer and none deferred, nothing can complete:
        the port is not asked (a trip through the executor, a round trip for a pipe's)."""
        if self._closed:
            raise InvalidStateError("the cache is closed: begin, match, insert and the other calls need an open cache; build a new one")
        if self._lost is None:  # (the hot path, inlined: this runs on every call)
            if not self._inflight and not self._held_for and not self._deferred:
                return 0
            try:
                done = self.port.poll()
            except ExecutorError as e:
                self._lost = str(e)
            else:
                return self._apply_all(done)
        return self._apply_all(self._ask(self.port.poll))

    def _ask(self, call, *args):
        """A call to the port. A port that is gone (:class:`ExecutorError`: its worker died, broke its
        protocol or missed a deadline) loses every plan in flight: each completes Failed here (so
        locks and pages are released as for any failure) and is counted (``lost_plans``); this and
        every later call raise :class:`ExecutorError`."""
        if self._lost is None:
            try:
                return call(*args)
            except ExecutorError as e:
                self._lost = str(e)
        self._fail_lost()
        raise ExecutorError(f"the executor port is gone ({self._lost}); its plans in flight failed; build a new cache")

    def _fail_lost(self) -> None:
        while self._inflight:  # (a failure's handler may plan more: those fail too)
            done = [Failed(op, Reason.ERROR, f"executor lost: {self._lost}") for op in self._inflight]
            self.stats.lost_plans += len(done)
            for c in done:
                self._apply(c)
        self._deferred = []
        self._completions_applied()

    def _apply_all(self, done: list[Completion]) -> int:
        """Apply the completions deferred by :meth:`_await`, then ``done``; returns how many."""
        if self._deferred:
            done, self._deferred = self._deferred + done, []
        for c in done:
            self._apply(c)
        if done and self._waiting_for_plans:
            self._completions_applied()
        return len(done)

    def _completions_applied(self) -> None:
        """Completions were applied while something waits for plans to finish (``_waiting_for_plans``):
        :class:`~kvtier.core.cache_core.CacheCore` frees its quarantined pages here; nothing by default."""

    def _apply(self, c: Completion) -> None:
        kind = type(c)
        tag = self._inflight.pop(c.op, None) if kind in _COMPLETIONS else None
        if tag is None:
            self._unmatched(c)
            return
        if kind is not Done and c.reason is _TIMEOUT:
            # the plan may still run late: its host pages must not be handed out again until it answers
            held = [n.host_page for n in tag.nodes if n.host_page != NO_PAGE]
            self.host_alloc.hold(held)
            self._held_for[c.op] = held
            self.groups.hold_late(c.op, tag.nodes)
            self.stats.timed_out_plans += 1
        self._on[type(tag)](c, tag)

    def _unmatched(self, c: object) -> None:
        """A completion of no plan in flight: the late answer of one that timed out (its held pages go back
        now), or of a plan never made or answered twice (ignored and counted; the batch goes on)."""
        held = self._held_for.pop(c.op, None) if type(c) in _COMPLETIONS else None
        if held is not None:  # the late answer of a plan that timed out: nothing touches its host pages now
            self.host_alloc.release_hold(held)
            self.groups.released_late(c.op)
            return
        self.stats.unknown_completions += 1
        log.warning("ignored a completion for no plan in flight: %r", c)

    def wait_for(self, ops) -> int:
        """Block until the plans ``ops`` finished, then apply every completion collected."""
        ops = [op for op in ops if op in self._inflight or op in self._held_for]
        return self._apply_all(self._ask(self.port.wait, ops) if ops else self._ask(self.port.poll))

    def _await(self, op: int) -> Completion:
        """The completion of ``op``, waited for where the caller needs its outcome at once (eviction).
        Other completions that arrive meanwhile wait for the next poll: the caller is mid-decision."""
        mine = None
        others = []
        try:
            arrived = self.port.wait((op,)) if self._lost is None else []
        except ExecutorError as e:  # the caller is mid-decision: it gets a failure, the next public call raises
            self._lost = str(e)
            arrived = []
        if self._lost is not None:
            del self._inflight[op]
            self.stats.lost_plans += 1
            return Failed(op, Reason.ERROR, f"executor lost: {self._lost}")
        for c in self._deferred + arrived:
            if type(c) in (Done, CutShort, Failed) and c.op == op:
                mine = c
            else:
                others.append(c)
        self._deferred = others
        if mine is None:  # an executor that breaks its contract; the plan stays recorded in flight
            raise ExecutorError(f"the executor returned from waiting for plan {op} without its completion")
        del self._inflight[op]
        return mine

    @property
    def plans_in_flight(self) -> int:
        """How many plans' completions have not been applied yet."""
        return len(self._inflight)

    def in_flight(self, op: int) -> bool:
        """True until plan ``op``'s completion has been applied."""
        return op in self._inflight

    def _ops_for(self, *kinds: type) -> list[int]:
        return [op for op, tag in self._inflight.items() if type(tag) in kinds]

    @staticmethod
    def _applied_where_waited(_c, _tag) -> None:
        """Eviction copies and saves: the evicting call waited for them and applied them itself."""

    @staticmethod
    def _is_fault(c: Completion) -> bool:
        return type(c) is not Done and c.reason in (Reason.ERROR, Reason.CORRUPT)

    def wait_idle(self) -> None:
        """Wait for every plan in flight (device/host and L3) and apply its completion, including
        the plans those completions start (a finished backup's write-through save)."""
        self.poll()
        while self._inflight or self._held_for:  # (the given-up plans too: their late answers free what they hold)
            if not self.wait_for([*self._inflight, *self._held_for]) and not self._inflight:
                break  # the port has no answer for them (a rank that never reports): they stay held

    def close(self) -> None:
        """Finish every plan in flight, then close the executor port. Closing twice is a no-op."""
        if self._closed:
            return
        try:
            if self._lost is None:
                self.wait_idle()
        except ExecutorError:
            pass  # its plans failed and were counted; the port is closed below all the same
        finally:
            self._closed = True
            self.port.close()

    def __enter__(self) -> PlanDispatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
