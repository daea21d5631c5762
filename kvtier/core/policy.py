"""The policy core: what is cached where, decided without touching a byte.

It holds the page-keyed prefix index (:class:`~kvtier.radix.PrefixTree`) with
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

Request flow (:meth:`CacheCore.begin` does the first three steps; see :mod:`kvtier.request`)::

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

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.alloc import Allocation, PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.plans import Completion, CutShort, Done, Failed, Reason, Tier, completed_pages, copy_plan, fetch_plan, save_plan
from kvtier.errors import PageAlignmentError, PageOwnershipError
from kvtier.executors.port import ExecutorPort
from kvtier.hashing import Namespace, PageHash, page_keys
from kvtier.metrics import CacheStats
from kvtier.pages import at_own_place, checked_page_list, first_duplicate
from kvtier.radix import NO_PAGE, NOT_STORED, SAVING, STORED, PageNode, PrefixTree
from kvtier.request import CacheRequest
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatchResult:
    """Where a request's full-page prefix is cached.

    ``device_pages`` are usable now (after waiting on ``pending``, the ops of loads other
    requests started); ``host_nodes`` follow them and need :meth:`CacheCore.load_back`.
    """

    keys: list[PageHash]
    device_pages: list[int]
    host_nodes: tuple[PageNode, ...]
    last_node: PageNode | None
    pending: tuple[int, ...] = ()
    #: pages after the host run that the L3 store holds (prefetch them with :meth:`CacheCore.prefetch`)
    num_storage_pages: int = 0

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)

    @property
    def num_host_pages(self) -> int:
        return len(self.host_nodes)

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class LoadResult:
    """Result of :meth:`CacheCore.load_back`; ``loaded < requested`` when the device was full.

    ``op`` is this load's plan, ``pending`` the loads of other requests its device prefix waits on."""

    op: int | None
    device_pages: list[int]
    loaded: int
    requested: int
    pending: tuple[int, ...] = ()
    core: CacheCore | None = field(default=None, compare=False, repr=False)

    @property
    def ops(self) -> tuple[int, ...]:
        return self.pending + ((self.op,) if self.op is not None else ())

    def wait_layer(self, layer: int) -> None:
        """Layer ``layer`` of every page of the prefix is in place (the executor's per-layer wait)."""
        if self.core is not None:
            port = self.core.port
            for op in self.ops:
                port.wait_layer(op, layer)

    def wait(self) -> None:
        """Every load the prefix needs has finished (and its completion is applied)."""
        if self.core is not None and self.ops:
            self.core.wait_for(self.ops)


@dataclass(frozen=True)
class InsertResult:
    """``device_pages`` are the cache's pages for the inserted keys (use them from now on);
    ``freed`` are caller pages released because the key was already on device."""

    device_pages: list[int]
    new_pages: int
    freed: list[int]
    last_node: PageNode | None


@dataclass(eq=False)
class PrefetchHandle:
    """An L3 -> host prefetch in flight (plan ``op``); resolve it with :meth:`CacheCore.resolve_prefetch`."""

    nodes: list[PageNode]
    op: int = 0
    applied: int = 0

    @property
    def requested(self) -> int:
        return len(self.nodes)


# ---- what each plan is for: its tag, typed (completions dispatch on the type) ----
@dataclass(frozen=True, slots=True)
class JobTag:
    """The nodes a plan moves; the subclass says what for."""

    nodes: list[PageNode]


class Backup(JobTag):
    """device -> host copies of one path's nodes (write policies); applied by :meth:`CacheCore.poll`."""

    __slots__ = ()


class LoadBack(JobTag):
    """host -> device copies of a request's host run; applied by :meth:`CacheCore.poll`."""

    __slots__ = ()


class EvictionBackup(JobTag):
    """device -> host copies of eviction victims, waited for where they are made (poll ignores them)."""

    __slots__ = ()


class Save(JobTag):
    """host -> L3 writes of one path's ready host pages; applied by :meth:`CacheCore.poll`."""

    __slots__ = ()


class EvictionSave(JobTag):
    """host -> L3 writes of host eviction victims (write_back), waited for where they are made."""

    __slots__ = ()


@dataclass(frozen=True)
class EvictResult:
    requested: int
    evicted: int
    backed_up: int = 0
    dropped: int = 0


class CacheCore:
    """The policy over page ids (see the module docstring). ``device`` and ``host`` allocate the
    ids of the pools the executors hold; ``port`` carries plans to those executors."""

    def __init__(self, spec: KVSpec, device: PageAllocator, host: PageAllocator, port: ExecutorPort, config: CacheConfig = CacheConfig(),
                 storage_config: StorageConfig = StorageConfig(), *, namespace: Namespace | None = None, stats: CacheStats | None = None):
        self.spec = spec
        self.config = config
        self.storage_config = storage_config
        self.port = port
        self.namespace = namespace or Namespace("default", spec.fingerprint())
        self.root_key = self.namespace.root(config.hash_algo)
        self.stats = stats or CacheStats()
        self.dev_alloc = device
        self.host_alloc = host
        self.tree = PrefixTree(reserve=device.num_pages + host.num_pages if config.preallocate_nodes else 0, device_pages=device.num_pages)
        self._page_bytes = spec.page_bytes
        #: device pages whose host->device load is still in flight: node -> the load's op
        self._loading: dict[PageNode, int] = {}
        #: live views of who holds each device page (tree / allocator), for insert's ownership check
        self._tree_owned = np.frombuffer(self.tree.device_owned, dtype=np.uint8)
        self._allocated = self.dev_alloc.allocated_view()
        self._ops = itertools.count(1)
        #: plans in flight: op -> what for
        self._inflight: dict[int, JobTag | PrefetchHandle] = {}
        #: completions collected while waiting for one plan, applied at the next poll
        self._deferred: list[Completion] = []
        #: completion handlers, by the type of the plan's tag
        self._on = {Backup: self._finish_backup, LoadBack: self._finish_load, EvictionBackup: self._applied_where_waited,
                    Save: self._finish_save, EvictionSave: self._applied_where_waited, PrefetchHandle: self._finish_prefetch}

    @property
    def has_storage(self) -> bool:
        return self.port.has_storage

    # ---- keys ------------------------------------------------------------------
    def page_keys(self, token_ids: Sequence[int]) -> list[PageHash]:
        return page_keys(token_ids, self.spec.page_size, self.root_key, self.config.hash_algo)

    # ---- plans out, completions in -----------------------------------------------------
    def _submit(self, plan_of, tag: JobTag | PrefetchHandle, *args) -> int:
        op = next(self._ops)
        self._inflight[op] = tag
        self.port.submit(plan_of(op, *args))
        return op

    def poll(self) -> int:
        """Apply the completions of finished plans. Returns how many were applied."""
        done = self.port.poll()
        if self._deferred:
            done, self._deferred = self._deferred + done, []
        for c in done:
            self._apply(c)
        return len(done)

    def _apply(self, c: Completion) -> None:
        tag = self._inflight.pop(c.op)
        self._on[type(tag)](c, tag)

    def wait_for(self, ops) -> int:
        """Block until the plans ``ops`` finished, then apply every completion collected."""
        ops = [op for op in ops if op in self._inflight]
        done = self.port.wait(ops) if ops else self.port.poll()
        if self._deferred:
            done, self._deferred = self._deferred + done, []
        for c in done:
            self._apply(c)
        return len(done)

    def _await(self, op: int) -> Completion:
        """The completion of ``op``, waited for where the caller needs its outcome at once (eviction).
        Other completions that arrive meanwhile wait for the next poll: the caller is mid-decision."""
        mine = None
        others = []
        for c in self._deferred + self.port.wait((op,)):
            if c.op == op:
                mine = c
            else:
                others.append(c)
        self._deferred = others
        del self._inflight[op]
        assert mine is not None, f"executor reported no completion for plan {op}"
        return mine

    def _ops_for(self, *kinds: type) -> list[int]:
        return [op for op, tag in self._inflight.items() if type(tag) in kinds]

    @staticmethod
    def _applied_where_waited(_c, _tag) -> None:
        """Eviction copies and saves: the evicting call waited for them and applied them itself."""

    @staticmethod
    def _is_fault(c: Completion) -> bool:
        return type(c) is not Done and c.reason in (Reason.ERROR, Reason.CORRUPT)

    def _finish_backup(self, c: Completion, tag: Backup) -> None:
        nodes = tag.nodes
        tree = self.tree
        ok = type(c) is Done
        if ok:
            for n in nodes:
                n.host_ready = True
            self.stats.backed_up_pages += len(nodes)
            self.stats.backed_up_bytes += len(nodes) * self._page_bytes
        else:
            self.stats.transfer_failures += 1
            self.host_alloc.free([tree.clear_host(n) for n in nodes])
        tree.unlock(nodes[-1])
        if ok and self.port.has_storage and self.storage_config.write_policy == "write_through":
            self._save([n for n in nodes if n.stored == NOT_STORED])

    def _finish_load(self, c: Completion, tag: LoadBack) -> None:
        nodes = tag.nodes
        loading = self._loading
        for n in nodes:
            if loading.get(n) == c.op:
                del loading[n]
        if type(c) is not Done:  # the device copies are garbage: drop them, deepest first
            self.stats.transfer_failures += 1
            self.tree.unlock(nodes[-1])
            for n in reversed(nodes):
                if n.device_page != NO_PAGE and n.device_children == 0 and n.lock_ref == 0:
                    self.dev_alloc.free([self.tree.clear_device(n)])
            return
        self.stats.loaded_pages += len(nodes)
        self.stats.loaded_bytes += len(nodes) * self._page_bytes
        self.tree.unlock(nodes[-1])

    # ---- match -------------------------------------------------------------------
    def match(self, tokens_or_keys: Sequence[int] | list[PageHash], *, count: bool = True) -> MatchResult:
        """Longest cached prefix (full pages only); counts hits, may trigger selective backups.

        ``count=False`` re-matches a request already counted (e.g. after its prefetch) without
        touching hit counts or stats."""
        self.poll()
        keys = self._keys(tokens_or_keys)
        tree = self.tree
        path = tree.walk(keys)
        tree.touch(path)
        n_dev = tree.device_prefix(path)
        host_nodes = []
        for node in path[n_dev:]:
            if node.host_page == NO_PAGE or not node.host_ready:
                break
            host_nodes.append(node)
        matched = path[: n_dev + len(host_nodes)]
        pending: tuple[int, ...] = ()
        if self._loading:
            loading = self._loading
            pending = tuple(dict.fromkeys(op for op in (loading.get(n) for n in path[:n_dev]) if op is not None))
        if not count:
            return MatchResult(keys, [n.device_page for n in path[:n_dev]], tuple(host_nodes), matched[-1] if matched else None, pending)
        for node in matched:
            node.hit_count += 1
        st = self.stats
        st.requests += 1
        st.lookup_pages += len(keys)
        st.device_hit_pages += n_dev
        st.host_hit_pages += len(host_nodes)
        if self.config.write_policy == "write_through_selective":
            due = [n for n in path[:n_dev] if n.host_page == NO_PAGE and n.hit_count >= self.config.write_through_threshold]
            if due:
                self._backup(due)
        n_storage = 0
        if self.port.has_storage and len(matched) == len(path) < len(keys):
            n_storage = self.port.stored_prefix(keys[len(path) :])
            st.storage_hit_pages += n_storage
        return MatchResult(keys, [n.device_page for n in path[:n_dev]], tuple(host_nodes), matched[-1] if matched else None, pending, n_storage)

    def _keys(self, tokens_or_keys) -> list[PageHash]:
        if len(tokens_or_keys) and isinstance(tokens_or_keys[0], bytes):
            return list(tokens_or_keys)
        return self.page_keys(tokens_or_keys)

    # ---- the request protocol --------------------------------------------------------
    def begin(self, tokens_or_keys: Sequence[int] | list[PageHash], *, usable_pages: int | None = None,
              prefetch: bool = True, prefetch_policy: str | None = None) -> CacheRequest:
        """Start a request (see :mod:`kvtier.request`): match (counted once), lock, prefetch from L3
        when it can add pages the request will use (``usable_pages``, default all its full pages;
        ``prefetch_policy`` default: the storage config's), and start loading host pages back."""
        keys = self._keys(tokens_or_keys)
        want = len(keys) if usable_pages is None else min(usable_pages, len(keys))
        m = self.match(keys)
        self.lock(m.last_node)
        host_before = m.num_host_pages
        if prefetch and m.num_storage_pages and m.num_device_pages + m.num_host_pages < want:
            handle = self.prefetch(m)
            if handle is not None:
                self.resolve_prefetch(handle, prefetch_policy)
                again = self.match(keys, count=False)
                self.lock(again.last_node)
                self.unlock(m.last_node)
                m = again
        ld = self.load_back(m) if m.num_host_pages else LoadResult(None, list(m.device_pages), 0, 0, m.pending, self)
        host_hit = min(ld.loaded, host_before)
        return CacheRequest(self, keys, m.num_device_pages, host_hit, ld.loaded - host_hit, ld.device_pages, ld, m.last_node)

    # ---- locks -------------------------------------------------------------------
    def lock(self, node: PageNode | None) -> None:
        """Protect ``node`` and its ancestors from eviction until :meth:`unlock`."""
        self.tree.lock(node)

    def unlock(self, node: PageNode | None) -> None:
        self.tree.unlock(node)

    # ---- load back ---------------------------------------------------------------
    def load_back(self, match: MatchResult) -> LoadResult:
        """Allocate device pages for ``match.host_nodes`` and start their per-layer load.

        Loads as many leading host pages as the device can hold after eviction;
        the rest stay on host (``loaded < requested``), nothing is half-assigned.
        """
        self.poll()
        # the match may be stale: keep the leading run that still directly follows the device prefix
        valid: list[PageNode] = []
        for n in match.host_nodes:
            if n.device_page != NO_PAGE or n.host_page == NO_PAGE or not n.host_ready:
                break
            if (n.parent is not valid[-1]) if valid else (n.parent is not None and n.parent.device_page == NO_PAGE):
                break
            valid.append(n)
        prefix_pages = list(match.device_pages)
        if not valid:
            return LoadResult(None, prefix_pages, 0, len(match.host_nodes), match.pending, self)
        self.tree.lock(valid[-1])  # pins the matched path while we make room
        got = self.alloc_device(len(valid))
        if not got.ok:
            take = min(len(valid), self.dev_alloc.num_free)
            got = self.dev_alloc.alloc(take)
            self.stats.load_shortfall_pages += len(valid) - take
        self.tree.unlock(valid[-1])
        served = valid[: len(got.pages)]
        if not served:
            return LoadResult(None, prefix_pages, 0, len(match.host_nodes), match.pending, self)
        for n, page in zip(served, got.pages):
            self.tree.set_device(n, page)
        self.tree.touch(served)
        self.tree.lock(served[-1])  # released when the load completes (poll)
        op = self._submit(copy_plan, LoadBack(served), Tier.HOST, [n.host_page for n in served], Tier.DEVICE, got.pages)
        for n in served:
            self._loading[n] = op
        return LoadResult(op, prefix_pages + got.pages, len(served), len(match.host_nodes), match.pending, self)

    # ---- space -------------------------------------------------------------------
    def alloc_device(self, n: int) -> Allocation:
        """``n`` device pages, evicting LRU device pages if needed; ``ok`` False if impossible."""
        self.poll()
        got = self.dev_alloc.alloc(n)
        if got.ok:
            return got
        self.evict_device(n - self.dev_alloc.num_free)
        got = self.dev_alloc.alloc(n)
        if not got.ok and self.poll_inflight():
            # pages pinned only by transfers in flight: wait for them, then try once more
            self.evict_device(n - self.dev_alloc.num_free)
            got = self.dev_alloc.alloc(n)
        return got

    def poll_inflight(self) -> bool:
        """Wait for device<->host plans in flight and apply them; True if any finished."""
        return self.wait_for(self._ops_for(Backup, LoadBack)) > 0

    def free_device(self, pages: list[int]) -> None:
        """Return caller-owned device pages (e.g. a request's partial tail page)."""
        self.dev_alloc.free(pages)

    def _alloc_host(self, n: int) -> Allocation:
        got = self.host_alloc.alloc(n)
        if got.ok:
            return got
        self.evict_host(n - self.host_alloc.num_free)
        got = self.host_alloc.alloc(n)
        if not got.ok and self.port.has_storage:
            # host pages being saved to L3 (or fetched into) cannot go yet: wait for them, then try once more
            if self.wait_for(self._ops_for(Save, PrefetchHandle)) > 0:
                self.evict_host(n - self.host_alloc.num_free)
                got = self.host_alloc.alloc(n)
        return got

    # ---- insert ------------------------------------------------------------------
    def insert(self, tokens_or_keys, device_pages: Sequence[int]) -> InsertResult:
        """Hand full pages to the cache: ``device_pages[i]`` holds page ``i`` of the request.

        Ownership of every page in ``device_pages`` passes to the cache. Pages
        whose key is already on device are freed (``freed``); use
        ``device_pages`` of the result afterwards. Pages that are not the caller's
        to give (see :meth:`_check_caller_pages`) are refused, nothing changed.
        """
        self.poll()
        keys = self._keys(tokens_or_keys)
        device_pages = checked_page_list(device_pages, self.dev_alloc.num_pages, pool=self.dev_alloc.name, side="device")
        return self._insert(keys, device_pages, check=True)

    def _insert(self, keys: list[PageHash], device_pages: list[int], *, check: bool) -> InsertResult:
        """``check=False``: the caller (a :class:`CacheRequest`) has proven the pages are its own."""
        if len(device_pages) != len(keys):
            raise PageAlignmentError(
                f"insert into {self.dev_alloc.name}: {len(device_pages)} device pages for {len(keys)} full pages of keys "
                f"(page_size {self.spec.page_size}); pass exactly one page per full page, keep the partial tail page out"
            )
        tree = self.tree
        path = tree.walk(keys)  # cached already: a prefix, its leading part on device
        n_have = len(path)
        n_dev = tree.device_prefix(path)
        canonical = [n.device_page for n in path[:n_dev]]
        if check:
            self._check_caller_pages(device_pages, canonical)  # before anything changes
        freed: list[int] = []
        if canonical != device_pages[:n_dev]:  # the caller computed pages the cache already has
            freed = [p for p, c in zip(device_pages, canonical) if p != c]
        for node, page in zip(path[n_dev:], device_pages[n_dev:n_have]):
            tree.set_device(node, page)
        canonical += device_pages[n_dev:]
        fresh = tree.add_device_chain(keys[n_have:], device_pages[n_have:], path[-1] if path else None)
        last = fresh[-1] if fresh else (path[-1] if path else None)
        if freed:
            self.dev_alloc.free(freed)
        st = self.stats
        st.inserted_pages += len(fresh)
        st.duplicate_pages += len(freed)
        if last is not None:
            tree.touch((last,))
        if self.config.write_policy == "write_through":
            due = [n for n in itertools.chain(path, fresh) if n.host_page == NO_PAGE]
            if due:
                self._backup(due)
        return InsertResult(canonical, len(fresh), freed, last)

    def _check_caller_pages(self, pages: list[int], canonical: list[int]) -> None:
        """Every page handed to :meth:`insert` is the caller's: allocated, not held by the tree
        (except ``canonical[i]`` itself at place ``i``, the cached page the caller was given),
        and listed once. Raises :class:`PageOwnershipError` with nothing changed. Vectorized:
        this runs on every insert."""
        where = f"insert into {self.dev_alloc.name}"
        arr = np.asarray(pages, dtype=np.int64)
        if np.unique(arr).size != arr.size:
            raise PageOwnershipError(f"{where}: device page {first_duplicate(pages)} is listed twice; each page holds one page of the request")
        given = at_own_place(arr, canonical)
        held = (self._tree_owned[arr] != 0) & ~given
        if held.any():
            i = int(np.argmax(held))
            raise PageOwnershipError(f"{where}: device page {pages[i]} (place {i}) belongs to the cache, not the caller; "
                                     "pass the pages the match or load gave you, in order, and pages you allocated")
        foreign = (self._allocated[arr] == 0) & ~given
        if foreign.any():
            i = int(np.argmax(foreign))
            raise PageOwnershipError(f"{where}: device page {pages[i]} (place {i}) was never allocated; "
                                     "allocate pages with alloc_device before inserting them")

    # ---- backup ------------------------------------------------------------------
    def _backup(self, nodes: list[PageNode]) -> int:
        """Start async device->host backups of ``nodes`` (one root-to-leaf path). Returns pages started."""
        got = self._alloc_host(len(nodes))
        if not got.ok:
            take = min(len(nodes), self.host_alloc.num_free)
            self.stats.backup_skipped_pages += len(nodes) - take
            nodes = nodes[:take]
            got = self.host_alloc.alloc(take)
        if not nodes:
            return 0
        for n, page in zip(nodes, got.pages):
            self.tree.set_host(n, page, ready=False)
        self.tree.lock(nodes[-1])  # deepest: pins every node of the path until the bytes land
        self._submit(copy_plan, Backup(nodes), Tier.DEVICE, [n.device_page for n in nodes], Tier.HOST, got.pages)
        return len(nodes)

    # ---- L3 -------------------------------------------------------------------------
    def prefetch(self, match: MatchResult) -> PrefetchHandle | None:
        """Start bringing ``match``'s storage pages into host pages; ``None`` when skipped.

        New tree nodes are created at once with host pages in flight (not yet
        readable, locked); :meth:`resolve_prefetch` makes the arrived ones usable.
        """
        self.poll()
        n = match.num_storage_pages
        if not self.port.has_storage or n == 0:
            return None
        if n < self.storage_config.min_prefetch_pages:
            return None
        parent = match.last_node
        keys = match.keys[match.num_device_pages + match.num_host_pages :][:n]
        if (parent is not None and self.tree.nodes.get(parent.key) is not parent) or any(k in self.tree.nodes for k in keys[:1]):
            return None  # stale match: the tree changed under it
        if parent is not None:
            self.tree.lock(parent)
        got = self._alloc_host(n)
        if not got.ok:
            got = self.host_alloc.alloc(min(n, self.host_alloc.num_free))
        if parent is not None:
            self.tree.unlock(parent)
        keys = keys[: len(got.pages)]
        if not keys:
            return None
        nodes = []
        for key, page in zip(keys, got.pages):
            node = self.tree.add(key, parent)
            self.tree.set_host(node, page, ready=False)
            node.stored = STORED
            nodes.append(node)
            parent = node
        self.tree.touch(nodes)
        self.tree.lock(nodes[-1])  # released when the plan completes
        handle = PrefetchHandle(nodes)
        handle.op = self._submit(fetch_plan, handle, keys, got.pages)
        return handle

    def resolve_prefetch(self, handle: PrefetchHandle | None, policy: str | None = None) -> int:
        """Wait per ``policy`` (default: the storage config's), make arrived pages readable; returns pages usable."""
        if handle is None:
            return 0
        policy = policy or self.storage_config.prefetch_policy
        self.poll()
        if handle.op in self._inflight:  # unarrived pages are freed when it finishes
            self._apply_arrived(handle, self.port.settle(handle.op, policy, self.storage_config.prefetch_budget_s(handle.requested)))
            self.poll()
        return handle.applied

    def _apply_arrived(self, handle: PrefetchHandle, arrived: int) -> None:
        for node in handle.nodes[handle.applied : arrived]:
            node.host_ready = True
        if arrived > handle.applied:
            self.stats.storage_prefetched_pages += arrived - handle.applied
            self.stats.storage_prefetched_bytes += (arrived - handle.applied) * self._page_bytes
            handle.applied = arrived

    def _finish_prefetch(self, c: Completion, handle: PrefetchHandle) -> None:
        self._apply_arrived(handle, completed_pages(c, handle.requested))
        if type(c) is CutShort:
            self.stats.storage_corrupt_pages += c.corrupt
        if self._is_fault(c):
            self.stats.storage_failures += 1
        self.tree.unlock(handle.nodes[-1])
        # Pages that never arrived: their host page will never be readable, so it goes back now.
        # A node a request computed meanwhile (insert gave it a device page while the prefetch
        # was in flight) stays as a device page with no host copy -- evictable like any other,
        # and backed up under write_through; a node nobody built on is removed.
        computed: list[PageNode] = []
        for node in reversed(handle.nodes[handle.applied :]):  # deepest first
            if node.host_page != NO_PAGE and not node.host_ready:
                self.host_alloc.free([self.tree.clear_host(node)])
            if node.device_page != NO_PAGE:
                computed.append(node)
            elif not node.num_children and not node.lock_ref and node.host_page == NO_PAGE:
                self.tree.remove(node)
        if computed and self.config.write_policy == "write_through":
            self._backup(computed[::-1])  # a contiguous run of one path, root side first

    def _save(self, nodes: list[PageNode]) -> int | None:
        """Plan an L3 save of ready host pages on one root-to-leaf path; returns its op.

        No lock: ``SAVING`` keeps the host pages from being evicted while the
        executor reads them, and the device copies stay free to go. A save the
        executor skips (back-pressure) completes as Failed(SKIPPED): not stored."""
        if not self.port.has_storage or not nodes:
            return None
        for n in nodes:
            n.stored = SAVING
        return self._submit(save_plan, Save(nodes), [n.key for n in nodes], [n.host_page for n in nodes])

    def _apply_saved(self, c: Completion, nodes: list[PageNode]) -> None:
        """The leading pages the store holds now are STORED; the rest may be saved again later."""
        ok = completed_pages(c, len(nodes))
        for i, n in enumerate(nodes):
            n.stored = STORED if i < ok else NOT_STORED
        saved = ok - (c.existing if type(c) is not Failed else 0)
        self.stats.storage_saved_pages += saved
        self.stats.storage_saved_bytes += saved * self._page_bytes
        if self._is_fault(c):
            self.stats.storage_failures += 1

    def _finish_save(self, c: Completion, tag: Save) -> None:
        self._apply_saved(c, tag.nodes)

    # ---- eviction ----------------------------------------------------------------
    def evict_device(self, n: int) -> EvictResult:
        """Free at least ``n`` device pages if possible, LRU leaves first; locked pages are never touched.

        Rounds until enough is free or nothing moves: first pages whose host
        copy is ready (dropping the device copy costs nothing), then device-only
        pages, backed up to host first (``on_device_evict="backup"``) or dropped.
        """
        freed = backed = dropped = 0
        tree = self.tree
        while freed < n:
            before = freed
            cheap = tree.device_victims(n - freed, require_host_copy=True)
            self.dev_alloc.free([tree.clear_device(v) for v in cheap])
            freed += len(cheap)
            if freed < n:
                victims = tree.device_victims(n - freed)
                unbacked = [v for v in victims if v.host_page == NO_PAGE]
                if unbacked and self.config.on_device_evict == "backup":
                    backed += self._backup_for_eviction(unbacked)
                for v in victims:  # descendants before ancestors: each clear keeps residency prefix-closed
                    if v.device_children:  # a descendant could not leave (its backup failed): keep this one too
                        continue
                    if v.host_page != NO_PAGE and v.host_ready:
                        self.dev_alloc.free([tree.clear_device(v)])
                        freed += 1
                    elif v.host_page == NO_PAGE and v.num_children == 0:
                        self.dev_alloc.free([tree.clear_device(v)])
                        tree.remove(v)
                        dropped += 1
                        freed += 1
                    elif v.host_page == NO_PAGE and self._drop_with_host_subtree(v):
                        # no host copy could be made (drop policy, host full, failed copy), and host-only
                        # pages hang from it (a prefetch landed under it): they cannot outlive their prefix
                        dropped += 1
                        freed += 1
            if freed == before:
                break
        self.stats.device_evicted_pages += freed
        self.stats.dropped_pages += dropped
        return EvictResult(n, freed, backed, dropped)

    def _drop_with_host_subtree(self, v: PageNode) -> bool:
        """Drop device-only ``v`` and the host-only pages below it; False (nothing changed) while one
        of them is in use (locked, not yet readable, or being saved to L3)."""
        below = self.tree.descendants(v)
        if any(n.lock_ref or n.device_page != NO_PAGE or not n.host_ready or n.stored == SAVING for n in below):
            return False
        tree = self.tree
        host_pages = []
        for n in below:  # deepest first: each is a leaf when it goes
            host_pages.append(tree.clear_host(n))
            tree.remove(n)
        self.host_alloc.free(host_pages)
        self.stats.host_evicted_pages += len(host_pages)
        self.dev_alloc.free([tree.clear_device(v)])
        tree.remove(v)
        return True

    def _backup_for_eviction(self, victims: list[PageNode]) -> int:
        """Synchronous backup of eviction victims (write_back): they are freed right after."""
        got = self._alloc_host(len(victims))
        if not got.ok:
            got = self.host_alloc.alloc(min(len(victims), self.host_alloc.num_free))
        victims = victims[: len(got.pages)]
        if not victims:
            return 0
        for v, page in zip(victims, got.pages):  # victims are LRU-ordered, descendants first
            self.tree.set_host(v, page, ready=False)
            self.tree.lock(v)
        c = self._await(self._submit(copy_plan, EvictionBackup(victims), Tier.DEVICE, [v.device_page for v in victims], Tier.HOST, got.pages))
        for v in victims:
            self.tree.unlock(v)
        if type(c) is not Done:
            self.stats.transfer_failures += 1
            self.host_alloc.free([self.tree.clear_host(v) for v in victims])
            return 0
        for v in victims:
            v.host_ready = True
        self.stats.backed_up_pages += len(victims)
        self.stats.backed_up_bytes += len(victims) * self._page_bytes
        if self.port.has_storage and self.storage_config.write_policy == "write_through":
            self._save([v for v in victims if v.stored == NOT_STORED])  # every new host copy goes to L3
        return len(victims)

    def evict_host(self, n: int) -> EvictResult:
        """Free at least ``n`` host pages whose device copy is gone, LRU leaves first."""
        victims = self.tree.host_victims(n)
        if self.port.has_storage and self.storage_config.write_policy == "write_back":
            unsaved = [v for v in victims if v.stored == NOT_STORED]
            if unsaved:
                self._save_for_eviction(unsaved)
        pages = []
        for node in victims:  # leaves before their parents
            pages.append(self.tree.clear_host(node))
            self.tree.remove(node)
        self.host_alloc.free(pages)
        self.stats.host_evicted_pages += len(victims)
        return EvictResult(n, len(victims))

    def _save_for_eviction(self, victims: list[PageNode]) -> None:
        """write_back to L3: save victims synchronously before their host pages are freed.

        Victims are leaves of possibly different paths; a save that stops early leaves the
        rest unstored (they are freed all the same: write_back is best effort)."""
        for v in victims:
            v.stored = SAVING
        c = self._await(self._submit(save_plan, EvictionSave(victims), [v.key for v in victims], [v.host_page for v in victims]))
        self._apply_saved(c, victims)

    # ---- integrity & lifecycle ------------------------------------------------------
    def wait_idle(self) -> None:
        """Wait for every plan in flight (device/host and L3) and apply its completion, including
        the plans those completions start (a finished backup's write-through save)."""
        self.poll()
        while self._inflight:
            self.wait_for(list(self._inflight))

    def check_integrity(self, caller_device_pages: set[int] = frozenset(), caller_host_pages: set[int] = frozenset(), *, idle: bool = False) -> None:
        """Prove the accounting: tree + caller-owned + free == total for each pool, no page owned twice.

        ``idle=True`` (no request holds a lock, :meth:`wait_idle` returned) also proves liveness:
        every cached page is evictable -- nothing locked, no host page that is not readable,
        no L3 save still marked in flight -- so the pools can never silently shrink."""
        self.tree.check()
        if idle:
            assert not self._inflight and not self._deferred, f"idle, yet {len(self._inflight)} plans are in flight"
            assert not self._loading, "idle, yet host->device loads are recorded in flight"
            for n in self.tree.nodes.values():
                assert n.lock_ref == 0, f"idle, yet a node is locked ({n.lock_ref}): a lock or transfer completion was lost"
                assert n.host_page == NO_PAGE or n.host_ready, "idle, yet a host page is not readable: it could never be evicted or used"
                assert n.stored != SAVING, "idle, yet an L3 save is marked in flight: its host page could never be evicted"
        dev_owned = [n.device_page for n in self.tree.nodes.values() if n.device_page != NO_PAGE]
        host_owned = [n.host_page for n in self.tree.nodes.values() if n.host_page != NO_PAGE]
        assert len(dev_owned) == len(set(dev_owned)), "a device page is owned by two nodes"
        assert len(host_owned) == len(set(host_owned)), "a host page is owned by two nodes"
        assert not (set(dev_owned) & set(caller_device_pages)), "a device page is owned by the tree and the caller"
        assert set(dev_owned) | set(caller_device_pages) == self.dev_alloc.allocated_pages() - ({0} if self.dev_alloc.reserve_padding_page else set()), "device allocator and tree disagree (leak or foreign page)"
        assert set(host_owned) | set(caller_host_pages) == self.host_alloc.allocated_pages(), "host allocator and tree disagree (leak or foreign page)"

    def close(self) -> None:
        """Finish every plan in flight, then close the executor port."""
        try:
            self.wait_idle()
        finally:
            self.port.close()

    def __enter__(self) -> CacheCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
