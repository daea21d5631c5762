"""What the policy core's state machines share: the prompts they draw from, the executors whose plans
wait until the machine decides their fate -- :class:`ScriptedExecutor` (no bytes) and
:class:`BytesExecutor` (a label per page and per group object, moved as plans say) -- and
:class:`ExecutorSide`, the rules of the executor's side."""

from __future__ import annotations

import random

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvtier.core import CacheCore
from kvtier.core.plans import CutShort, Done, Failed, Reason, Tier, Transfer
from support.hybrid_models import PAGE

PREFIXES = [list(range(1000 * p, 1000 * p + 6 * PAGE)) for p in range(3)]


def leading_stored(store, keys) -> int:
    """How many leading ``keys`` a store (any container of keys) holds: a stand-in store's ``stored_prefix``."""
    n = 0
    for k in keys:
        if k not in store:
            break
        n += 1
    return n


class ScriptedExecutor:
    """Plans wait here until the machine (or a blocking wait of the core) completes them."""

    has_storage = True
    can_wait = True

    def __init__(self, rnd: random.Random):
        self.rnd = rnd
        self.inflight: dict[int, Transfer] = {}
        self.done: list = []
        self.store: set[bytes] = set()
        #: fetches a settle answered: op -> pages reported arrived (the final answer may not be less)
        self.settled: dict[int, int] = {}

    def present(self, keys) -> int:
        return leading_stored(self.store, keys)

    def submit(self, plan: Transfer) -> None:
        if Tier.STORAGE in (plan.src, plan.dst) and self.rnd.random() < 0.05:
            self.done.append(Failed(plan.op, Reason.SKIPPED))  # queue full
            return
        self.inflight[plan.op] = plan

    def finish(self, op: int, outcome: str, cut: float = 0.5) -> None:
        plan = self.inflight.pop(op)
        n = plan.num_pages
        if plan.src is Tier.STORAGE:  # a fetch: never more than the store holds, never less than settled
            floor, ceiling = self.settled.pop(op, 0), max(self.present(plan.keys), self.settled.get(op, 0))
            k = ceiling if outcome == "done" else floor if outcome == "fail" else floor + int(cut * (ceiling - floor))
            self.done.append(Done(op) if k == n else CutShort(op, k, Reason.MISS if outcome != "fail" else Reason.ERROR))
            return
        if outcome == "done":
            c = Done(op, existing=self.present(plan.keys) if plan.dst is Tier.STORAGE else 0)
        elif outcome == "cut" and plan.dst is Tier.STORAGE:
            c = CutShort(op, int(cut * n), Reason.ERROR)
        else:
            c = Failed(op, Reason.ERROR)
        if plan.dst is Tier.STORAGE:
            self.store.update(plan.keys[: n if type(c) is Done else c.pages if type(c) is CutShort else 0])
        self.done.append(c)

    def poll(self):
        out, self.done = self.done, []
        return out

    def wait(self, ops):
        for op in ops:
            if op in self.inflight:
                self.finish(op, self.rnd.choice(["done", "done", "cut", "fail"]), self.rnd.random())
        return self.poll()

    def settle(self, op: int, policy: str, budget_s: float) -> int:
        plan = self.inflight[op]
        if policy == "wait_complete":
            self.finish(op, "done")
            return self.present(plan.keys)
        k = self.rnd.randint(0, self.present(plan.keys))
        self.settled[op] = k
        return k

    def wait_layer(self, op: int, layer: int) -> None:
        pass

    def stored_prefix(self, keys) -> int:
        return self.present(keys)

    def forget(self, key: bytes) -> None:
        """The store drops ``key`` on its own (a cap, maxmemory, a lost server)."""
        self.store.discard(key)

    def close(self) -> None:
        pass


class ExecutorSide(RuleBasedStateMachine):
    """Rules of the executor's side, shared by every machine: plans finish in any order, in any way,
    and the store forgets keys."""

    port: ScriptedExecutor | BytesExecutor
    core: CacheCore

    @precondition(lambda self: self.port.inflight)
    @rule(pick=st.integers(0, 10**6), outcome=st.sampled_from(["done", "done", "cut", "fail"]), cut=st.floats(0, 1))
    def complete(self, pick, outcome, cut):
        ops = sorted(self.port.inflight)
        self.port.finish(ops[pick % len(ops)], outcome, cut)
        self.core.poll()

    @precondition(lambda self: self.port.store)
    @rule(pick=st.integers(0, 10**6))
    def storage_loses_a_key(self, pick):
        keys = sorted(self.port.store)
        self.port.forget(keys[pick % len(keys)])


class BytesExecutor:
    """Plans wait until the machine completes them; labels move as they say. L3 is a dict of labels by
    key: a save stores what the host pages and objects hold, a fetch brings back the leading pages
    whose page and objects are all there; the store forgets keys at random."""

    has_storage = True
    can_wait = True

    def __init__(self, rnd: random.Random, pool_of: dict[str, str] | None = None):
        self.rnd = rnd
        #: group -> the pool its objects live in ("": the full pages' own, shared); else its own
        self.pool_of = pool_of or {}
        self.inflight: dict[int, Transfer] = {}
        self.done: list = []
        #: (tier, pool (a group's name, "" for the tree's pages and the groups sharing them), id) -> label
        self.mem: dict[tuple[Tier, str, int], object] = {}
        self.store: dict[bytes, object] = {}
        #: fetches a settle answered: op -> places reported arrived (their bytes are in place)
        self.settled: dict[int, int] = {}

    def submit(self, plan: Transfer) -> None:
        if Tier.STORAGE in (plan.src, plan.dst) and self.rnd.random() < 0.05:
            self.done.append(Failed(plan.op, Reason.SKIPPED))  # queue full
            return
        self.inflight[plan.op] = plan

    def _fetchable(self, plan: Transfer) -> int:
        """Leading places whose page and objects the store holds."""
        n = 0
        while n < plan.num_pages and plan.keys[n] in self.store and all(
                k in self.store for g in plan.groups for at, k in zip(g.at, g.keys) if at == n):
            n += 1
        return n

    def _land(self, plan: Transfer, k: int, op: int, start: int = 0) -> None:
        """A fetch's first ``k`` places are in host memory; the rest is garbage. Places before ``start``
        landed earlier (a settle reported them): a fetch writes a page once, so they are not touched
        again -- the cache may have reused those pages since."""
        mem, store = self.mem, self.store
        for i, page in enumerate(plan.dst_pages):
            if i >= start:
                mem[(Tier.HOST, "", page)] = store.get(plan.keys[i]) if i < k else ("garbage", op)
        for g in plan.groups:
            for at, gid, key in zip(g.at, g.dst_pages, g.keys):
                if at >= start:
                    mem[(Tier.HOST, self.pool_of.get(g.group, g.group), gid)] = store.get(key) if at < k else ("garbage", op)

    def finish(self, op: int, outcome: str, cut: float = 0.5) -> None:
        plan = self.inflight.pop(op)
        mem, n = self.mem, plan.num_pages
        if plan.src is Tier.STORAGE:  # never more than the store holds, never less than settled
            floor = self.settled.pop(op, 0)
            ceiling = max(self._fetchable(plan), floor)
            k = ceiling if outcome == "done" else floor if outcome == "fail" else floor + int(cut * (ceiling - floor))
            self._land(plan, k, op, floor)
            self.done.append(Done(op) if k == n else CutShort(op, k, Reason.MISS if outcome != "fail" else Reason.ERROR))
            return
        if plan.dst is Tier.STORAGE:
            k = n if outcome == "done" else int(cut * n) if outcome == "cut" else 0
            for i in range(k):
                self.store[plan.keys[i]] = mem.get((Tier.HOST, "", plan.src_pages[i]))
            for g in plan.groups:
                for at, gid, key in zip(g.at, g.src_pages, g.keys):
                    if at < k:
                        self.store[key] = mem.get((Tier.HOST, self.pool_of.get(g.group, g.group), gid))
            self.done.append(Done(op) if k == n else CutShort(op, k, Reason.ERROR) if k else Failed(op, Reason.ERROR))
            return
        pool = self.pool_of.get
        runs = [("", plan.src_pages, plan.dst_pages)] + [(pool(g.group, g.group), g.src_pages, g.dst_pages) for g in plan.groups]
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
                self.finish(op, self.rnd.choice(["done", "done", "done", "cut", "fail"]), self.rnd.random())
        return self.poll()

    def settle(self, op, policy, budget_s):
        plan = self.inflight[op]
        if policy == "wait_complete":
            self.finish(op, "done")
            return self._fetchable(plan)
        floor = self.settled.get(op, 0)
        k = self.rnd.randint(floor, max(floor, self._fetchable(plan)))
        self._land(plan, k, op, floor)  # what a settle reports arrived is in place
        self.settled[op] = k
        return k

    def wait_layer(self, op, layer):
        pass

    def stored_prefix(self, keys):
        return leading_stored(self.store, keys)

    def forget(self, key: bytes) -> None:
        """The store drops ``key`` on its own."""
        del self.store[key]

    def close(self):
        pass
