"""The policy core with a hybrid model's KV groups, driven by hypothesis: >= 10,000 steps.

Sliding windows smaller than a page, of a page and a half, and longer than any
prefix; state cadences 1, 2 and 3; windows and state together; tiny pools for
every group and tier, so every step evicts; two requests open at once, and
restarts (the cache closed with requests open and plans in flight, a new one
over the same L3). :class:`~support.stateful.BytesExecutor` keeps a label
per page and per group object in each tier and moves labels as plans say --
a plan that fails writes garbage into its destinations, a fetch cut short too, and
L3 saves, fetches, settles and lost keys are drawn -- so a request that is
offered a page or an object whose bytes are not its own fails the test, the
way wrong bytes would fail a model.

After every step: the tree's invariants, no page or object owned twice, every
allocated id held by the tree, an open request or the quarantine, free + used =
capacity per group and tier. When nothing is open or in flight, every page and
every object is evictable.

The same scenario with real bytes, through the in-process cache and its
transfer threads (slow copies that fail at random, a slow file L3):
:mod:`support.hybrid_soak` (issue 53, item 8).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import CacheCore, RequestState, Tier
from support.hybrid_models import PAGE, hybrid_model
from support.stateful import PREFIXES, BytesExecutor, ExecutorSide
from support.hybrid_rules import read_places, snapshot_places
from support.hybrid_soak import CoreSoak, Counts, Settings, soak_plan

STEPS = {"total": 0, "group_hits": 0, "l3_hits": 0, "limited": 0, "failed": 0, "shared_evicted": 0, "filled": 0, "restarts": 0}


class HybridMachine(ExecutorSide):
    window: int | None = 6
    state: bool = True
    state_every = 1
    dev_pages, host_pages = 6, 8
    group_pages = {"swa": (4, 6), "ssm": (3, 4)}  # (device, host) ids per group
    #: the window group's pages take the full pages' own ids (one budget per tier)
    share_window = False
    write_policy = "write_through"
    l3_policy = "write_through"
    #: the cache restarts now and then (a rule of its own: the other configurations' runs stay as they were)
    restarts = False

    def __init__(self):
        super().__init__()
        self.rnd = random.Random(0)
        self.open: list = []
        self._build({})

    def _build(self, store: dict) -> None:
        """A core (a fresh one on restart: empty pools) over an executor whose L3 is ``store``."""
        self.model, full = hybrid_model(self.window, self.state)
        device, host = PageAllocator(self.dev_pages, "device pool"), PageAllocator(self.host_pages, "host pool")
        pools = {g.name: (PageAllocator(self.group_pages[g.name][0], f"{g.name} device"), PageAllocator(self.group_pages[g.name][1],
                                                                                                       f"{g.name} host"))
                 for g in self.model.groups if g.kind != "full"}
        if self.share_window and "swa" in pools:
            pools["swa"] = (device, host)
        self.pool_of = {name: "" if pool[0] is device else name for name, pool in pools.items()}
        self.port = BytesExecutor(self.rnd, self.pool_of)
        self.port.store = store
        self.core = CacheCore(full, device, host, self.port,
                              CacheConfig(write_policy=self.write_policy, preallocate_nodes=False),
                              StorageConfig(url="memory://", write_policy=self.l3_policy, min_prefetch_pages=1), model=self.model,
                              group_pools=pools, state_every=self.state_every)

    # ---- the bytes a request is offered are its own ---------------------------------------------------
    def _check_offered(self, req) -> None:
        mem = self.port.mem
        for i, page in enumerate(req.cached_pages):
            assert mem.get((Tier.DEVICE, "", page)) == req.keys[i], f"cached page {i} holds another page's bytes"
        n = req.num_cached
        for c in self.core.components:
            given = req.groups[c.name]
            needed = read_places(c.group, n, PAGE)
            assert sorted(given) == needed, f"group {c.name}: offered {sorted(given)} for a prefix of {n} pages that reads {needed}"
            pool = self.pool_of[c.name]
            for i, gid in given.items():
                assert mem.get((Tier.DEVICE, pool, gid)) == (req.keys[i], c.name), f"group {c.name}: object {i} holds wrong bytes"
        if n and any(req.groups.values()):
            STEPS["group_hits"] += 1
            STEPS["l3_hits"] += bool(req.storage_hit)

    # ---- requests ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.open) < 2)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), tail=st.integers(0, PAGE - 1),
          policy=st.sampled_from(["best_effort", "timeout", "wait_complete"]))
    def begin(self, prefix, pages, tail, policy):
        toks = PREFIXES[prefix][: pages * PAGE] + [50_000] * tail
        req = self.core.begin(toks, prefetch_policy=policy)
        assert req.num_cached <= len(req.keys)
        self.open.append(req)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 1), use=st.floats(0, 1), keep=st.floats(0, 1), hand_back=st.booleans())
    def commit(self, i, use, keep, hand_back):
        req = self.open.pop(i % len(self.open))
        req.wait()
        self._check_offered(req)
        full = len(req.keys)
        usable = req.usable(int(use * req.num_cached))
        new = req.alloc(full - usable + 1)
        if not new.ok:
            req.abort()
            return
        mem = self.port.mem
        for j, page in enumerate(new.pages[: full - usable]):  # the engine computes pages usable.. into new pages
            mem[(Tier.DEVICE, "", page)] = req.keys[usable + j]
        groups = {}
        for c in self.core.components:
            ids: list[int | None] = [None] * full
            if hand_back:  # the objects it was given, at their places (the cache keeps its own)
                for place, gid in req.groups[c.name].items():
                    if place < usable:
                        ids[place] = gid
            if c.group.kind == "state":
                places = snapshot_places(usable, full, self.core.state_every)
            else:  # an engine keeps some of its window pages (at least the last window's)
                places = [p for p in range(usable, full) if p in read_places(c.group, full, PAGE) or self.rnd.random() < keep]
            got = req.alloc_group(c.name, len(places))
            for place, gid in zip(places, got):
                mem[(Tier.DEVICE, self.pool_of[c.name], gid)] = (req.keys[place], c.name)
                ids[place] = gid
            groups[c.name] = ids
        req.commit(req.cached_pages[:usable] + new.pages, groups)
        assert req.state is RequestState.COMMITTED

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 1))
    def abort(self, i):
        req = self.open.pop(i % len(self.open))
        for c in self.core.components:
            req.alloc_group(c.name, 1)
        req.abort()

    # ---- plans finish in any order, some fail (ExecutorSide); pools are squeezed ----------------------
    @rule(n=st.integers(1, 8))
    def evict_device(self, n):
        self.core.evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n):
        self.core.evict_host(n)

    @precondition(lambda self: not self.open)
    @rule()
    def drain_then_evict_everything(self):
        core = self.core
        core.wait_idle()
        core.check_integrity(idle=True)
        core.evict_device(self.dev_pages)
        core.wait_idle()
        core.evict_host(self.host_pages)
        assert core.dev_alloc.num_used == 0 and core.host_alloc.num_used == 0 and len(core.tree) == 0
        for c in core.components:
            for tier in (Tier.DEVICE, Tier.HOST):
                assert c.alloc[tier].num_used == 0, f"idle, yet {c.alloc[tier].num_used} {c.name} {tier.name} objects stayed"
        core.check_integrity(idle=True)

    @precondition(lambda self: self.restarts)
    @rule(now=st.integers(0, 15), end_them=st.booleans())
    def restart(self, now, end_them):
        """The engine and its cache restart with requests open (ended first, or not) and plans in flight
        (close lets them finish, in any way); the new cache starts with empty pools over the same L3."""
        if now != 5:  # (rarely: a cache that restarts often has little in it to serve)
            return
        if end_them:
            for req in self.open:
                req.abort()
        self.open = []
        self.teardown()
        STEPS["restarts"] += 1
        self._build(self.port.store)

    @invariant()
    def accounting(self):
        STEPS["total"] += 1
        core = self.core
        mine = {p for req in self.open for p in req._allocated}
        mine_groups = {c.name: {g for req in self.open for g in req._group_alloc.get(c.name, ())} for c in core.components}
        core.check_integrity(caller_device_pages=mine, caller_group_pages=mine_groups)
        for c in core.components:  # counted as loads complete, as the pages are: a group's objects among the pages loaded
            assert c.loaded <= core.stats.loaded_pages, f"{c.name}: {c.loaded} objects loaded beside {core.stats.loaded_pages} pages"
        quarantined = core.quarantined_group_pages()
        sharing = [c for c in core.components if c.sharing]
        if sharing:  # one pool per tier: its pages and the sharing groups' objects fill it
            objects = sum(len(c.at[Tier.DEVICE]) + len(mine_groups[c.name]) + len(quarantined.get(c.name, ())) for c in sharing)
            pages = sum(n.device_page >= 0 for n in core.tree.nodes.values()) + len(mine) + len(core.quarantined_pages())
            assert core.dev_alloc.num_free + pages + objects == self.dev_pages
            host_pages = sum(n.host_page >= 0 for n in core.tree.nodes.values())
            host_objects = sum(len(c.at[Tier.HOST]) for c in sharing)
            assert core.host_alloc.num_free + host_pages + host_objects + len(core.host_alloc.parked) == self.host_pages
        for c in core.components:
            if c.sharing:
                continue
            dev, host = c.alloc[Tier.DEVICE], c.alloc[Tier.HOST]
            assert dev.num_free + len(c.at[Tier.DEVICE]) + len(mine_groups[c.name]) + len(quarantined.get(c.name, ())) == dev.num_pages
            assert host.num_free + len(c.at[Tier.HOST]) + len(host.parked) == host.num_pages
        if not self.open and not core._inflight:
            core.check_integrity(idle=True)

    def teardown(self):
        for req in self.open:
            req.abort()
        STEPS["limited"] += sum(c.limited for c in self.core.components)
        STEPS["failed"] += self.core.stats.load_failed_pages
        STEPS["shared_evicted"] += sum(c.evicted for c in self.core.components if c.sharing)
        STEPS["filled"] += sum(c.filled for c in self.core.components)
        self.core.close()


CONFIGS = [  # window (tokens), state, cadence, device, host, write policy, group pools (device, host)
    (2, False, 1, 5, 8, "write_through", 4),      # a window shorter than a page
    (6, False, 1, 6, 8, "write_back", 4),         # a page and a half
    (40, False, 1, 6, 6, "write_through", 4),     # longer than any prefix: every page
    (None, True, 1, 6, 8, "write_through", 3),
    (None, True, 3, 5, 7, "write_back", 3),
    (6, True, 3, 6, 9, "write_through", 3),
    (6, True, 2, 6, 9, "write_through", 3),      # issue 53's: a window of 6 tokens with its own pools, a snapshot every 2, restarts
    (2, True, 1, 4, 6, "write_through_selective", 3),
    (6, True, 1, 10, 12, "write_through", 6),     # roomier pools: more prefixes survive to be hit
    (40, True, 3, 9, 12, "write_back", 6),
    (2, False, 1, 8, 11, "write_through", "shared"),     # window pages share the full pages' pools: one budget per tier
    (6, True, 3, 9, 12, "write_back", "shared"),
    (6, False, 1, 7, 9, "write_through_selective", "shared"),
    (40, True, 1, 12, 16, "write_through", "shared"),
]


#: examples per configuration and steps per example (a long run: KVTIER_SOAK_SEEDS examples of KVTIER_SOAK_STEPS)
EXAMPLES, STEP_COUNT = len(soak_plan(40, 70)[0]), soak_plan(40, 70)[1]


def test_hybrid_core_state_machine_ten_thousand_steps():
    STEPS.update(total=0, group_hits=0, l3_hits=0, limited=0, failed=0, shared_evicted=0, filled=0, restarts=0)
    for window, state, every, dev, host, wp, g in CONFIGS:
        shared = g == "shared"
        g = 4 if shared else g
        machine = type(f"Hybrid_{window}_{state}_{every}_{wp}_{dev}_{g}", (HybridMachine,),
                       {"window": window, "state": state, "state_every": every, "dev_pages": dev, "host_pages": host, "write_policy": wp,
                        "group_pages": {"swa": (g, g + 2), "ssm": (g, g + 1)}, "share_window": shared, "restarts": every == 2})
        run_state_machine_as_test(machine, settings=settings(max_examples=EXAMPLES, stateful_step_count=STEP_COUNT, derandomize=True,
                                                             deadline=None, database=None, suppress_health_check=list(HealthCheck)))
    assert STEPS["total"] >= 10_000, STEPS
    # the runs did what they are for: hits that read group objects (some through L3), prefixes a group cut
    # short, failed loads
    assert STEPS["group_hits"] > 100 and STEPS["l3_hits"] > 5 and STEPS["limited"] > 0 and STEPS["failed"] > 0, STEPS
    # window pages went first under the pressure of a shared pool, and loads brought them back beside pages
    # that had stayed on device
    assert STEPS["shared_evicted"] > 100 and STEPS["filled"] > 0, STEPS
    assert STEPS["restarts"] > 0, STEPS


def test_the_in_process_hybrid_cache_hands_an_engine_only_its_own_bytes(tmp_path):
    """Issue 53, item 8, with real bytes (support.hybrid_soak): the in-process cache (HierarchicalCache) of a
    window of 6 tokens with its own pools and a snapshot every page or two, a slow file L3 whose prefetches
    time out, host->device copies that are slow and fail at random leaving garbage, restarts with copies in
    flight, two requests open at once on one prefix; every byte a request is handed after ``wait()`` -- its
    pages, its window pages, the snapshot at its boundary -- is its own. A long run: KVTIER_SOAK_SEEDS=100
    KVTIER_SOAK_STEPS=1200."""
    seeds, steps = soak_plan(2, 300)
    total, failures = Counts(), []
    for seed in seeds:
        for every in (1, 2):
            root = tmp_path / f"{seed}-{every}"
            root.mkdir()
            try:
                total.add(CoreSoak(seed, root, Settings(every=every)).run(steps))
            except Exception as e:  # (every seed runs: a long run reports them all)
                failures.append(f"seed {seed}, every {every}: {type(e).__name__}: {e}")
    assert not failures, failures
    # the runs did what they are for: snapshots checked, prefixes a failed copy shrank, L3 hits, prefetches given up
    # on, two requests on one prefix, restarts with copies in flight
    assert total.snapshots_checked > 100 and total.shrunk_by_failure > 10 and total.storage_hits > 5, total
    assert total.given_up_prefetches > 5 and total.both_open_on_one_prefix > 50 and total.restarts_mid_copy > 0, total


def replay(machine: HybridMachine, steps: list[tuple[str, dict]]) -> None:
    """Run the rules a randomized run shrank a failure to, checking the accounting after each, as the state
    machine does (a rule whose precondition fails is skipped, as hypothesis skips it)."""
    for name, args in steps:
        if name == "drain_then_evict_everything" and machine.open:
            continue
        getattr(machine, name)(**args)
        machine.accounting()
    machine.teardown()


def test_a_fill_never_takes_over_a_page_another_load_is_still_bringing():
    """Found by a randomized run: a request's load back (a fill) brought a window page beside a device
    page whose own load was still in flight, and took that page over as its own; when the page's load
    failed, its run was no longer whole and dropping it broke the tree. A page being loaded gets its
    objects from its own load, or the prefix stops there."""
    machine = type("Regression", (HybridMachine,), {"window": 40, "state": True, "state_every": 3, "dev_pages": 9, "host_pages": 12,
                                                     "write_policy": "write_back", "group_pages": {"swa": (6, 8), "ssm": (6, 7)}})()
    steps = [
        ("begin", dict(pages=2, policy="timeout", prefix=2, tail=3)),
        ("commit", dict(hand_back=True, i=1, keep=9.004440768201147e-184, use=0.8345103583207552)),
        ("evict_device", dict(n=1)),
        ("begin", dict(pages=1, policy="wait_complete", prefix=1, tail=1)),
        ("begin", dict(pages=6, policy="wait_complete", prefix=2, tail=0)),
        ("evict_device", dict(n=7)),
        ("commit", dict(hand_back=False, i=0, keep=1.0, use=0.02921714610755522)),
        ("commit", dict(hand_back=False, i=0, keep=0.033269351514170216, use=1e-05)),
        ("begin", dict(pages=6, policy="best_effort", prefix=2, tail=1)),
        ("begin", dict(pages=1, policy="timeout", prefix=1, tail=3)),
        ("commit", dict(hand_back=True, i=0, keep=0.5017783923919853, use=0.005)),
        ("begin", dict(pages=1, policy="best_effort", prefix=2, tail=3)),
        ("evict_device", dict(n=7)),
        ("begin", dict(pages=6, policy="timeout", prefix=2, tail=3)),
        ("complete", dict(cut=1e-05, outcome="cut", pick=15348)),
        ("begin", dict(pages=5, policy="timeout", prefix=2, tail=1)),
        ("complete", dict(cut=0.3344324419142622, outcome="fail", pick=6)),
    ]
    replay(machine, steps)


def test_a_load_back_whose_device_prefix_fails_while_it_makes_room_loads_nothing():
    """Found by a randomized run (and as old as load_back): making room for a host run waits for plans
    in flight; when the load of the very device prefix the run follows failed meanwhile, its pages left
    the device, and the host run was then put on device below a page that was not. Such a load back
    now loads nothing; the request learns of the failure and shrinks."""
    machine = type("Regression", (HybridMachine,), {"window": 2, "state": False, "dev_pages": 5, "host_pages": 8,
                                                     "write_policy": "write_through", "group_pages": {"swa": (4, 6), "ssm": (4, 5)}})()
    steps = [
        ("begin", dict(pages=3, policy='wait_complete', prefix=0, tail=1)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=4, policy='wait_complete', prefix=2, tail=2)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=5, policy='best_effort', prefix=0, tail=2)),
        ("begin", dict(pages=5, policy='wait_complete', prefix=2, tail=1)),
        ("abort", dict(i=0)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=2, policy='timeout', prefix=0, tail=1)),
        ("begin", dict(pages=4, policy='best_effort', prefix=0, tail=0)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=3, policy='wait_complete', prefix=0, tail=2)),
        ("abort", dict(i=1)),
        ("commit", dict(hand_back=True, i=0, keep=0.2303225331024073, use=0.05)),
        ("begin", dict(pages=3, policy='wait_complete', prefix=1, tail=0)),
        ("begin", dict(pages=2, policy='timeout', prefix=1, tail=2)),
        ("commit", dict(hand_back=False, i=1, keep=0.05, use=0.6563220136352236)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=2, policy='timeout', prefix=0, tail=2)),
        ("begin", dict(pages=4, policy='timeout', prefix=0, tail=3)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=4, policy='wait_complete', prefix=1, tail=2)),
        ("abort", dict(i=1)),
        ("abort", dict(i=1)),
        ("begin", dict(pages=2, policy='wait_complete', prefix=0, tail=2)),
        ("commit", dict(hand_back=True, i=1, keep=0.013690600318122085, use=0.5)),
        ("begin", dict(pages=1, policy='wait_complete', prefix=0, tail=0)),
        ("commit", dict(hand_back=True, i=1, keep=0.3989816854998446, use=0.0)),
        ("begin", dict(pages=5, policy='wait_complete', prefix=1, tail=3)),
        ("begin", dict(pages=5, policy='wait_complete', prefix=2, tail=3)),
        ("abort", dict(i=0)),
        ("commit", dict(hand_back=False, i=0, keep=0.0, use=0.0)),
        ("begin", dict(pages=2, policy='timeout', prefix=0, tail=1)),
        ("begin", dict(pages=5, policy='timeout', prefix=0, tail=2)),
    ]
    replay(machine, steps)


def test_making_device_room_for_a_load_never_evicts_the_host_objects_it_reads():
    """Found by a randomized run of a shared pool: a load back's window pages got device ids by making
    room, which under write_back backed pages up to host and so evicted host window pages -- the very
    ones the load was about to read (a KeyError, or with the id reused, another page's bytes). The
    objects a load reads are held while it gets its ids."""
    machine = type("Regression", (HybridMachine,), {"window": 6, "state": True, "state_every": 3, "dev_pages": 9, "host_pages": 12,
                                                     "write_policy": "write_back", "share_window": True,
                                                     "group_pages": {"swa": (4, 6), "ssm": (4, 5)}})()
    steps = [
        ("begin", dict(pages=5, policy='best_effort', prefix=0, tail=3)),
        ("begin", dict(pages=3, policy='timeout', prefix=2, tail=0)),
        ("commit", dict(hand_back=True, i=0, keep=0.2595824832387726, use=0.8574775919051905)),
        ("abort", dict(i=0)),
        ("drain_then_evict_everything", dict()),
        ("begin", dict(pages=6, policy='timeout', prefix=2, tail=3)),
        ("begin", dict(pages=1, policy='best_effort', prefix=1, tail=0)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=4, policy='wait_complete', prefix=2, tail=0)),
        ("commit", dict(hand_back=False, i=1, keep=1.4535939162563155e-170, use=0.17186545266265266)),
        ("begin", dict(pages=5, policy='timeout', prefix=2, tail=1)),
        ("abort", dict(i=1)),
        ("commit", dict(hand_back=True, i=1, keep=0.9390385430914774, use=0.2843135851325463)),
        ("drain_then_evict_everything", dict()),
        ("begin", dict(pages=2, policy='best_effort', prefix=1, tail=0)),
        ("begin", dict(pages=1, policy='best_effort', prefix=2, tail=1)),
        ("abort", dict(i=1)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=1, policy='timeout', prefix=0, tail=1)),
        ("commit", dict(hand_back=True, i=1, keep=0.20829507558502264, use=0.9949353446057765)),
        ("begin", dict(pages=3, policy='timeout', prefix=2, tail=2)),
        ("abort", dict(i=1)),
        ("begin", dict(pages=5, policy='timeout', prefix=0, tail=0)),
        ("commit", dict(hand_back=False, i=0, keep=0.9070267515926695, use=0.6583690829317163)),
        ("drain_then_evict_everything", dict()),
        ("begin", dict(pages=5, policy='best_effort', prefix=1, tail=1)),
        ("begin", dict(pages=5, policy='best_effort', prefix=2, tail=3)),
        ("commit", dict(hand_back=True, i=0, keep=5.614263336256484e-167, use=0.8229834424799098)),
        ("abort", dict(i=0)),
        ("drain_then_evict_everything", dict()),
        ("begin", dict(pages=3, policy='timeout', prefix=0, tail=0)),
        ("abort", dict(i=1)),
        ("begin", dict(pages=2, policy='timeout', prefix=0, tail=3)),
        ("abort", dict(i=1)),
        ("begin", dict(pages=5, policy='timeout', prefix=2, tail=2)),
        ("abort", dict(i=1)),
        ("begin", dict(pages=5, policy='best_effort', prefix=1, tail=3)),
        ("abort", dict(i=1)),
        ("begin", dict(pages=2, policy='wait_complete', prefix=2, tail=1)),
        ("abort", dict(i=1)),
        ("drain_then_evict_everything", dict()),
        ("begin", dict(pages=6, policy='timeout', prefix=2, tail=1)),
        ("begin", dict(pages=6, policy='timeout', prefix=2, tail=0)),
        ("abort", dict(i=0)),
        ("begin", dict(pages=6, policy='wait_complete', prefix=1, tail=0)),
        ("abort", dict(i=0)),
        ("commit", dict(hand_back=True, i=1, keep=2.220446049250313e-16, use=0.5576892407691515)),
        ("begin", dict(pages=1, policy='wait_complete', prefix=1, tail=3)),
        ("evict_host", dict(n=7)),
        ("begin", dict(pages=6, policy='timeout', prefix=2, tail=3)),
    ]
    replay(machine, steps)


def test_one_groups_copy_to_host_never_decides_anothers_in_flight_on_the_same_page():
    """Issue 53, item 8 (found by the engine-device core's state machine; the policy core shares the rule):
    objects handed over for pages the cache has on host already are copied there in plans of their own,
    one per commit -- a snapshot's, then a window page's of the same page. The second one's completion
    decided the first's too: done, it made the snapshot readable while its copy was still in flight;
    failed, it freed the snapshot's host id under its copy. Here the window's copy lands and the
    snapshot's fails: a request loading that page back must not be handed the failed copy's garbage."""
    machine = HybridMachine()
    core, port, mem = machine.core, machine.port, machine.port.mem
    toks = PREFIXES[0][: 2 * PAGE]

    def commit(objects: dict[str, list[bool]]) -> None:
        """A request computes both pages (the cache offers none: no objects to continue from) and hands
        over the objects ``objects`` says it has."""
        req = core.begin(toks)
        assert req.num_cached == 0
        new = req.alloc(2)
        for i, page in enumerate(new.pages):
            mem[(Tier.DEVICE, "", page)] = req.keys[i]
        groups = {}
        for name, has in objects.items():
            got = iter(req.alloc_group(name, sum(has)))
            groups[name] = [next(got) if here else None for here in has]
            for i, gid in enumerate(groups[name]):
                if gid is not None:
                    mem[(Tier.DEVICE, name, gid)] = (req.keys[i], name)
        req.commit(new.pages, groups)

    def copying(group: str) -> int:
        return next(op for op, plan in port.inflight.items() if [g.group for g in plan.groups] == [group] and not plan.src_pages)

    commit({})  # the pages alone, backed up to host
    for op in sorted(port.inflight):
        port.finish(op, "done")
    core.poll()
    commit({"ssm": [False, True]})
    commit({"swa": [True, True]})
    snapshot, window = copying("ssm"), copying("swa")
    port.finish(window, "done")
    core.poll()
    port.finish(snapshot, "fail")
    core.poll()
    core.evict_device(machine.dev_pages)  # every page and object has a host copy (or none): off the device
    req = core.begin(toks)
    for op in sorted(port.inflight):
        port.finish(op, "done")
    req.wait()
    machine._check_offered(req)  # (before: the snapshot at boundary 2 held the failed copy's garbage)
    assert req.num_cached == 0, "boundary 2 has no snapshot, boundary 1 none either"
    req.abort()
    core.wait_idle()
    core.check_integrity(idle=True)
    core.close()
