"""Randomized engines over the in-process hybrid caches, with real bytes: the scenario of issue 53, item 8.

``MODEL`` (support.hybrid_models): full pages, a sliding window of 6 tokens and a state group, each
in pools of its own, a snapshot every ``every`` pages; a file L3 whose reads are slow (prefetches
under the ``timeout`` policy give up and answer late); copies -- the pages' and each group's, every
one on its own transfer thread -- that take a while, host->device ones failing at random and
leaving their garbage (``GARBAGE``) in the layers they did not copy, device->host ones failing now
and then (:class:`FlakyCopies`); restarts (the cache closed with copies still in flight, and built
again over the same store, its device pools garbage); and two requests open at once, most of them on
one shared prefix.

* :class:`CoreSoak`: the policy core in this process (:class:`~kvtier.cache.HierarchicalCache`). The
  engine stand-in begins requests, waits for their loads (``wait``, as the hybrid engine of ``kvtier
  run`` does) and reads every byte it is handed -- its cached pages and each group's objects, the
  state snapshot at its boundary included -- against the bytes of their keys
  (:func:`~support.hybrid_bytes.expected`); then it computes the rest and commits, or aborts.
* :class:`EngineSoak`: the engine owns its device blocks (:class:`~kvtier.core.engine_device.EngineDeviceCore`
  over the same executor, its copies into the engine's blocks following their L3 fetch): every load
  that completes ``Done`` wrote each block and object its boundary reads with its own bytes, and
  nothing else.

A wrong byte raises :class:`WrongBytes`, naming what it was. The tests run a few seeds; a long run
sets ``KVTIER_SOAK_SEEDS`` and ``KVTIER_SOAK_STEPS`` (:func:`soak_plan`)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import torch

from kvtier import DevicePool, HostPool
from kvtier.alloc import PageAllocator
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.engine_device import EngineDeviceCore
from kvtier.core.plans import Done, Tier
from kvtier.executors.chain import ChainedExecutor
from kvtier.executors.local import LocalExecutor, group_movers
from kvtier.hashing import Namespace
from kvtier.l3.registry import open_backend
from kvtier.l3.tier import StorageTier
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.ops import backup_pages_all_layers, load_pages_one_layer
from support.hybrid_bytes import _bytes, _garbage, _write, expected
from support.hybrid_models import FULL, MODEL, P
from support.hybrid_rules import read_places

#: what a host->device copy that failed leaves in the layers it did not copy
GARBAGE = 0xAB
OTHERS = [g for g in MODEL.groups if g.kind != "full"]
SPECS = {"full": FULL, **{g.name: g.object_spec() for g in OTHERS}}
#: the shared prefix most requests start with, and prompts that branch off it or share nothing with it
SHARED = list(range(500, 500 + 6 * P))
PROMPTS = [SHARED, SHARED[: 2 * P] + list(range(2000, 2000 + 4 * P)), list(range(3000, 3000 + 6 * P))]


def soak_plan(seeds: int, steps: int) -> tuple[range, int]:
    """The seeds and the steps per run of a randomized test: ``seeds`` and ``steps`` in the suite; a long
    run sets ``KVTIER_SOAK_SEEDS`` (how many seeds, or ``first:end``) and ``KVTIER_SOAK_STEPS``."""
    import os

    raw = os.environ.get("KVTIER_SOAK_SEEDS")
    if raw:
        first, _, end = raw.rpartition(":")
        seeds_range = range(int(first or 0), int(end))
    else:
        seeds_range = range(seeds)
    return seeds_range, int(os.environ.get("KVTIER_SOAK_STEPS") or steps)


class WrongBytes(AssertionError):
    """The engine was handed bytes that are not the page's (or the object's)."""


class FlakyCopies:
    """The transfer engines' copies: each sleeps up to ``slow_s``. One host->device copy in ``1 / fail``
    fails at a random layer, writing ``GARBAGE`` into that layer and every later one of its destinations
    before it raises (what a copy that died midway leaves); a device->host copy (a backup, an engine's
    objects copied out) fails one time in ``1 / fail_out``, its host destinations garbage."""

    def __init__(self, rng: random.Random, fail: float, slow_s: float, fail_out: float = 0.0):
        self.rng, self.fail, self.slow_s, self.fail_out = rng, fail, slow_s, fail_out
        self.lock = threading.Lock()
        self.failed = self.failed_out = self.copies = 0

    def _draw(self, layers: int, fail: float) -> tuple[float, int | None]:
        with self.lock:
            self.copies += 1
            delay = self.rng.random() * self.slow_s
            at = self.rng.randrange(layers) if self.rng.random() < fail else None
            return delay, at

    def __call__(self, engine, job, layer_done) -> None:
        delay, fail_at = self._draw(job.num_layers, self.fail)
        time.sleep(delay)
        plan = engine.backend.transfer_plan(engine.host, engine.device, job.src_pages, job.dst_pages)
        for layer in range(job.num_layers):
            if layer == fail_at:
                with self.lock:
                    self.failed += 1
                _scribble(engine.device, job.dst_pages.tolist(), range(layer, job.num_layers))
                raise RuntimeError(f"injected: host->device copy failed at layer {layer}")
            load_pages_one_layer(engine.host, engine.device, job.src_pages, job.dst_pages, layer, engine.backend, plan)
            layer_done(layer)
            time.sleep(delay / 4)

    def copy_out(self, engine, job, layer_done) -> None:
        delay, fail_at = self._draw(1, self.fail_out)
        time.sleep(delay)
        if fail_at is not None:
            with self.lock:
                self.failed_out += 1
            _scribble(engine.host, job.dst_pages.tolist(), range(job.num_layers))
            raise RuntimeError("injected: device->host copy failed")
        backup_pages_all_layers(engine.host, engine.device, job.dst_pages, job.src_pages, engine.backend)

    def install(self, engines) -> None:
        for engine in engines:
            engine.register_handler(Tier.HOST, Tier.DEVICE, self)
            engine.register_handler(Tier.DEVICE, Tier.HOST, self.copy_out)


def _scribble(pool, pages: list[int], layers) -> None:
    for layer in layers:
        for b in pool.spec.buffers:
            rows = pool.rows(b.name, layer)
            for p in pages:
                rows[p].view(torch.uint8).fill_(GARBAGE)


class SlowStore:
    """A real backend whose reads take up to ``slow_s`` each (a prefetch past its budget answers late)."""

    def __init__(self, inner, rng: random.Random, slow_s: float):
        self.inner, self.rng, self.slow_s = inner, rng, slow_s
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _sleep(self) -> None:
        with self.lock:
            delay = self.rng.random() * self.slow_s if self.rng.random() < 0.5 else 0.0
        time.sleep(delay)

    def get(self, keys, outs):
        self._sleep()
        return self.inner.get(keys, outs)

    def get_scattered(self, keys, outs):
        self._sleep()
        return self.inner.get_scattered(keys, outs)


@dataclass
class Settings:
    every: int = 2                 # a state snapshot every this many pages
    dev: int = 8                   # device pages (full attention)
    host: int = 12                 # host pages
    group_dev: int = 6             # each group's own device pool
    group_host: int = 8            # each group's own host pool
    fail: float = 0.15             # a host->device copy fails this often
    fail_out: float = 0.05         # a device->host copy fails this often
    slow_copy_s: float = 0.002     # a copy takes up to this long
    slow_read_s: float = 0.006     # an L3 read takes up to this long (half of them)
    budget_s: float = 0.002        # the timeout policy's budget (fixed part; 0.5 ms a page on top)
    write_policy: str = "write_through"
    restart: float = 0.01          # a step restarts the cache this often


@dataclass
class Counts:
    steps: int = 0
    requests: int = 0
    checked_hits: int = 0
    snapshots_checked: int = 0
    window_pages_checked: int = 0
    pages_checked: int = 0
    shrunk_by_failure: int = 0
    storage_hits: int = 0
    restarts: int = 0
    restarts_mid_copy: int = 0
    both_open_on_one_prefix: int = 0
    failed_copies: int = 0
    given_up_prefetches: int = 0
    #: pages a failed load took from requests (the policy core)
    load_failed_pages: int = 0
    #: copies the cache saw fail
    transfer_failures: int = 0

    def add(self, other: Counts) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


class CoreSoak:
    """One seeded run (see the module docstring) over a file store at ``root``."""

    def __init__(self, seed: int, root, settings: Settings = Settings()):
        self.seed, self.root, self.s = seed, root, settings
        self.rng = random.Random(seed)
        self.copies = FlakyCopies(random.Random(seed * 7 + 1), settings.fail, settings.slow_copy_s, settings.fail_out)
        self.store_rng = random.Random(seed * 7 + 2)
        self.counts = Counts()
        self.open: list = []
        self._expected: dict = {}
        self.cache = self._build()

    # ---- the cache --------------------------------------------------------------------------
    def _build(self) -> HierarchicalCache:
        s = self.s
        ns = Namespace("soak", MODEL.fingerprint())
        storage = StorageConfig(url=f"file://{self.root}", write_policy="write_through", min_prefetch_pages=1, prefetch_policy="timeout",
                                prefetch_timeout_base_s=s.budget_s, prefetch_timeout_per_page_s=s.budget_s / 4)
        host = HostPool(FULL, s.host)
        backend = SlowStore(open_backend(storage.url), self.store_rng, s.slow_read_s)
        tier = StorageTier(backend, host, ns, batch_pages=storage.batch_pages)
        pools = {g.name: (DevicePool(g.object_spec(), s.group_dev), HostPool(g.object_spec(), s.group_host)) for g in OTHERS}
        cache = HierarchicalCache(DevicePool(FULL, s.dev), host, CacheConfig(write_policy=s.write_policy, preallocate_nodes=False),
                                  namespace=ns, storage=tier, storage_config=storage, model=MODEL, group_pools=pools, state_every=s.every)
        cache.port.run(_garbage)  # whatever a load does not write is visibly not the page
        self.copies.install([cache.engine, *cache.port.groups.values()])
        return cache

    def restart(self) -> None:
        """The engine goes away with its requests open (or ends them first) and copies in flight; the cache
        closes (its plans finish) and a new one opens over the same store."""
        c = self.counts
        c.restarts += 1
        c.restarts_mid_copy += bool(self.cache.plans_in_flight)
        if self.rng.random() < 0.5:
            for req, _ in self.open:
                req.abort()
        self.open = []
        self._tally()
        self.cache.close()
        self.cache = self._build()

    def _tally(self) -> None:
        st, c = self.cache.stats, self.counts
        c.given_up_prefetches += st.prefetches_given_up
        c.load_failed_pages += st.load_failed_pages
        c.transfer_failures += st.transfer_failures

    # ---- what the engine is handed ----------------------------------------------------------
    def expected(self, group: str, key) -> bytes:
        k = (group, key)
        if k not in self._expected:
            self._expected[k] = expected(SPECS[group], (group, key))
        return self._expected[k]

    def _check(self, group: str, slot: int, key, what: str) -> None:
        got = self.cache.port.run(_bytes, group, slot)
        if got != self.expected(group, key):
            raise WrongBytes(f"seed {self.seed}, step {self.counts.steps}: {what} ({group} id {slot}) holds {_kind(got)}")

    def check_offered(self, req) -> None:
        """Every byte the request was handed: its cached pages and the objects its boundary reads."""
        n, c = req.num_cached, self.counts
        for i, page in enumerate(req.cached_pages):
            self._check("full", page, req.keys[i], f"cached page {i} of {n}")
        c.pages_checked += n
        for comp in self.cache.components:
            given = req.groups[comp.name]
            needed = read_places(comp.group, n, P)
            if sorted(given) != needed:
                raise WrongBytes(f"seed {self.seed}: group {comp.name} offered places {sorted(given)} for a prefix of {n} pages "
                                 f"that reads {needed}")
            for place, gid in given.items():
                self._check(comp.name, gid, req.keys[place], f"{comp.name} object at place {place} (boundary {n})")
                if comp.group.kind == "state":
                    c.snapshots_checked += 1
                else:
                    c.window_pages_checked += 1
        if n:
            c.checked_hits += 1
            c.storage_hits += bool(req.storage_hit)

    # ---- the engine's steps -----------------------------------------------------------------
    def begin(self) -> None:
        rng = self.rng
        prompt = PROMPTS[0] if rng.random() < 0.7 else rng.choice(PROMPTS[1:])
        pages = rng.randint(1, 6)
        tokens = prompt[: pages * P] + [60_000 + rng.randrange(100)] * rng.randrange(P)
        policy = rng.choice(["timeout", "timeout", "best_effort", "wait_complete"])
        req = self.cache.begin(tokens, prefetch_policy=policy)
        if any(t[:P] == tokens[:P] for _, t in self.open):
            self.counts.both_open_on_one_prefix += 1
        self.open.append((req, tokens))
        self.counts.requests += 1

    def finish(self) -> None:
        rng = self.rng
        req, tokens = self.open.pop(rng.randrange(len(self.open)))
        before = req.num_cached
        req.wait()  # as the hybrid engine does (kvtier.app.engine): its objects land with its pages' load
        self.counts.shrunk_by_failure += req.num_cached < before
        self.check_offered(req)
        if rng.random() < 0.2:
            req.abort()
            return
        self.compute_and_commit(req)

    def compute_and_commit(self, req) -> None:
        rng, cache = self.rng, self.cache
        full = len(req.keys)
        usable = req.usable(rng.randint(0, req.num_cached))
        tail = 1 if rng.random() < 0.5 else 0
        new = req.alloc(full - usable + tail)
        if not new.ok:
            req.abort()
            return
        for j, page in enumerate(new.pages[: full - usable]):
            cache.port.run(_write, "full", page, ("full", req.keys[usable + j]))
        groups = {}
        for comp in cache.components:
            places = list(cache.groups.handed_places(comp.name, usable, full))
            ids: list[int | None] = [None] * full
            for place, gid in zip(places, req.alloc_group(comp.name, len(places))):
                cache.port.run(_write, comp.name, gid, (comp.name, req.keys[place]))
                ids[place] = gid
            groups[comp.name] = ids
        req.commit(req.cached_pages[:usable] + new.pages, groups)

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        self.counts.steps += 1
        r = rng.random()
        if r < self.s.restart:
            self.restart()
        elif r < 0.45 and len(self.open) < 2:
            self.begin()
        elif r < 0.80 and self.open:
            self.finish()
        elif r < 0.88:
            cache.evict_device(rng.randint(1, self.s.dev))
        elif r < 0.95:
            cache.evict_host(rng.randint(1, self.s.host))
        elif not self.open:
            cache.wait_idle()
            cache.check_integrity(idle=True)
        cache.check_integrity()

    def run(self, steps: int) -> Counts:
        try:
            for _ in range(steps):
                self.step()
            for req, _ in self.open:
                req.abort()
            self.open = []
            self.cache.wait_idle()
            self.cache.check_integrity(idle=True)
        finally:
            self._tally()
            self.counts.failed_copies = self.copies.failed + self.copies.failed_out
            self.cache.close()
        return self.counts


# ---- the engine owns the device (vLLM): EngineDeviceCore over the same executor, in this process ----------
def _fill_slot(executor, group: str, slot: int, value: int) -> None:
    pool = executor.engine.device if group == "full" else executor.groups[group].device
    for layer in range(pool.spec.num_layers):
        for b in pool.spec.buffers:
            pool.rows(b.name, layer)[slot].view(torch.uint8).fill_(value)


@dataclass
class EngineSettings(Settings):
    engine_ids: int = 48           # the engine's blocks per pool (its own: kvtier never allocates them)


class EngineSoak:
    """One seeded run of an engine that owns its device blocks (:class:`~kvtier.core.engine_device.EngineDeviceCore`
    over the in-process executor, copies into the engine's blocks following their L3 fetch): it computes
    prompts and offloads them (waited for, or planned), plans loads of a prefix into new blocks -- two at
    once on one prefix, some from the blocks it holds itself (``first``) --, loads one waiting for its
    fetch per the timeout policy (``load_into``), and restarts; every load that completes ``Done`` must
    have written each block and object its boundary reads with its own bytes, and nothing else."""

    def __init__(self, seed: int, root, settings: EngineSettings = EngineSettings()):
        self.seed, self.root, self.s = seed, root, settings
        self.rng = random.Random(seed)
        self.copies = FlakyCopies(random.Random(seed * 7 + 1), settings.fail, settings.slow_copy_s, settings.fail_out)
        self.store_rng = random.Random(seed * 7 + 2)
        self.counts = Counts()
        self._expected: dict = {}
        self.core = self._build()

    # ---- the cache, and the engine's blocks ---------------------------------------------------
    def _build(self):
        s = self.s
        ns = Namespace("soak-engine", MODEL.fingerprint())
        storage = StorageConfig(url=f"file://{self.root}", write_policy="write_through", min_prefetch_pages=1, prefetch_policy="timeout",
                                prefetch_timeout_base_s=s.budget_s, prefetch_timeout_per_page_s=s.budget_s / 4)
        host = HostPool(FULL, s.host)
        tier = StorageTier(SlowStore(open_backend(storage.url), self.store_rng, s.slow_read_s), host, ns, batch_pages=storage.batch_pages)
        pools = {g.name: (DevicePool(g.object_spec(), s.engine_ids), HostPool(g.object_spec(), s.group_host)) for g in OTHERS}
        executor = LocalExecutor(TransferEngine(host, DevicePool(FULL, s.engine_ids)), tier, *group_movers(pools, "direct", tier))
        self.copies.install([executor.engine, *executor.groups.values()])
        group_hosts = {g.name: PageAllocator(s.group_host, g.name) for g in OTHERS}
        core = EngineDeviceCore(FULL, PageAllocator(s.host, "host"), ChainedExecutor(executor), CacheConfig(preallocate_nodes=False),
                                storage, namespace=ns, model=MODEL, group_hosts=group_hosts, state_every=s.every)
        executor.run(_garbage)
        #: the engine's free blocks per pool ("full" and each group)
        self.free = {name: list(range(s.engine_ids)) for name in SPECS}
        #: blocks a planned copy out still reads: (its ops, {pool: ids})
        self.copying_out: list = []
        #: loads not checked yet: (load, keys, blocks, groups, first)
        self.loads: list = []
        return core

    def _take(self, name: str, n: int) -> list[int]:
        free = self.free[name]
        if len(free) < n:
            raise _OutOfBlocks
        out = [free.pop(self.rng.randrange(len(free))) for _ in range(n)]
        return out

    def _give_back(self, ids: dict[str, list[int]]) -> None:
        """The engine frees blocks: what it writes there next is its own business (garbage again here)."""
        port = self.core.port.inner
        for name, slots in ids.items():
            for slot in slots:
                if slot is not None:
                    port.run(_fill_slot, name, slot, 0xEE)
                    self.free[name].append(slot)

    def _write(self, name: str, slot: int, key) -> None:
        self.core.port.inner.run(_write, name, slot, (name, key))

    def expected(self, group: str, key) -> bytes:
        k = (group, key)
        if k not in self._expected:
            self._expected[k] = expected(SPECS[group], (group, key))
        return self._expected[k]

    def _bytes(self, group: str, slot: int) -> bytes:
        return self.core.port.inner.run(_bytes, group, slot)

    # ---- the engine's steps ---------------------------------------------------------------------
    def _prompt(self) -> tuple[list, int]:
        rng = self.rng
        prompt = PROMPTS[0] if rng.random() < 0.7 else rng.choice(PROMPTS[1:])
        pages = rng.randint(1, 6)
        return self.core.page_keys(prompt[: pages * P]), pages

    def offload(self) -> None:
        rng, core = self.rng, self.core
        keys, pages = self._prompt()
        blocks = self._take("full", pages)
        for k, b in zip(keys, blocks):
            self._write("full", b, k)
        groups, used = {}, {"full": blocks}
        for comp in core.components:
            if comp.group.kind == "state":
                places = [b - 1 for b in range(1, pages + 1) if b % core.state_every == 0 or b == pages]
            else:  # the engine still holds its last ``kept`` window blocks
                kept = rng.randint(0, pages)
                places = list(range(pages - kept, pages))
            ids = self._take(comp.name, len(places))
            row: list[int | None] = [None] * pages
            for place, gid in zip(places, ids):
                self._write(comp.name, gid, keys[place])
                row[place] = gid
            groups[comp.name], used[comp.name] = row, ids
        wait = rng.random() < 0.5
        r = core.offload(keys, blocks, wait=wait, groups=groups)
        ops = [op for op in (r.copy_op, r.objects_op) if op is not None]
        if ops:
            self.copying_out.append((ops, used))
        else:
            self._give_back(used)

    def _load_ids(self, keys, first: int) -> tuple[list[int], dict[str, list[int | None]], dict[str, list[int]]]:
        rng, pages = self.rng, len(keys)
        blocks = self._take("full", pages)
        groups, used = {}, {"full": blocks}
        for comp in self.core.components:
            ids = self._take(comp.name, pages)
            row = [gid if i < first or rng.random() < 0.9 else None for i, gid in enumerate(ids)]
            groups[comp.name], used[comp.name] = row, ids
        return blocks, groups, used

    def plan_load(self, keys=None, first: int | None = None) -> None:
        if keys is None:
            keys, _ = self._prompt()
        first = self.rng.choice([0, 0, 0, 1, 2]) if first is None else first
        first = min(first, len(keys))
        blocks, groups, used = self._load_ids(keys, first)
        load = self.core.plan_load(keys, blocks, first=first, groups=groups)
        self.loads.append((load, keys, blocks, groups, first, used))
        self.counts.requests += 1

    def two_loads_on_one_prefix(self) -> None:
        keys, pages = self._prompt()
        self.plan_load(keys)
        self.plan_load(keys[: self.rng.randint(1, pages)])
        self.counts.both_open_on_one_prefix += 1

    def load_into(self) -> None:
        keys, _ = self._prompt()
        blocks, groups, used = self._load_ids(keys, 0)
        load = self.core.load_into(keys, blocks, groups=groups)
        self.core.release(load)
        self.counts.requests += 1
        self.loads.append((load, keys, blocks, groups, 0, used))

    def _check_load(self, load, keys, blocks, groups, first: int) -> None:
        d = load.loaded
        if load.op is None or type(load.outcome) is not Done:
            return  # nothing copied, or the engine recomputes every page of it
        c = self.counts
        for i in range(len(keys)):
            got = self._bytes("full", blocks[i])
            want = self.expected("full", keys[i]) if first <= i < d else bytes([0xEE]) * len(got)
            if got != want:
                raise WrongBytes(f"seed {self.seed}, step {c.steps}: engine block of page {i} (loaded {first}..{d}) "
                                 f"{'holds wrong bytes' if i < d else 'was written'}: {_kind(got)}")
        c.pages_checked += d - first
        for comp in self.core.components:
            needed = set(read_places(comp.group, d, P))
            for i, gid in enumerate(groups[comp.name]):
                if gid is None:
                    continue
                got = self._bytes(comp.name, gid)
                if i >= first and i in needed:
                    if got != self.expected(comp.name, keys[i]):
                        raise WrongBytes(f"seed {self.seed}, step {c.steps}: {comp.name} object at place {i} (boundary {d}, "
                                         f"first {first}) holds {_kind(got)}")
                    c.snapshots_checked += comp.group.kind == "state"
                    c.window_pages_checked += comp.group.kind != "state"
                elif got != bytes([0xEE]) * len(got):
                    raise WrongBytes(f"seed {self.seed}, step {c.steps}: {comp.name} object at place {i} was written, and boundary {d} "
                                     f"(first {first}) does not read it: {_kind(got)}")
        c.checked_hits += 1
        c.storage_hits += bool(load.from_storage)

    def settle(self) -> None:
        """Apply what finished; check the loads that completed; free the blocks nothing reads any more."""
        core = self.core
        core.poll()
        left = []
        for entry in self.loads:
            load = entry[0]
            if load.op is not None and load.outcome is None:
                left.append(entry)
                continue
            self._check_load(*entry[:5])
            self._give_back(entry[5])
        self.loads = left
        busy = []
        for ops, used in self.copying_out:
            if any(core.in_flight(op) for op in ops):
                busy.append((ops, used))
            else:
                self._give_back(used)
        self.copying_out = busy

    def restart(self) -> None:
        c = self.counts
        c.restarts += 1
        c.restarts_mid_copy += bool(self.core.plans_in_flight)
        self.core.close()  # (its plans finish: the loads' outcomes are applied, and checked below)
        self._check_pending_after_close()
        self._tally()
        self.core = self._build()

    def _check_pending_after_close(self) -> None:
        for entry in self.loads:
            self._check_load(*entry[:5])
        self.loads = []
        self.copying_out = []

    def _tally(self) -> None:
        st, c = self.core.stats, self.counts
        c.given_up_prefetches += st.prefetches_given_up
        c.transfer_failures += st.transfer_failures

    def step(self) -> None:
        rng, core = self.rng, self.core
        self.counts.steps += 1
        r = rng.random()
        try:
            if r < self.s.restart:
                self.restart()
                return
            if r < 0.35:
                self.offload()
            elif r < 0.55:
                self.plan_load()
            elif r < 0.65:
                self.two_loads_on_one_prefix()
            elif r < 0.72:
                self.load_into()
            elif r < 0.78:
                core.lookup(self._prompt()[0])
            elif r < 0.86:
                core.evict_host(rng.randint(1, self.s.host))
            elif r < 0.90:
                time.sleep(self.s.slow_copy_s)
            elif r < 0.93 and not self.loads and not self.copying_out:
                core.wait_idle()
                core.check_integrity(idle=True)
        except _OutOfBlocks:
            core.wait_idle()
        self.settle()
        core.check_integrity()

    def run(self, steps: int) -> Counts:
        try:
            for _ in range(steps):
                self.step()
            self.core.wait_idle()
            self.settle()
            self.core.check_integrity(idle=True)
        finally:
            self._tally()
            self.counts.failed_copies = self.copies.failed + self.copies.failed_out
            self.core.close()
        return self.counts


class _OutOfBlocks(Exception):
    """The engine has no free block for a step (its loads and copies out hold them): it waits instead."""


def _kind(got: bytes) -> str:
    """What wrong bytes look like: a failed copy's garbage, the pools' first garbage, or another page's."""
    return ("a failed copy's garbage" if set(got) == {GARBAGE} else "partly a failed copy's garbage" if got.count(GARBAGE) > len(got) // 4
            else "bytes never written" if set(got) == {0xEE} else "another object's bytes")
