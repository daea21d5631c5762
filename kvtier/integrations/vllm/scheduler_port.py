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
from collections.abc import Collection, Sequence

from kvtier.core.plans import Completion, Transfer
from kvtier.errors import ExecutorError
from kvtier.integrations.vllm.messages import RankResult
from kvtier.l3.base import map_storage_errors
from kvtier.config import StorageConfig
from kvtier.l3.breaker import CircuitBreaker, probe_store
from kvtier.l3.registry import open_backend

log = logging.getLogger(__name__)


class StoreProbe:
    """``exists`` over the L3 objects of every rank (one key prefix per rank), from the scheduler."""

    def __init__(self, storage: StorageConfig, prefixes: Sequence[str]):
        self.backend = open_backend(storage.url)
        self.prefixes = list(prefixes)
        self.breaker = CircuitBreaker(self.backend.stats, storage.cooldown_s, storage.max_cooldown_s,
                                      probe=lambda: probe_store(self.backend, f"{self.prefixes[0]}/probe"))

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        n = len(keys)
        for prefix in self.prefixes:
            if n == 0 or not self.breaker.available:
                return 0
            found = [0]

            def failed(_e: BaseException) -> None:
                found[0] = 0

            with map_storage_errors(self.backend.stats, "exists", failed):
                found[0] = self.breaker.call(self.backend.exists, [f"{prefix}/{k.hex()}" for k in keys[:n]])
            n = min(n, found[0])
        return n

    def close(self) -> None:
        self.backend.close()


class SchedulerPort:
    def __init__(self, world_size: int, probe: StoreProbe | None):
        self.world_size = world_size
        self.probe = probe
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
        return plans

    def deliver(self, results: dict[int, RankResult]) -> None:
        """One step's worker results (already aggregated over the ranks that ran this step)."""
        for op, r in results.items():
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
            else:
                self._partial[op] = r

    # ---- ExecutorPort --------------------------------------------------------------------------
    def submit(self, plan: Transfer) -> None:
        self._outbox.append(plan)

    def poll(self) -> list[Completion]:
        out, self._ready = sorted(self._ready, key=lambda c: c.op), []
        return out

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
