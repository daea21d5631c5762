"""The policy core's executor port on vLLM's scheduler side: its executors are the workers.

Plans leave in the next step's connector metadata (:meth:`SchedulerPort.take_plans`);
completions come back in the workers' metadata (:meth:`SchedulerPort.deliver`),
and a plan's completion reaches the core only once every rank reported it,
joined (:func:`~kvtier.integrations.vllm.messages.join`). The scheduler never
waits for a worker: a core on this port plans loads and offloads that need no
answer to continue (``plan_load``, ``offload(wait=False)``), and a call that
would wait is an :class:`~kvtier.errors.ExecutorError`.

L3 lookups are the scheduler's own: :class:`StoreProbe` asks the store whether
every rank's object of each page is there (the leading run all ranks hold).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

from kvtier.core.plans import Completion, Failed, Reason, Transfer
from kvtier.errors import ExecutorError
from kvtier.integrations.vllm.messages import RankResult
from kvtier.l3.base import map_storage_errors
from kvtier.config import StorageConfig
from kvtier.l3.breaker import CircuitBreaker
from kvtier.l3.registry import open_backend

log = logging.getLogger(__name__)


class StoreProbe:
    """``exists`` over the L3 objects of every rank (one key prefix per rank; one for them all where every rank
    loads the same object: MLA's latent), from the scheduler."""

    def __init__(self, storage: StorageConfig, prefixes: Sequence[str]):
        self.backend = open_backend(storage.url)
        self.prefixes = list(dict.fromkeys(prefixes))
        self.breaker = CircuitBreaker(self.backend, storage.cooldown_s, storage.max_cooldown_s, probe_key=f"{self.prefixes[0]}/probe")

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        n = len(keys)
        for prefix in self.prefixes:
            if n == 0 or not self.breaker.available:
                return 0
            found = [0]

            def failed(_e: BaseException, found=found) -> None:
                found[0] = 0

            with map_storage_errors(self.backend.stats, "exists", failed):
                found[0] = self.breaker.call(self.backend.exists, [f"{prefix}/{k.hex()}" for k in keys[:n]]) or 0
            n = min(n, found[0])
        return n

    def close(self) -> None:
        self.backend.close()


class SchedulerPort:
    """``rank_timeout_s``: a plan not every rank reported within this long after it went out completes
    ``Failed(TIMEOUT)`` (a miss; the core holds its host pages until the late answer, see
    :meth:`PageAllocator.hold`). Each rank's report counts once (ranks are a set)."""

    def __init__(self, world_size: int, probe: StoreProbe | None, rank_timeout_s: float = 10.0, clock=time.monotonic):
        self.world_size = world_size
        self.probe = probe
        self.rank_timeout_s = rank_timeout_s
        self._clock = clock
        #: op -> when it went out to the workers (plans in flight only; insertion order is sending order)
        self._sent: dict[int, float] = {}
        #: plans that timed out -> the ranks that reported so far; the core gets their late answer once all did
        self._late: dict[int, RankResult | None] = {}
        #: plans failed for a missing rank's report
        self.timed_out_plans = 0
        self.has_storage = probe is not None
        self.can_wait = False
        self._outbox: list[Transfer] = []
        self._partial: dict[int, RankResult] = {}
        self._ready: list[Completion] = []
        #: plans handed to the workers whose completion has not come back from every rank
        self.in_flight: set[int] = set()
        self._ranks = frozenset(range(world_size))
        #: reports of a plan by a rank that had reported it already (ignored: each rank counts once)
        self.duplicate_reports = 0
        #: reports of plans not in flight, or from ranks outside the world (ignored)
        self.stray_reports = 0

    # ---- the vLLM side ----------------------------------------------------------------------
    def take_plans(self) -> list[Transfer]:
        plans, self._outbox = self._outbox, []
        self.in_flight.update(p.op for p in plans)
        now = self._clock()
        for p in plans:
            self._sent[p.op] = now
        return plans

    def deliver(self, results: dict[int, RankResult]) -> None:
        """One step's worker results (already aggregated over the ranks that ran this step)."""
        for op, r in results.items():
            if op in self._late and r.ranks <= self._ranks:  # a plan that timed out, answering late
                mine = self._late[op]
                r = r if mine is None else mine.merged(r)
                if len(r.ranks) >= self.world_size:
                    del self._late[op]
                    self._ready.append(r.completion)  # the core releases the host pages it held for it
                else:
                    self._late[op] = r
                continue
            if op not in self.in_flight or not r.ranks <= self._ranks:  # a plan not out (or answered), a rank that is not one
                self.stray_reports += 1
                log.warning("kvtier: ignored a worker report for plan %s from ranks %s (not in flight, or not a rank of %d)",
                            op, sorted(r.ranks), self.world_size)
                continue
            mine = self._partial.pop(op, None)
            if mine is not None:
                r = mine.merged(r)
            if r.duplicates:
                self.duplicate_reports += r.duplicates
                log.warning("kvtier: plan %s was reported twice by a rank; counted once", op)
                r = RankResult(r.completion, r.ranks)
            if len(r.ranks) >= self.world_size:
                self._ready.append(r.completion)
                self.in_flight.discard(op)
                self._sent.pop(op, None)
            else:
                self._partial[op] = r

    # ---- ExecutorPort --------------------------------------------------------------------------
    def submit(self, plan: Transfer) -> None:
        self._outbox.append(plan)

    def poll(self) -> list[Completion]:
        if self._sent:
            self._expire()
        out, self._ready = sorted(self._ready, key=lambda c: c.op), []
        return out

    def _expire(self) -> None:
        """Fail the plans some rank has not reported within ``rank_timeout_s``."""
        deadline = self._clock() - self.rank_timeout_s
        for op, sent in list(self._sent.items()):
            if sent > deadline:
                break  # sent in order: the rest are younger
            del self._sent[op]
            self.in_flight.discard(op)
            partial = self._partial.pop(op, None)
            missing = sorted(self._ranks - (partial.ranks if partial is not None else frozenset()))
            self._late[op] = partial
            self.timed_out_plans += 1
            log.warning("kvtier: plan %d: ranks %s did not report within %.1f s; it counts as failed", op, missing, self.rank_timeout_s)
            self._ready.append(Failed(op, Reason.TIMEOUT, f"ranks {missing} did not report within {self.rank_timeout_s:g} s"))

    def wait(self, ops: Collection[int]) -> list[Completion]:
        raise ExecutorError(f"the scheduler side cannot wait for plans {sorted(ops)[:4]}: its workers run them in the next "
                            "step; use the core's non-waiting calls (plan_load, offload(wait=False)) and write_through")

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        return 0  # the worker settles a fetch before the copy that follows it

    def wait_layer(self, op: int, layer: int) -> None:
        raise ExecutorError("wait_layer runs on the workers, which hold the bytes")

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        return self.probe.stored_prefix(keys) if self.probe is not None else 0

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
