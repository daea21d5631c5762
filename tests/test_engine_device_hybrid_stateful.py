"""The engine-device core with hybrid models as a state machine: engines (vLLM) copy pages and their
window pages and snapshots out of their own blocks, look them up and load them back -- planned, behind
the fetch that fills their host pages, as a scheduler with workers elsewhere does; two at once on one
prefix; or waiting for the fetch under the timeout policy -- while plans finish in any order, fail or
are cut short, the store forgets keys, host memory is squeezed and the cache restarts with plans in
flight (a new one over the same L3).

Bytes are labels (:class:`~support.stateful.BytesExecutor`): every load that completes must
have written each engine id it names with the label of the page (or object) it claims, and only the
objects its boundary reads; after every step the host accounting of every group adds up, and when
idle everything is evictable. The same with real bytes, through the in-process executor and its
transfer threads (slow copies that fail at random, a slow file L3): :mod:`support.hybrid_soak`
(issue 53, item 8)."""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import Tier
from kvtier.core.engine_device import EngineDeviceCore
from kvtier.core.plans import Done
from kvtier.executors.chain import ChainedExecutor
from support.hybrid_models import PAGE, hybrid_model
from support.stateful import PREFIXES, BytesExecutor, ExecutorSide
from support.hybrid_rules import read_places, snapshot_places
from support.hybrid_soak import Counts, EngineSettings, EngineSoak, soak_plan

STEPS = {"total": 0, "checked_loads": 0, "group_objects_checked": 0, "limited": 0, "restarts": 0}


class EngineHybridMachine(ExecutorSide):
    window: int | None = 6
    state: bool = True
    state_every = 1
    host_pages = 8
    group_host = {"swa": 6, "ssm": 4}
    #: how a blocking load (load_into) waits for its L3 fetch: the timeout policy gives up on what is late
    prefetch_policy = "timeout"

    def __init__(self):
        super().__init__()
        self.rnd = random.Random(0)
        #: engine ids are never reused (vLLM keeps a block until kvtier's copies out of them are done)
        self.ids = itertools.count(1000)
        #: planned loads not yet checked: (load, keys, engine pages, groups, first)
        self.loads: list = []
        self._build({})

    def _build(self, store: dict) -> None:
        """A core (a fresh one on restart) over an executor whose L3 is ``store``: what survives a restart."""
        self.port = BytesExecutor(self.rnd)
        self.port.store = store
        self.model, full = hybrid_model(self.window, self.state)
        hosts = {g.name: PageAllocator(self.group_host[g.name], f"{g.name} host") for g in self.model.groups if g.kind != "full"}
        self.core = EngineDeviceCore(full, PageAllocator(self.host_pages, "host pool"), ChainedExecutor(self.port),
                                     CacheConfig(preallocate_nodes=False),
                                     StorageConfig(url="memory://", min_prefetch_pages=1, prefetch_policy=self.prefetch_policy),
                                     model=self.model, group_hosts=hosts, state_every=self.state_every)

    def _keys(self, prefix, pages):
        return self.core.page_keys(PREFIXES[prefix][: pages * PAGE])

    # ---- an engine computed a prompt and hands its pages and objects out -------------------------------
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), kept=st.integers(0, 6), wait=st.booleans())
    def offload(self, prefix, pages, kept, wait):
        keys = self._keys(prefix, pages)
        mem = self.port.mem
        blocks = [next(self.ids) for _ in keys]
        for k, b in zip(keys, blocks):
            mem[(Tier.DEVICE, "", b)] = k
        groups = {}
        for c in self.core.components:
            if c.group.kind == "state":  # snapshots at the cadence and at the last page
                places = snapshot_places(0, pages, self.core.state_every)
            else:  # the engine still holds its last ``kept`` window blocks (vLLM freed the ones before)
                places = list(range(max(0, pages - kept), pages))
            ids: list[int | None] = [None] * pages
            for p in places:
                ids[p] = next(self.ids)
                mem[(Tier.DEVICE, c.name, ids[p])] = (keys[p], c.name)
            groups[c.name] = ids
        r = self.core.offload(keys, blocks, wait=wait, groups=groups)
        assert r.already_held + r.saved + r.no_space + r.failed == pages

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6))
    def lookup(self, prefix, pages):
        found = self.core.lookup(self._keys(prefix, pages))
        assert found.pages <= pages
        STEPS["limited"] += found.limited_by is not None

    # ---- an engine loads a prefix into new blocks (some ids it does not give) ---------------------------
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), first=st.integers(0, 3), gaps=st.floats(0, 0.3))
    def plan_load(self, prefix, pages, first, gaps):
        keys = self._keys(prefix, pages)
        first = min(first, pages)
        dst = [next(self.ids) for _ in keys]
        groups = {c.name: [next(self.ids) if i >= first and self.rnd.random() >= gaps else None for i in range(pages)]
                  for c in self.core.components}
        for ids in groups.values():  # (the engine's own objects before ``first``: not kvtier's to write)
            for i in range(first):
                ids[i] = next(self.ids)
        ld = self.core.plan_load(keys, dst, first=first, groups=groups)
        assert ld.loaded == ld.from_host + ld.from_storage <= pages
        assert (ld.op is None) == (ld.loaded <= first)
        if ld.op is not None:
            self.loads.append((ld, keys, dst, groups, first))

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), first=st.integers(0, 2))
    def compute_then_load(self, prefix, pages, first):
        """The common path, whole: a prompt goes out, everything in flight lands, another engine loads it."""
        self.offload(prefix, pages, kept=6, wait=False)
        for op in sorted(self.port.inflight):
            self.port.finish(op, "done")
        self.core.poll()
        self.plan_load(prefix, pages, first, gaps=0.0)
        for op in sorted(self.port.inflight):
            self.port.finish(op, "done")
        self.core.poll()

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), shorter=st.integers(1, 6), first=st.integers(0, 2),
          gaps=st.floats(0, 0.3))
    def two_loads_on_one_prefix(self, prefix, pages, shorter, first, gaps):
        """Two requests open at once on one prefix: both loads planned before either completes (their
        fetches and copies then finish, fail or are cut short in any order, ExecutorSide)."""
        self.plan_load(prefix, pages, first, gaps)
        self.plan_load(prefix, min(shorter, pages), 0, gaps)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), gaps=st.floats(0, 0.3))
    def load_into(self, prefix, pages, gaps):
        """A load that waits for its fetch as the prefetch policy says (timeout: what is late is given up
        on and lands later), then for its copy."""
        keys = self._keys(prefix, pages)
        dst = [next(self.ids) for _ in keys]
        groups = {c.name: [next(self.ids) if self.rnd.random() >= gaps else None for _ in keys] for c in self.core.components}
        ld = self.core.load_into(keys, dst, groups=groups)
        self.core.release(ld)
        assert ld.op is None or ld.outcome is not None
        if ld.op is not None:
            self.loads.append((ld, keys, dst, groups, 0))

    @rule(now=st.integers(0, 15))
    def restart(self, now):
        """The engine and its cache restart, copies and fetches in flight (close lets them finish, in any
        way); the new cache starts with empty pools over the same L3."""
        if now != 5:  # (rarely: a cache that restarts often has little in it to serve)
            return
        self.core.close()
        STEPS["restarts"] += 1
        self.accounting_of_loads()
        self._build(self.port.store)

    def _check_load(self, ld, keys, dst, groups, first) -> None:
        """A completed load wrote pages first..loaded and exactly the objects its boundary reads."""
        mem, d = self.port.mem, ld.loaded
        for i in range(first, d):
            assert mem.get((Tier.DEVICE, "", dst[i])) == keys[i], f"engine page {i} holds another page's bytes"
        for c in self.core.components:
            needed = set(read_places(c.group, d, PAGE))
            for i, gid in enumerate(groups[c.name]):
                if gid is None or i < first:
                    continue
                got = mem.get((Tier.DEVICE, c.name, gid))
                if i in needed:
                    assert got == (keys[i], c.name), f"group {c.name}: engine object {i} holds wrong bytes: {got!r}"
                    STEPS["group_objects_checked"] += 1
                else:
                    assert got is None, f"group {c.name}: object {i} was written, and boundary {d} does not read it"
        STEPS["checked_loads"] += 1

    # ---- plans finish in any order, some fail, the store forgets (ExecutorSide); host is squeezed --------
    @rule(n=st.integers(1, 3))
    def evict_host(self, n):
        self.core.evict_host(n)

    @rule(now=st.integers(0, 7))
    def drain_then_evict_everything(self, now):
        if now:  # (one draw in eight: a cache that is always emptied serves no loads to check)
            return
        core = self.core
        core.wait_idle()
        core.check_integrity(idle=True)
        core.evict_host(self.host_pages)
        assert core.host_alloc.num_used == 0 and len(core.tree) == 0
        for c in core.components:
            assert c.alloc[Tier.HOST].num_used == 0, f"idle, yet {c.alloc[Tier.HOST].num_used} {c.name} host objects stayed"

    @invariant()
    def accounting(self):
        STEPS["total"] += 1
        core = self.core
        core.check_integrity()
        for c in core.components:
            host = c.alloc[Tier.HOST]
            assert host.num_free + len(c.at[Tier.HOST]) + len(host.parked) == host.num_pages
            # counted as copies complete, as the pages are: a group's objects among the pages loaded
            assert c.loaded <= core.stats.loaded_pages, f"{c.name}: {c.loaded} objects loaded beside {core.stats.loaded_pages} pages"
        self.accounting_of_loads()
        if not core._inflight:
            core.check_integrity(idle=True)

    def accounting_of_loads(self) -> None:
        """Every load that completed Done wrote exactly what its boundary reads (state snapshots included)."""
        left = []
        for entry in self.loads:
            ld = entry[0]
            if ld.outcome is None:
                left.append(entry)
            elif type(ld.outcome) is Done:
                self._check_load(*entry)
        self.loads = left

    def teardown(self):
        self.core.close()


CONFIGS = [  # window (tokens), state, cadence, host pages, group host objects
    (6, True, 1, 8, 4),
    (6, True, 2, 8, 4),      # issue 53's geometry: a window of 6 tokens with its own pool, a snapshot every 2 pages
    (2, False, 1, 6, 3),     # a window shorter than a page
    (40, True, 3, 8, 6),     # longer than any prefix: every page
    (None, True, 2, 7, 3),
    (6, True, 1, 12, 8),     # roomier: more prefixes survive to be loaded
    (None, False, 1, 6, 3),  # full attention only: the same byte checks on the plain engine-device core
]


#: examples per configuration and steps per example (a long run: KVTIER_SOAK_SEEDS examples of KVTIER_SOAK_STEPS)
EXAMPLES, STEP_COUNT = len(soak_plan(30, 60)[0]), soak_plan(30, 60)[1]


def test_engine_device_hybrid_state_machine():
    STEPS.update(total=0, checked_loads=0, group_objects_checked=0, limited=0, restarts=0)
    for window, state, every, host, g in CONFIGS:
        machine = type(f"EngineHybrid_{window}_{state}_{every}_{host}", (EngineHybridMachine,),
                       {"window": window, "state": state, "state_every": every, "host_pages": host,
                        "group_host": {"swa": g, "ssm": g}})
        run_state_machine_as_test(machine, settings=settings(max_examples=EXAMPLES, stateful_step_count=STEP_COUNT, derandomize=True,
                                                             deadline=None, database=None, suppress_health_check=list(HealthCheck)))
    assert STEPS["total"] >= 5_000, STEPS
    # the runs did what they are for: completed loads checked byte for byte, objects among them, prefixes a group cut short
    assert STEPS["checked_loads"] > 100 and STEPS["group_objects_checked"] > 100 and STEPS["limited"] > 0, STEPS
    assert STEPS["restarts"] > 10, STEPS


def test_the_in_process_engine_device_core_writes_an_engine_only_its_own_bytes(tmp_path):
    """Issue 53, item 8, with real bytes (support.hybrid_soak): the engine-device core over the in-process
    executor (copies into the engine's blocks follow their L3 fetch), a window of 6 tokens with its own host
    pool and a snapshot every page or two, a slow file L3 whose prefetches time out, host->device copies
    that are slow and fail at random leaving garbage, restarts with copies in flight, two loads planned at
    once on one prefix; every load that completes Done wrote each block and object its boundary reads
    (the snapshot included) with its own bytes, and nothing else. A long run: KVTIER_SOAK_SEEDS=100
    KVTIER_SOAK_STEPS=1200."""
    seeds, steps = soak_plan(2, 300)
    total, failures = Counts(), []
    for seed in seeds:
        for every in (1, 2):
            root = tmp_path / f"{seed}-{every}"
            root.mkdir()
            try:
                total.add(EngineSoak(seed, root, EngineSettings(every=every)).run(steps))
            except Exception as e:  # (every seed runs: a long run reports them all)
                failures.append(f"seed {seed}, every {every}: {type(e).__name__}: {e}")
    assert not failures, failures
    # the runs did what they are for: snapshots checked in completed loads, L3 hits, failed copies, two loads
    # on one prefix, restarts with copies in flight
    assert total.snapshots_checked > 100 and total.storage_hits > 5 and total.transfer_failures > 10, total
    assert total.both_open_on_one_prefix > 50 and total.restarts_mid_copy > 0, total


def test_one_groups_copy_to_host_never_decides_anothers_in_flight_on_the_same_page():
    """Found by this file's state machine (issue 53, item 8: an engine handed a snapshot that was a failed
    copy's garbage). Copies out of the engine of objects alone -- beside pages the cache holds without
    them -- are plans of their own, one per offload: a state snapshot's, then a window page's of the same
    page. The second one's completion decided the first's too: done, it made the snapshot readable while
    its copy was still in flight (a load copied what was there); failed, it freed the snapshot's host id
    under its copy. Here the window's copy lands, the snapshot's fails: its garbage must not be loaded."""
    machine = type("Regression", (EngineHybridMachine,), {"window": 6, "state": True, "state_every": 1, "host_pages": 8,
                                                          "group_host": {"swa": 4, "ssm": 4}})()
    core, port, mem = machine.core, machine.port, machine.port.mem
    keys = machine._keys(0, 2)
    ids = itertools.count(100)

    def engine_has(pages: list[int | None], group: str) -> list[int | None]:
        out = []
        for i, here in enumerate(pages):
            out.append(None if here is None else next(ids))
            if here is not None:
                mem[(Tier.DEVICE, group, out[-1])] = (keys[i], group)
        return out

    blocks = [next(ids) for _ in keys]
    for k, b in zip(keys, blocks):
        mem[(Tier.DEVICE, "", b)] = k
    r = core.offload(keys, blocks, wait=False)  # the pages alone
    port.finish(r.copy_op, "done")
    core.poll()
    assert r.saved == 2 and core.lookup(keys).host_pages == 0  # (no window, no snapshot: nothing to continue from)
    snapshot = core.offload(keys, blocks, wait=False, groups={"swa": [None, None], "ssm": engine_has([None, 1], "ssm")})
    window = core.offload(keys, blocks, wait=False, groups={"swa": engine_has([1, 1], "swa"), "ssm": [None, None]})
    assert snapshot.objects_op and window.objects_op
    port.finish(window.objects_op, "done")
    core.poll()
    assert core.lookup(keys).host_pages == 0, "the snapshot's copy is still in flight: boundary 2 is not readable yet"
    port.finish(snapshot.objects_op, "fail")
    core.poll()
    assert core.lookup(keys).host_pages == 0, "the snapshot's copy failed: boundary 2 has none"
    dst = [next(ids) for _ in keys]
    want = {"swa": [next(ids), next(ids)], "ssm": [next(ids), next(ids)]}
    load = core.plan_load(keys, dst, groups=want)
    if load.op is not None:
        port.finish(load.op, "done")
        core.poll()
    got = mem.get((Tier.DEVICE, "ssm", want["ssm"][1]))
    assert got is None, f"the engine was handed a snapshot whose bytes are {got!r}"
    core.wait_idle()
    core.check_integrity(idle=True)
    core.close()
