"""The policy core with a hybrid model's KV groups, driven by hypothesis: >= 10,000 steps.

Sliding windows smaller than a page, of a page and a half, and longer than any
prefix; state cadences 1 and 3; windows and state together; tiny pools for
every group and tier, so every step evicts. :class:`BytesExecutor` keeps a label
per page and per group object in each tier and moves labels as plans say --
a plan that fails writes garbage into its destinations -- so a request that is
offered a page or an object whose bytes are not its own fails the test, the
way wrong bytes would fail a model.

After every step: the tree's invariants, no page or object owned twice, every
allocated id held by the tree, an open request or the quarantine, free + used =
capacity per group and tier. When nothing is open or in flight, every page and
every object is evictable.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig
from kvtier.core import CacheCore, Done, Failed, Reason, RequestState, Tier, Transfer
from kvtier.core.hybrid_match import window_pages
from kvtier.groups import KVGroup, ModelSpec, StateTensor
from conftest import tiny_specs

PAGE = 4
PREFIXES = [list(range(1000 * p, 1000 * p + 6 * PAGE)) for p in range(3)]
STEPS = {"total": 0, "group_hits": 0, "limited": 0, "failed": 0}


def hybrid_model(window: int | None, state: bool) -> tuple[ModelSpec, object]:
    full = tiny_specs(page_size=PAGE, num_layers=1)["mla"]
    groups = [KVGroup("full", "full", (0,), attention=full)]
    if window is not None:
        groups.append(KVGroup("swa", "sliding_window", (len(groups),), attention=full, window=window))
    if state:
        groups.append(KVGroup("ssm", "state", (len(groups),), state=(StateTensor("h", (8,), "float32"),)))
    return ModelSpec("hybrid-test", len(groups), tuple(groups)), full


class BytesExecutor:
    """Plans wait until the machine completes them; labels move as they say (no storage)."""

    has_storage = False
    can_wait = True

    def __init__(self, rnd: random.Random):
        self.rnd = rnd
        self.inflight: dict[int, Transfer] = {}
        self.done: list = []
        #: (tier, group ("" for the tree's pages), id) -> label
        self.mem: dict[tuple[Tier, str, int], object] = {}

    def submit(self, plan: Transfer) -> None:
        self.inflight[plan.op] = plan

    def finish(self, op: int, outcome: str) -> None:
        plan = self.inflight.pop(op)
        mem = self.mem
        runs = [("", plan.src_pages, plan.dst_pages)] + [(g.group, g.src_pages, g.dst_pages) for g in plan.groups]
        for group, src, dst in runs:
            for s, d in zip(src, dst):
                mem[(plan.dst, group, d)] = mem.get((plan.src, group, s)) if outcome == "done" else ("garbage", op)
        self.done.append(Done(op) if outcome == "done" else Failed(op, Reason.ERROR))

    def poll(self):
        out, self.done = self.done, []
        return out

    def wait(self, ops):
        for op in ops:
            if op in self.inflight:
                self.finish(op, self.rnd.choice(["done", "done", "done", "fail"]))
        return self.poll()

    def settle(self, op, policy, budget_s):
        return 0

    def wait_layer(self, op, layer):
        pass

    def stored_prefix(self, keys):
        return 0

    def close(self):
        pass


class HybridMachine(RuleBasedStateMachine):
    window: int | None = 6
    state: bool = True
    state_every = 1
    dev_pages, host_pages = 6, 8
    group_pages = {"swa": (4, 6), "ssm": (3, 4)}  # (device, host) ids per group
    write_policy = "write_through"

    def __init__(self):
        super().__init__()
        self.rnd = random.Random(0)
        self.port = BytesExecutor(self.rnd)
        self.model, full = hybrid_model(self.window, self.state)
        pools = {g.name: (PageAllocator(self.group_pages[g.name][0], f"{g.name} device"), PageAllocator(self.group_pages[g.name][1],
                                                                                                       f"{g.name} host"))
                 for g in self.model.groups if g.kind != "full"}
        self.core = CacheCore(full, PageAllocator(self.dev_pages, "device pool"), PageAllocator(self.host_pages, "host pool"), self.port,
                              CacheConfig(write_policy=self.write_policy, preallocate_nodes=False), model=self.model, group_pools=pools,
                              state_every=self.state_every)
        self.open: list = []

    # ---- the bytes a request is offered are its own ---------------------------------------------------
    def _check_offered(self, req) -> None:
        mem = self.port.mem
        for i, page in enumerate(req.cached_pages):
            assert mem.get((Tier.DEVICE, "", page)) == req.keys[i], f"cached page {i} holds another page's bytes"
        n = req.num_cached
        for c in self.core.components:
            given = req.groups[c.name]
            needed = [n - 1] if c.is_state and n else [] if c.is_state else list(window_pages(c.group, n, PAGE))
            assert sorted(given) == needed, f"group {c.name}: offered {sorted(given)} for a prefix of {n} pages that reads {needed}"
            for i, gid in given.items():
                assert mem.get((Tier.DEVICE, c.name, gid)) == (req.keys[i], c.name), f"group {c.name}: object {i} holds wrong bytes"
        if n and any(req.groups.values()):
            STEPS["group_hits"] += 1

    # ---- requests ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.open) < 2)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), pages=st.integers(1, 6), tail=st.integers(0, PAGE - 1))
    def begin(self, prefix, pages, tail):
        toks = PREFIXES[prefix][: pages * PAGE] + [50_000] * tail
        req = self.core.begin(toks)
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
            if c.is_state:
                places = [b - 1 for b in self.core.snapshot_boundaries(usable, full)]
            else:  # an engine keeps some of its window pages (at least the last window's)
                places = [p for p in range(usable, full) if p in window_pages(c.group, full, PAGE) or self.rnd.random() < keep]
            got = req.alloc_group(c.name, len(places))
            for place, gid in zip(places, got):
                mem[(Tier.DEVICE, c.name, gid)] = (req.keys[place], c.name)
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

    # ---- plans finish in any order, some fail; pools are squeezed --------------------------------------
    @precondition(lambda self: self.port.inflight)
    @rule(pick=st.integers(0, 10**6), ok=st.booleans())
    def complete(self, pick, ok):
        ops = sorted(self.port.inflight)
        self.port.finish(ops[pick % len(ops)], "done" if ok else "fail")
        self.core.poll()

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

    @invariant()
    def accounting(self):
        STEPS["total"] += 1
        core = self.core
        mine = {p for req in self.open for p in req._allocated}
        mine_groups = {c.name: {g for req in self.open for g in req._group_alloc.get(c.name, ())} for c in core.components}
        core.check_integrity(caller_device_pages=mine, caller_group_pages=mine_groups)
        quarantined = core.quarantined_group_pages()
        for c in core.components:
            dev, host = c.alloc[Tier.DEVICE], c.alloc[Tier.HOST]
            assert dev.num_free + len(c.at[Tier.DEVICE]) + len(mine_groups[c.name]) + len(quarantined.get(c.name, ())) == dev.num_pages
            assert host.num_free + len(c.at[Tier.HOST]) == host.num_pages
        if not self.open and not core._inflight:
            core.check_integrity(idle=True)

    def teardown(self):
        for req in self.open:
            req.abort()
        STEPS["limited"] += sum(c.limited for c in self.core.components)
        STEPS["failed"] += self.core.stats.load_failed_pages
        self.core.close()


CONFIGS = [  # window (tokens), state, cadence, device, host, write policy, group pools (device, host)
    (2, False, 1, 5, 8, "write_through", 4),      # a window shorter than a page
    (6, False, 1, 6, 8, "write_back", 4),         # a page and a half
    (40, False, 1, 6, 6, "write_through", 4),     # longer than any prefix: every page
    (None, True, 1, 6, 8, "write_through", 3),
    (None, True, 3, 5, 7, "write_back", 3),
    (6, True, 3, 6, 9, "write_through", 3),
    (2, True, 1, 4, 6, "write_through_selective", 3),
    (6, True, 1, 10, 12, "write_through", 6),     # roomier pools: more prefixes survive to be hit
    (40, True, 3, 9, 12, "write_back", 6),
]


def test_hybrid_core_state_machine_ten_thousand_steps():
    STEPS.update(total=0, group_hits=0, limited=0, failed=0)
    for window, state, every, dev, host, wp, g in CONFIGS:
        machine = type(f"Hybrid_{window}_{state}_{every}_{wp}_{dev}", (HybridMachine,),
                       {"window": window, "state": state, "state_every": every, "dev_pages": dev, "host_pages": host, "write_policy": wp,
                        "group_pages": {"swa": (g, g + 2), "ssm": (g, g + 1)}})
        run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=70, derandomize=True, deadline=None,
                                                             database=None, suppress_health_check=list(HealthCheck)))
    assert STEPS["total"] >= 10_000, STEPS
    # the runs did what they are for: hits that read group objects, prefixes a group cut short, failed loads
    assert STEPS["group_hits"] > 100 and STEPS["limited"] > 0 and STEPS["failed"] > 0, STEPS
