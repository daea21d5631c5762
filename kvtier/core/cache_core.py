"""The policy core when kvtier owns the device pool too: what is cached where, decided without touching a byte.

On top of :class:`~kvtier.core.base.CoreBase` (shared with the engine-owned-device
core, :mod:`~kvtier.core.engine_device`), it holds the page-keyed prefix index (:class:`~kvtier.radix.PrefixTree`) with
residency per tier (device, host, L3), locks and per-tier LRU, the page ids of
both pools (two :class:`~kvtier.alloc.PageAllocator`, which own no memory),
the write policies and the L3 save/prefetch state. It never holds a tensor, a
file or a socket: every movement it decides leaves as a
:class:`~kvtier.core.plans.Transfer` through its :class:`~kvtier.executors.port.ExecutorPort`,
and comes back as a typed completion (:class:`~kvtier.core.plans.Done`,
:class:`~kvtier.core.plans.CutShort`, :class:`~kvtier.core.plans.Failed`),
dispatched on the type of what the plan was for (its :class:`JobTag`). Where
the executor runs -- this process, another one, nowhere (planning) -- is the
port's business.

Threading: one thread (the engine's scheduler) calls every method. Completions
are applied by :meth:`CacheCore.poll`, which every public method calls first.

Request flow (:meth:`CacheCore.begin` does the first three steps; see :mod:`kvtier.core.request`)::

    m = core.match(tokens)           # device pages usable now, host pages that follow
    core.lock(m.last_node)           # keep the matched path while the request runs
    ld = core.load_back(m)           # a host->device plan of m.host_nodes, waited on per layer
    new = core.alloc_device(k)       # page ids for the tokens to compute (evicts LRU if needed)
    for i in layers: ld.wait_layer(i); attend(i)
    ins = core.insert(tokens, ld.device_pages + new_full_pages)   # the tail page stays the caller's
    core.unlock(m.last_node)

Page alignment holds by construction: keys exist only for full pages, the tree
stores whole pages, and every plan is a list of whole page ids or keys.

Liveness is an invariant: when no request holds a lock and no plan is in
flight, every device and host page is evictable (:meth:`CacheCore.check_integrity`
with ``idle=True`` proves it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.device_space import DeviceSpace
from kvtier.core.group_objects import groups_for
from kvtier.core.plans import Completion, Done, Tier, copy_plan
from kvtier.core.port import ExecutorPort
from kvtier.core.quarantine import Quarantine
from kvtier.core.request import CacheRequest
from kvtier.core.results import EvictResult, InsertResult, LoadResult, MatchResult
from kvtier.core.shared_host import NO_SHARED_HOST, SharedHost, check_shared_host
from kvtier.core.tags import Backup, EvictionBackup, EvictionSave, JobTag, LoadBack, PrefetchHandle, Save
from kvtier.errors import ExecutorError, PageAlignmentError, PageOwnershipError
from kvtier.groups import ModelSpec
from kvtier.hashing import Namespace, PageHash
from kvtier.metrics import CacheStats
from kvtier.pages import at_own_place, checked_page_list, first_duplicate
from kvtier.radix import NO_PAGE, PageNode, device_page_of, host_page_of
from kvtier.spec import KVSpec

__all__ = ["Backup", "CacheCore", "EvictResult", "EvictionBackup", "EvictionSave", "InsertResult", "JobTag", "LoadBack", "LoadResult",
           "MatchResult", "PrefetchHandle", "Save"]

log = logging.getLogger(__name__)


class CacheCore(DeviceSpace):
    """The policy over page ids (see the module docstring). ``device`` and ``host`` allocate the
    ids of the pools the executors hold; ``port`` carries plans to those executors.

    Its layers (:mod:`~kvtier.core.state` lists them) and its parts: ``groups``, a hybrid model's
    other KV groups (:mod:`~kvtier.core.group_objects`), and ``quarantine``, the device pages a
    failed load left (:mod:`~kvtier.core.quarantine`); here, matching, the request protocol,
    loads back and inserts.

    ``model``: a :class:`~kvtier.groups.ModelSpec` whose full-attention group ``spec`` describes;
    ``group_pools``: each other group's (device, host) allocators; ``state_every``: the cadence of
    state snapshots, in pages; ``shared_host``: a host tier other engines share
    (:mod:`~kvtier.core.shared_host`; a model of full attention only, and no L3 of the core's own)."""

    def __init__(self, spec: KVSpec, device: PageAllocator, host: PageAllocator, port: ExecutorPort, config: CacheConfig = CacheConfig(),
                 storage_config: StorageConfig = StorageConfig(), *, namespace: Namespace | None = None, stats: CacheStats | None = None,
                 model: ModelSpec | None = None, group_pools: dict[str, tuple[PageAllocator, PageAllocator]] | None = None,
                 state_every: int = 1, shared_host: SharedHost = NO_SHARED_HOST):
        check_shared_host(shared_host, model, port, hybrid=True)
        if namespace is None and model is not None and model.is_hybrid:
            namespace = Namespace("default", model.fingerprint())
        super().__init__(spec, device, host, port, config, storage_config, namespace=namespace, stats=stats)
        #: live views of who holds each device page (tree / allocator), for insert's ownership check
        self._tree_owned = np.frombuffer(self.tree.device_owned, dtype=np.uint8)
        self._allocated = self.dev_alloc.allocated_view()
        self.groups = groups_for(model, group_pools, spec, tree=self.tree, state_every=state_every, device=device, host=host,
                                 loading=self._loading, make_room=self._make_room)
        if shared_host and self.groups:
            self.groups.check_shared()
        self.quarantine = Quarantine(device, self._free_objects, self._oldest_op)
        #: bumped on every failed load (the quarantine's generation): a request re-checks its prefix only when this moved
        self.load_failure_gen = 0
        self._waiting_for_plans = self.quarantine.entries
        #: a request that ended (its quarantine entry bound once: one call per request, not two)
        self.request_finished = self.quarantine.request_finished
        self._on |= {LoadBack: self._finish_load}
        self._share_host(shared_host)

    def _free_objects(self, ids: dict[str, list[int]]) -> None:
        self.groups.free_ids(Tier.DEVICE, ids)

    # ---- a hybrid model's device objects (kvtier owns the device; the engine-owned core has none) --------
    def alloc_group(self, name: str, n: int) -> list[int]:
        """Up to ``n`` device ids of group ``name``'s pool (evicting its unheld objects if needed)."""
        self.poll()
        return self.groups.alloc(self.groups.component(name), Tier.DEVICE, n)

    def free_group(self, name: str, ids: list[int]) -> None:
        """Return caller-owned ids of group ``name``'s device pool."""
        self.groups.component(name).alloc[Tier.DEVICE].free(ids)

    # ---- failed loads: what a request needs to know of them (:mod:`~kvtier.core.quarantine`) --------
    def quarantined_pages(self) -> set[int]:
        return self.quarantine.pages()

    def quarantined_group_pages(self) -> dict[str, set[int]]:
        """Device ids of other KV groups' objects a failed load left, per group (freed with its pages)."""
        return self.quarantine.objects()

    def _oldest_op(self) -> int | None:
        """The oldest plan still in flight (None: none)."""
        return next(iter(self._inflight), None)

    def _completions_applied(self) -> None:
        self.quarantine.release()

    def holds_object(self, name: str, node: PageNode, gid: int) -> bool:
        """Whether ``node`` still holds device object ``gid`` of group ``name`` (a failed load takes them)."""
        return self.groups.holds_object(name, node, gid)

    def match(self, tokens_or_keys: Sequence[int] | list[PageHash], *, count: bool = True, limit: int | None = None,
              tenant: object = None) -> MatchResult:
        """Longest cached prefix (full pages only); counts hits, may trigger selective backups.

        ``count=False`` re-matches a request already counted (e.g. after its prefetch) without
        touching hit counts or stats. ``limit`` (a hybrid model): the request uses at most that many
        pages, so the prefix is the longest one every group can continue from within them. ``tenant``:
        the scope of token ids' keys (:meth:`page_keys`)."""
        return self._match(self._keys(tokens_or_keys, tenant), count, limit)

    def _match(self, keys: list[PageHash], count: bool = True, limit: int | None = None) -> MatchResult:
        """:meth:`match` of page keys (``begin`` has them already)."""
        self.poll()
        if self.tenants is not None:
            self.expire_host()
        tree = self.tree
        path = self._shared_walk(keys, limit) if self.shared_host else tree.walk(keys)
        tree.touch(path)
        n_dev = tree.device_prefix(path)
        matched = path[: n_dev + tree.readable_host_run(path[n_dev:])]  # the device pages, then readable host copies
        limited_by = None
        end = len(keys)
        filled = False
        groups = self.groups
        if groups:  # a hybrid model: the longest prefix every group can continue from
            if limit is not None:
                end = min(end, limit)
                matched, path = matched[:end], path[:end]
            fills = [False]
            hybrid = groups.prefix(path, n_dev, len(matched), fill=fills)
            matched, limited_by, filled = matched[: hybrid.pages], hybrid.limited_by, fills[0]
            n_dev = min(n_dev, hybrid.pages)
        n_storage = 0
        if count and self.port.has_storage and len(matched) == len(path) < end:
            n_storage = self._ask(self.port.stored_prefix, keys[len(path) : end])
            if n_storage and groups:  # a hybrid model: as far as every group's objects are there too
                n_storage = groups.stored_usable(path, n_dev, keys[:end], n_storage, self._stored_prefix)
        below = bool(self.min_hit_pages) and 0 < len(matched) + n_storage < self.min_hit_pages
        if below:  # shorter than the minimum a hit may be: a miss, recomputed (its time says nothing of what was cached)
            matched, n_dev, n_storage, limited_by, filled = [], 0, 0, None, False
            if count:
                self.stats.hits_below_minimum += 1
        pending: tuple[int, ...] = ()
        if self._loading and n_dev:
            loading = self._loading
            pending = tuple(dict.fromkeys(op for op in (loading.get(n) for n in path[:n_dev]) if op is not None))
        if not count:
            return MatchResult(keys, list(map(device_page_of, path[:n_dev])), matched, pending, 0, limited_by, filled, below,
                               tree.current_owner)
        if self.config.write_policy == "write_through_selective":  # the one policy that reads hit counts
            for node in matched:
                node.hit_count += 1
        st = self.stats
        st.requests += 1
        st.lookup_pages += len(keys)
        st.device_hit_pages += n_dev
        st.host_hit_pages += len(matched) - n_dev
        if limited_by is not None:
            groups.component(limited_by).limited += 1
        if self.config.write_policy == "write_through_selective":
            due = [n for n in path[:n_dev] if n.host_page == NO_PAGE and n.hit_count >= self.config.write_through_threshold]
            if due:
                self._backup(due)
        st.storage_hit_pages += n_storage
        if self.tenants is not None:
            self.tenants.looked_up(tree.current_owner, len(keys), len(matched) + n_storage, tree.now)
        return MatchResult(keys, list(map(device_page_of, path[:n_dev])), matched, pending, n_storage, limited_by, filled, below,
                           tree.current_owner)

    def begin(self, tokens_or_keys: Sequence[int] | list[PageHash], *, usable_pages: int | None = None,
              prefetch: bool = True, prefetch_policy: str | None = None, tenant: object = None) -> CacheRequest:
        """Start a request (see :mod:`kvtier.core.request`): match (counted once), lock, prefetch from L3
        when it can add pages the request will use (``usable_pages``, default all its full pages;
        ``prefetch_policy`` default: the storage config's), and start loading host pages back. ``tenant``:
        whose request it is (:meth:`page_keys`: its pages are a hit for that tenant's requests only; None: the
        namespace's own scope); the request's keys carry it to its commit."""
        keys = self._keys(tokens_or_keys, tenant)
        want = len(keys) if usable_pages is None else min(usable_pages, len(keys))
        m = self._match(keys, True, want)
        self.lock(m.nodes[-1] if m.nodes else None)
        host_before = len(m.nodes) - len(m.device_pages)
        if prefetch and m.num_storage_pages and len(m.nodes) < want:
            try:
                handle = self._prefetch(m)
                if handle is not None:
                    self.resolve_prefetch(handle, prefetch_policy)
                    again = self._match(keys, False, want)
            except ExecutorError:
                self.unlock(m.last_node)  # the port is gone: nothing of this request stays locked
                raise
            if handle is not None:
                self.lock(again.last_node)
                self.unlock(m.last_node)
                self.stats.hits_below_minimum += again.below_minimum  # (the prefetch came back short of the minimum)
                m = again
        if self.min_hit_pages and 0 < len(m.nodes) < self.min_hit_pages:
            # what is readable is shorter than the minimum (L3 pages that made it up were not fetched): a miss
            self.unlock(m.last_node)
            self.stats.hits_below_minimum += 1
            m, host_before = MatchResult(keys, [], [], (), 0), 0
        quarantine = self.quarantine
        if not self.groups:  # full attention: the device prefix, then every host page loaded back
            # (the match's fields read directly, not through its properties: this runs once per request)
            ld = self._load_back(m) if len(m.nodes) > len(m.device_pages) else LoadResult(None, list(m.device_pages), 0, 0, m.pending, self)
            host_hit = min(ld.loaded, host_before)
            # the nodes of ld.device_pages: locked until commit
            return CacheRequest(self, keys, len(keys), len(m.device_pages), host_hit, ld.loaded - host_hit, ld.device_pages, ld,
                                m.nodes[-1] if m.nodes else None, m.nodes[: len(ld.device_pages)], serial=quarantine.request_opened(),
                                failure_gen=self.load_failure_gen, owner=self.tree.current_owner)
        ld = self._load_back(m) if m.num_host_pages or m.fills else LoadResult(None, list(m.device_pages), 0, 0, m.pending, self)
        nodes, cached = m.nodes[: len(ld.device_pages)], ld.device_pages
        # what the loads could bring: the prefix every group continues from, its objects held
        if ld.op is not None or len(nodes) < len(m.nodes) or m.fills:  # (else the match's answer stands: all on device)
            usable = self.groups.prefix(nodes, len(nodes), len(nodes)).pages
            nodes, cached = nodes[:usable], cached[:usable]
        given, held = self.groups.given_objects(nodes)
        device_hit = min(m.num_device_pages, len(cached))
        host_hit = min(ld.loaded, host_before, len(cached) - device_hit)
        return CacheRequest(self, keys, len(keys), device_hit, host_hit, len(cached) - device_hit - host_hit, cached, ld, m.last_node,
                            nodes, serial=quarantine.request_opened(), failure_gen=self.load_failure_gen, groups=given, held=held,
                            owner=self.tree.current_owner)

    def load_back(self, match: MatchResult) -> LoadResult:
        """Allocate device pages for ``match.host_nodes`` and start their per-layer load.

        Loads as many leading host pages as the device can hold after eviction;
        the rest stay on host (``loaded < requested``), nothing is half-assigned.
        A hybrid model's objects the match's boundary reads come along: those of the pages loaded,
        and those of device pages whose object was evicted from device but kept on host (the
        "fills": the plan brings their objects alone, and they count as loading until it is done).
        """
        self.poll()
        return self._load_back(match)

    def _load_back(self, match: MatchResult) -> LoadResult:
        """:meth:`load_back` inside a call that polled already (``begin``: one poll per entry)."""
        # the match may be stale: keep the leading run that still directly follows the device prefix
        host_nodes = match.host_nodes
        valid = host_nodes[: self.tree.loadable_run(host_nodes)]
        if self.groups:
            return self._load_back_hybrid(match, valid)
        pages = self._room_for(match, valid) if valid else None
        if not pages:
            return LoadResult(None, list(match.device_pages), 0, len(host_nodes), match.pending, self)
        served = valid[: len(pages)]
        tree = self.tree
        tree.set_device_run(served, pages)
        tree.touch(served)
        tree.lock(served[-1])  # pins the path until the load completes (poll)
        op = self._submit(copy_plan, LoadBack(served), Tier.HOST, list(map(host_page_of, served)), Tier.DEVICE, pages)
        loading = self._loading
        for n in served:
            loading[n] = op
        return LoadResult(op, match.device_pages + pages, len(served), len(host_nodes), match.pending, self)

    def _room_for(self, match: MatchResult, valid: list[PageNode]) -> list[int] | None:
        """Device pages for the leading nodes of ``valid`` (the host run below ``match``'s device prefix), as
        many as the device holds after eviction; None when the prefix they follow changed meanwhile."""
        self.tree.lock(valid[-1])  # pins the matched path while we make room
        try:
            got = self._alloc_device(len(valid))
            if not got.ok:
                take = min(len(valid), self.dev_alloc.num_free)
                got = self.dev_alloc.alloc(take)
                self.stats.load_shortfall_pages += len(valid) - take
        finally:
            self.tree.unlock(valid[-1])
        first = len(match.device_pages)
        if first and match.nodes[first - 1].device_page != match.device_pages[-1]:
            # making room waited for plans in flight, and a load this prefix waited on failed: its pages left
            # the device, so the host run no longer follows it (the request learns of the failure and shrinks)
            self.dev_alloc.free(got.pages)
            return None
        return got.pages

    def _load_back_hybrid(self, match: MatchResult, valid: list[PageNode]) -> LoadResult:
        """:meth:`load_back` for a hybrid model: the pages of ``valid``, and the other groups' objects the
        match's boundary reads beside them and beside device pages that lost theirs (fills). The objects
        it reads are held throughout: making room for the pages and the objects may back pages up, and
        the host room that needs may evict objects -- never these."""
        groups = self.groups
        lo = groups.object_fills(match.nodes, len(match.device_pages)) if match.fills else None
        if not valid and lo is None:
            return LoadResult(None, list(match.device_pages), 0, len(match.host_nodes), match.pending, self)
        reading = match.nodes[groups.first_read(len(match.nodes)) :]
        groups.hold(reading)
        try:
            return self._load_held(match, valid, lo)
        finally:
            groups.release(reading)

    def _load_held(self, match: MatchResult, valid: list[PageNode], lo: int | None) -> LoadResult:
        """The hybrid load back of the still loadable host run ``valid`` and of the fills from place ``lo``
        (None: none), the objects they read held."""
        prefix_pages = list(match.device_pages)
        first = len(prefix_pages)
        nothing = LoadResult(None, prefix_pages, 0, len(match.host_nodes), match.pending, self)
        pages = []
        if valid:
            pages = self._room_for(match, valid)
            if pages is None:
                return nothing
        served = valid[: len(pages)]
        if not served and lo is None:
            return nothing
        start = first if lo is None else lo
        span = match.nodes[start : first + len(served)]
        if served:
            self.tree.set_device_run(served, pages)
            self.tree.touch(served)
        self.tree.lock(span[-1])  # pins the path while objects get device ids; released when the load completes (poll)
        groups, fills, counts = self.groups.load_runs(match.nodes, start, first, len(served))
        if not served:  # a plan of objects alone: its lock is on the deepest node whose objects it brings
            if fills:
                self.tree.lock(fills[-1])
            self.tree.unlock(span[-1])
            if not fills:  # no device ids for the fills' objects: nothing to load
                return nothing
        op = self._submit(copy_plan, LoadBack(served, fills, counts), Tier.HOST, list(map(host_page_of, served)), Tier.DEVICE,
                          pages, 0, groups)
        for n in (*fills, *served):
            self._loading[n] = op
        return LoadResult(op, prefix_pages + pages, len(served), len(match.host_nodes), match.pending, self)

    def _finish_load(self, c: Completion, tag: LoadBack) -> None:
        nodes, fills, op = tag.nodes, tag.fills, c.op
        loading = self._loading
        if type(c) is Done:
            for n in (*fills, *nodes) if fills else nodes:
                if loading.get(n) == op:  # (a failed load above may have taken it already)
                    del loading[n]
            if tag.groups:
                self.groups.count_loads(tag.groups, True)
            self.stats.loaded_pages += len(nodes)
            self.stats.loaded_bytes += len(nodes) * self._page_bytes
            self.tree.unlock(nodes[-1] if nodes else fills[-1])
            return
        mine = [n for n in nodes if loading.get(n) == op]
        filled = [n for n in fills if loading.get(n) == op]
        for n in (*filled, *mine):
            del loading[n]
        if tag.groups:
            self.groups.count_loads(tag.groups, False)
        # the device copies are garbage: off the tree now, freed once nobody can name them
        self.stats.transfer_failures += 1
        self.tree.unlock(nodes[-1] if nodes else fills[-1])
        self.stats.load_failed_pages += self._drop_failed_load(mine)
        if filled:  # their pages were good; the objects brought beside them are not
            self._drop_failed_objects(filled)

    def _drop_failed_load(self, nodes: list[PageNode]) -> int:
        """Take a failed load's device copies (and every device page below them) off the tree into
        quarantine. Returns how many pages were quarantined."""
        tree = self.tree
        bad = [n for n in nodes if n.device_page != NO_PAGE]
        if not bad:
            return 0
        below_outside = bad[-1].device_children or any(n.device_children > 1 for n in bad[:-1])
        victims = tree.device_subtree(bad[:1]) if below_outside else bad[::-1]
        for n in victims:
            self._loading.pop(n, None)  # a load of a page below is moot: its page is quarantined too
        objects = self.groups.quarantined(victims) if self.groups else {}
        pages = tree.clear_devices(victims)
        self._quarantine(pages, objects)
        return len(pages)

    def _drop_failed_objects(self, nodes: list[PageNode]) -> None:
        """A failed load brought other groups' objects beside device pages it did not load (fills): the
        objects leave the tree into quarantine, the pages stay (their bytes were never touched)."""
        objects = self.groups.quarantined(nodes)
        if objects:
            self._quarantine([], objects)

    def _quarantine(self, pages: list[int], objects: dict[str, list[int]]) -> None:
        """A failed load's pages and objects into the quarantine, its generation mirrored in the plain
        attribute every commit reads (:attr:`load_failure_gen`)."""
        self.quarantine.add(pages, objects, self._last_op)
        self.load_failure_gen = self.quarantine.generation

    def insert(self, tokens_or_keys, device_pages: Sequence[int], groups: dict[str, Sequence[int | None]] | None = None, *,
               tenant: object = None) -> InsertResult:
        """Hand full pages to the cache: ``device_pages[i]`` holds page ``i`` of the request (``tenant``'s: :meth:`page_keys`).

        Ownership of every page in ``device_pages`` passes to the cache. Pages
        whose key is already on device are freed (``freed``); use
        ``device_pages`` of the result afterwards. Pages that are not the caller's
        to give (see :meth:`_check_caller_pages`) are refused, nothing changed.

        A hybrid model's other groups: ``groups[name][i]`` is the device id of page ``i``'s object
        of that group (a sliding-window page; a state group's snapshot at the end of page ``i``),
        or None where the caller keeps none. Objects the cache holds already are freed.
        """
        self.poll()
        keys = self._keys(tokens_or_keys, tenant)
        device_pages = checked_page_list(device_pages, self.dev_alloc.num_pages, pool=self.dev_alloc.name, side="device")
        if groups:
            self.groups.check_given(groups, len(keys))
        return self._insert(keys, device_pages, check=True, groups=groups)

    def commit_request(self, keys: list[PageHash], device_pages: list[int], prefix: list[PageNode] | None,
                       groups: dict[str, list[int | None]] | None = None, owner: int = 0) -> InsertResult:
        """:meth:`insert` for a :class:`~kvtier.core.request.CacheRequest`, which has proven (more strictly
        than insert's own check) that ``device_pages`` and ``groups`` are its own. ``prefix``: the nodes of
        its cached pages, locked since its match and so still exactly where they were, not looked up again.
        ``owner``: its tenant's id in the ledger (:mod:`kvtier.core.tenants`), whose its new pages are."""
        self.tree.current_owner = owner
        return self._insert(keys, device_pages, check=False, known=prefix, groups=groups)

    def _computed_under_prefetch(self, nodes: list[PageNode]) -> None:
        if self.config.write_policy == "write_through":
            self._backup(nodes)

    def _insert(self, keys: list[PageHash], device_pages: list[int], *, check: bool, known: list[PageNode] | None = None,
                groups: dict[str, Sequence[int | None]] | None = None) -> InsertResult:
        """``check=False``: the caller (a :class:`CacheRequest`) has proven the pages are its own.
        ``known``: the nodes of ``keys[:len(known)]``, on device in ``device_pages[:len(known)]`` and
        locked by the caller since its match (so still exactly there): not looked up again."""
        if len(device_pages) != len(keys):
            raise PageAlignmentError(
                f"insert into {self.dev_alloc.name}: {len(device_pages)} device pages for {len(keys)} full pages of keys "
                f"(page_size {self.spec.page_size}); pass exactly one page per full page, keep the partial tail page out"
            )
        tree = self.tree
        known = known or []
        start = len(known)
        for settled in (False, True):
            path = known + tree.walk(keys, start)  # cached already: a prefix, its leading part on device
            n_have = len(path)
            n_dev = tree.device_prefix(path)
            assert n_dev >= start and (not start or path[start - 1].device_page == device_pages[start - 1]), "a locked prefix moved"
            canonical = device_pages[:start] + list(map(device_page_of, path[start:n_dev]))
            if check:
                self._check_caller_pages(device_pages, canonical)  # before anything changes
            # a load in flight on the path: its outcome first (a failed one takes its pages off the path),
            # then the path again -- after the checks, so that misuse changes nothing
            if settled or not self._loading or not self._settle_loads(path):
                break
        freed: list[int] = []
        if canonical != device_pages[:n_dev]:  # the caller computed pages the cache already has
            freed = [p for p, c in zip(device_pages, canonical) if p != c]
        tree.set_device_run(path[n_dev:], device_pages[n_dev:n_have])
        canonical += device_pages[n_dev:]
        if self.groups.sharing:  # new nodes' window pages are stamped with them: after every page used so far
            tree.tick()
        fresh = tree.add_device_chain(keys[n_have:], device_pages[n_have:], path[-1] if path else None)
        last = fresh[-1] if fresh else (path[-1] if path else None)
        if last is not None:
            tree.touch((last,))
        gained: list[PageNode] = []
        if groups:  # before any backup below: it copies the objects its pages hold; as recent as they are
            gained = self.groups.attach(path + fresh, groups, len(path))
        if freed:
            self.dev_alloc.free(freed)
        st = self.stats
        st.inserted_pages += len(fresh)
        st.duplicate_pages += len(freed)
        if self.config.write_policy == "write_through":
            # every fresh node is due; the path usually has no page without a host copy (one C-level scan says)
            due = [n for n in path if n.host_page == NO_PAGE] if NO_PAGE in map(host_page_of, path) else []
            due += fresh
            if due:
                self._backup(due)
            if gained:  # objects new to pages whose host copies are made already: copied alone
                self._backup_objects([n for n in gained if n.host_page != NO_PAGE and n.host_ready])
        if self.tenants is not None:
            self.tenants.note_use(tree.now)
        return InsertResult(canonical, len(fresh), freed, last)

    def _check_caller_pages(self, pages: list[int], canonical: list[int]) -> None:
        """Every page handed to :meth:`insert` is the caller's: allocated, not held by the tree
        (except ``canonical[i]`` itself at place ``i``, the cached page the caller was given),
        and listed once. Raises :class:`PageOwnershipError` with nothing changed. Vectorized:
        this runs on every insert."""
        where = f"insert into {self.dev_alloc.name}"
        arr = np.asarray(pages, dtype=np.int64)
        if np.unique(arr).size != arr.size:
            raise PageOwnershipError(f"{where}: device page {first_duplicate(pages)} is listed twice; "
                                     "each page holds one page of the request")
        given = at_own_place(arr, canonical)
        held = (self._tree_owned[arr] != 0) & ~given
        if held.any():
            i = int(np.argmax(held))
            raise PageOwnershipError(
                f"{where}: device page {pages[i]} (place {i}) belongs to the cache, not the caller; "
                "pass the pages the match or load gave you, in order, and pages you allocated"
            )
        failed = self.quarantine.marks[arr] != 0
        if failed.any():
            i = int(np.argmax(failed))
            raise PageOwnershipError(
                f"{where}: device page {pages[i]} (place {i}) holds a host->device load that failed; "
                "its bytes are not the page's: recompute that page into a page from alloc_device"
            )
        foreign = (self._allocated[arr] == 0) & ~given
        if foreign.any():
            i = int(np.argmax(foreign))
            raise PageOwnershipError(
                f"{where}: device page {pages[i]} (place {i}) was never allocated; allocate pages with alloc_device before inserting them"
            )

    def _settle_loads(self, path: list[PageNode]) -> bool:
        """Wait for the host->device loads in flight on ``path`` (pages are inserted below a page only
        once its bytes are known good: a failed load takes its pages and everything below them off
        the device). True if there were any."""
        loading = self._loading
        ops = {loading[n] for n in path if n in loading}
        if ops:
            self.wait_for(ops)
        return bool(ops)

    def check_integrity(
        self, caller_device_pages: set[int] = frozenset(), caller_host_pages: set[int] = frozenset(), *, idle: bool = False,
        caller_group_pages: dict[str, set[int]] | None = None,
    ) -> None:
        """Prove the accounting: tree + caller-owned + free == total for each pool, no page owned twice.

        ``idle=True`` (no request holds a lock, :meth:`wait_idle` returned) also proves liveness:
        every cached page is evictable -- nothing locked, no host page that is not readable,
        no L3 save still marked in flight -- so the pools can never silently shrink."""
        self._check_host(caller_host_pages, idle)
        if self.groups:
            self.groups.check(caller_group_pages or {}, self.quarantine.objects(), idle)
        if idle:
            assert not self._loading, "idle, yet host->device loads are recorded in flight"
            assert not self.quarantine.entries, "idle, yet device pages of a failed load are still quarantined"
        dev_owned = [n.device_page for n in self.tree.nodes.values() if n.device_page != NO_PAGE]
        assert len(dev_owned) == len(set(dev_owned)), "a device page is owned by two nodes"
        assert not (set(dev_owned) & set(caller_device_pages)), "a device page is owned by the tree and the caller"
        quarantined = self.quarantine.pages()
        assert not (set(dev_owned) | set(caller_device_pages)) & quarantined, "a quarantined device page is in use"
        objects = self.groups.shared_ids(Tier.DEVICE, caller_group_pages, self.quarantine.objects())
        assert not objects & (set(dev_owned) | set(caller_device_pages) | quarantined), (
            "a device id is both a page's and another group's object")
        assert set(dev_owned) | set(caller_device_pages) | quarantined | objects == self.dev_alloc.allocated_pages() - (
            {0} if self.dev_alloc.reserve_padding_page else set()
        ), "device allocator and tree disagree (leak or foreign page)"
