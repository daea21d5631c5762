"""The policy core alone, driven by hypothesis: >= 10,000 steps over pool sizes and write policies.

No tensors, no threads. :class:`~support.stateful.ScriptedExecutor` holds every plan the core
sends out until the machine decides its fate -- done, failed, cut short at a
random page, skipped at submission -- and answers the core's waits and
settles with random (but consistent) outcomes. Requests share a few prefixes,
pools are tiny so every step evicts, L3 keys vanish at random. Misuse is mixed
in and must be a typed error that changes nothing.

After every step: the tree's invariants, no page owned twice, every
allocated page held by the tree or an open request, free + used = capacity
per tier. When no request is open and no plan in flight, the whole device and
the whole host must be evictable (the liveness invariant).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.engine_device import EngineDeviceCore
from kvtier.executors.chain import ChainedExecutor
from kvtier.core import CacheCore
from kvtier.errors import InvalidStateError, KVTierError, PageOwnershipError
from kvtier.radix import NO_PAGE
from kvtier.core import RequestState
from support.hybrid_models import PAGE
from support.pools import tiny_specs
from support.stateful import PREFIXES, ExecutorSide, ScriptedExecutor

STEPS = {"total": 0}


class CoreMachine(ExecutorSide):
    dev_pages = 6
    host_pages = 8
    write_policy = "write_through"
    on_device_evict = "backup"

    def __init__(self):
        super().__init__()
        self.rnd = random.Random(0)
        self.port = ScriptedExecutor(self.rnd)
        spec = tiny_specs(page_size=PAGE, num_layers=1)["mla"]
        self.core = CacheCore(spec, PageAllocator(self.dev_pages, "device pool"), PageAllocator(self.host_pages, "host pool"), self.port,
                              CacheConfig(write_policy=self.write_policy, on_device_evict=self.on_device_evict, write_through_threshold=2),
                              StorageConfig(url="memory://", write_policy="write_through", min_prefetch_pages=1))
        self.open: list = []

    # ---- requests ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.open) < 2)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), tail=st.integers(0, PAGE - 1), extra=st.integers(0, 3),
          prefetch=st.booleans(), policy=st.sampled_from(["best_effort", "timeout", "wait_complete"]))
    def begin(self, prefix, pages, tail, extra, prefetch, policy):
        toks = PREFIXES[prefix][: pages * PAGE] + [50_000 + extra] * tail
        req = self.core.begin(toks, prefetch=prefetch, prefetch_policy=policy)
        assert req.num_cached <= len(req.keys)
        self.open.append((req, toks))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 1), use=st.floats(0, 1))
    def commit(self, i, use):
        req, toks = self.open.pop(i % len(self.open))
        full, tail = len(req.keys), int(len(toks) % PAGE > 0)
        given = list(req.cached_pages)
        usable = int(use * req.num_cached)
        assert req.wait() == req.num_cached <= len(given)  # a failed load shrinks the prefix to its last good page
        if req.failed and usable > req.num_cached:
            # an engine that ignores the failure: refused, nothing changed, the request still open
            extra = req.alloc(full - usable + tail)
            if extra.ok:
                before = self._snapshot()
                with pytest.raises(PageOwnershipError, match="failed host->device load"):
                    req.commit(given[:usable] + extra.pages)
                assert self._snapshot() == before and req.state is RequestState.OPEN
                STEPS["refused"] = STEPS.get("refused", 0) + 1
            usable = req.num_cached
        usable = min(usable, req.num_cached)
        new = req.alloc(full - usable + tail)
        if not new.ok:
            req.abort()
            return
        req.commit(req.cached_pages[:usable] + new.pages)
        assert req.state is RequestState.COMMITTED

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 1))
    def abort(self, i):
        req, _ = self.open.pop(i % len(self.open))
        req.alloc(1)
        req.abort()

    # ---- the executor's side ---------------------------------------------------------------------

    @rule(n=st.integers(1, 8))
    def evict_device(self, n):
        self.core.evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n):
        self.core.evict_host(n)

    # ---- misuse: a typed error, nothing changed ---------------------------------------------------
    def _snapshot(self):
        c = self.core
        return (len(c.tree), c.dev_alloc.num_free, c.host_alloc.num_free, sorted(self.port.inflight),
                sorted((n.device_page, n.host_page, n.lock_ref) for n in c.tree.nodes.values()))

    @rule(which=st.sampled_from(["out of range", "negative", "duplicate", "foreign", "count", "unlock unlocked", "closed request"]),
          prefix=st.integers(0, len(PREFIXES) - 1))
    def misuse(self, which, prefix):
        before = self._snapshot()
        toks = PREFIXES[prefix][: 2 * PAGE]
        free = [p for p in range(self.dev_pages) if not self.core.dev_alloc.is_allocated(p)]
        bad = {"out of range": [self.dev_pages + 3, 0], "negative": [-1, 0], "duplicate": [1, 1],
               "foreign": free[:2] if len(free) >= 2 else [self.dev_pages, 0], "count": [0, 1, 2]}
        with pytest.raises(KVTierError):
            if which in bad:
                self.core.insert(toks, bad[which])
            elif which == "unlock unlocked":
                node = next((n for n in self.core.tree.nodes.values() if n.lock_ref == 0 and n.num_children == 0), None)
                if node is None:
                    raise InvalidStateError("no unlocked leaf to misuse")
                self.core.unlock(node)
            else:
                req = self.core.begin(toks, prefetch=False)
                req.abort()
                before = self._snapshot()
                req.commit([])
        assert self._snapshot() == before, f"{which}: the index changed"

    # ---- liveness: nothing open, nothing in flight => everything evictable -------------------------
    @precondition(lambda self: not self.open)
    @rule()
    def drain_then_evict_everything(self):
        core = self.core
        core.wait_idle()
        core.check_integrity(idle=True)
        core.evict_device(self.dev_pages)
        assert core.dev_alloc.num_used == 0, f"idle and unlocked, yet {core.dev_alloc.num_used} device pages could not be evicted"
        core.wait_idle()
        core.evict_host(self.host_pages)
        assert core.host_alloc.num_used == 0, f"idle and unlocked, yet {core.host_alloc.num_used} host pages could not be evicted"
        assert len(core.tree) == 0
        core.check_integrity(idle=True)

    @invariant()
    def accounting(self):
        STEPS["total"] += 1
        core = self.core
        mine = {p for req, _ in self.open for p in req._allocated}
        core.check_integrity(caller_device_pages=mine)
        dev_tree = sum(n.device_page != NO_PAGE for n in core.tree.nodes.values())
        host_tree = sum(n.host_page != NO_PAGE for n in core.tree.nodes.values())
        assert core.dev_alloc.num_free + dev_tree + len(mine) + len(core.quarantined_pages()) == self.dev_pages
        assert core.host_alloc.num_free + host_tree + len(core.host_alloc.parked) == self.host_pages
        if not self.open and not core._inflight:
            core.check_integrity(idle=True)

    def teardown(self):
        for req, _ in self.open:
            req.abort()
        STEPS["failed"] = STEPS.get("failed", 0) + self.core.stats.load_failed_pages
        self.core.close()


CONFIGS = [
    (4, 4, "write_through", "backup"),
    (6, 12, "write_back", "backup"),
    (8, 6, "write_through_selective", "backup"),
    (5, 9, "write_through", "drop"),
    (6, 7, "write_back", "drop"),
]


def test_core_state_machine_ten_thousand_steps():
    STEPS.update(total=0, refused=0, failed=0)
    for dev, host, wp, evict in CONFIGS:
        machine = type(f"Core_{dev}_{host}_{wp}_{evict}", (CoreMachine,),
                       {"dev_pages": dev, "host_pages": host, "write_policy": wp, "on_device_evict": evict})
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=40,
                stateful_step_count=80,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    assert STEPS["total"] >= 10_000, STEPS
    assert STEPS["failed"] > 0, STEPS  # failed loads were drawn (commits over them are refused where drawn; test_failed_loads always)


class EngineDeviceMachine(ExecutorSide):
    """The core in its engine-device form (vLLM owns the device blocks): offload (waited for, or planned with
    its write-through save behind it), load_into, plan_load (the fetch and the copy that follows it, never
    waited for), release -- through a ChainedExecutor in front of the scripted one, as a vLLM worker runs them."""

    host_pages = 6

    def __init__(self):
        super().__init__()
        self.rnd = random.Random(1)
        self.port = ScriptedExecutor(self.rnd)
        spec = tiny_specs(page_size=PAGE, num_layers=1)["mla"]
        self.core = EngineDeviceCore(
            spec,
            PageAllocator(self.host_pages, "host pool"),
            ChainedExecutor(self.port),
            CacheConfig(preallocate_nodes=False),
            StorageConfig(url="memory://", min_prefetch_pages=1),
        )
        self.loads: list = []

    def _keys(self, prefix, pages):
        return self.core.page_keys(PREFIXES[prefix][: pages * PAGE])

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), wait=st.booleans())
    def offload(self, prefix, pages, wait):
        r = self.core.offload(self._keys(prefix, pages), list(range(100, 100 + pages)), wait=wait)
        assert r.already_held + r.saved + r.no_space + r.failed == pages
        assert (r.copy_op is not None) == (not wait and r.saved > 0)

    @precondition(lambda self: len(self.loads) < 2)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6))
    def load(self, prefix, pages):
        ld = self.core.load_into(self._keys(prefix, pages), list(range(200, 200 + pages)))
        assert ld.loaded == ld.from_host + ld.from_storage <= pages
        self.loads.append(ld)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), first=st.integers(0, 3))
    def plan_load(self, prefix, pages, first):
        first = min(first, pages)
        ld = self.core.plan_load(self._keys(prefix, pages), list(range(300, 300 + pages)), first=first)
        assert ld.loaded == ld.from_host + ld.from_storage <= pages
        assert (ld.op is None) == (ld.loaded <= first)  # nothing to copy: released at once

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 1))
    def release(self, i):
        ld = self.loads.pop(i % len(self.loads))
        self.core.release(ld)
        self.core.release(ld)  # idempotent

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6))
    def lookup(self, prefix, pages):
        found = self.core.lookup(self._keys(prefix, pages))
        assert found.pages <= pages

    @rule(n=st.integers(1, 6))
    def evict_host(self, n):
        self.core.evict_host(n)

    @rule(pages=st.integers(1, 3))
    def misuse(self, pages):
        before = (len(self.core.tree), self.core.host_alloc.num_free, sorted(self.port.inflight))
        with pytest.raises(KVTierError):
            self.core.offload(self._keys(0, pages), list(range(pages + 1)))  # one block too many
        with pytest.raises(KVTierError):
            self.core.load_into(self._keys(0, pages), [])
        assert (len(self.core.tree), self.core.host_alloc.num_free, sorted(self.port.inflight)) == before

    @precondition(lambda self: not self.loads)
    @rule()
    def drain_then_evict_everything(self):
        core = self.core
        core.wait_idle()
        core.check_integrity(idle=True)
        core.evict_host(self.host_pages)
        assert core.host_alloc.num_used == 0 and len(core.tree) == 0, "idle and unlocked, yet host pages could not be evicted"

    @invariant()
    def accounting(self):
        STEPS["engine"] += 1
        core = self.core
        core.check_integrity()
        assert all(n.device_page == NO_PAGE for n in core.tree.nodes.values()), "the engine owns the device: kvtier holds none"
        assert core.host_alloc.num_free + sum(n.host_page != NO_PAGE for n in core.tree.nodes.values()) == self.host_pages
        if not self.loads and not core._inflight:
            core.check_integrity(idle=True)

    def teardown(self):
        for ld in self.loads:
            self.core.release(ld)
        self.core.close()


def test_engine_device_core_state_machine():
    STEPS["engine"] = 0
    for host in (3, 6, 10):
        machine = type(f"EngineDevice_{host}", (EngineDeviceMachine,), {"host_pages": host})
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=30,
                stateful_step_count=60,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    assert STEPS["engine"] >= 3_000, STEPS
