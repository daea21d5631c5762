"""The policy core for an engine that owns its device memory (vLLM): kvtier keeps host and L3.

vLLM keeps its own GPU blocks and its own device prefix cache; what it asks of
kvtier is the tiers below. :class:`EngineDeviceCore` is a sibling of
:class:`~kvtier.core.cache_core.CacheCore` on the same :class:`~kvtier.core.base.CoreBase`
-- one prefix tree, host LRU, L3 save and prefetch state, write policies -- with
three calls that name the *engine's* device blocks instead of pages of a device
pool kvtier allocates:

* :meth:`~EngineDeviceCore.lookup` -- leading pages on host, then in L3;
* :meth:`~EngineDeviceCore.offload` -- copy pages out of engine blocks into host
  pages (waited for: the engine may reuse its blocks on return), then write
  them through to L3;
* :meth:`~EngineDeviceCore.load_into` -- the leading available pages (host, then
  fetched from L3 per the prefetch policy) into engine blocks, layer by layer;
  their host pages stay locked until :meth:`~EngineDeviceCore.release`.

A core whose executors run elsewhere (a scheduler whose workers hold the
bytes) never waits: :meth:`~EngineDeviceCore.plan_load` plans the L3 fetch and
the copy into engine blocks together (the copy follows the fetch,
``Transfer.after``, and takes only what arrived), ``offload(wait=False)``
plans the copy out of engine blocks and its write-through save together, and
each outcome is applied when its completion comes back.

Hybrid models (``model=``, :mod:`~kvtier.core.group_objects`): the engine owns
every group's device blocks too, so the calls take them per group -- ``groups``
maps each non-full group to one engine id (or None) per page: a sliding-window
group's block of that page, a state group's slot holding the snapshot at the
page's end. kvtier keeps those objects on host and in L3 beside their pages
(ids of ``group_hosts``' allocators), a lookup offers the longest prefix every
group can continue from, a load copies the objects its boundary reads into the
engine's ids, and a copy out takes the objects the engine still has.

Nothing here holds a device page: tree nodes are host-only, and every copy is
a :class:`~kvtier.core.plans.Transfer` the executor runs against the engine's
tensors. Pages are whole by construction (keys name full pages, blocks are
page ids), so no partial page reaches a transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.base import CoreBase
from kvtier.core.group_objects import groups_for
from kvtier.core.plans import Completion, Done, GroupRun, Tier, copy_plan
from kvtier.core.port import ExecutorPort
from kvtier.core.results import MatchResult, Waiter
from kvtier.core.shared_host import NO_SHARED_HOST, SharedHost, check_shared_host
from kvtier.core.tags import GroupLoad, JobTag, PrefetchHandle
from kvtier.errors import PageAlignmentError, PageIndexError, PageOwnershipError
from kvtier.groups import ModelSpec
from kvtier.hashing import Namespace, PageHash
from kvtier.metrics import CacheStats
from kvtier.pages import first_duplicate
from kvtier.radix import NO_PAGE, PageNode
from kvtier.spec import KVSpec


@dataclass(frozen=True, slots=True)
class HostLookup:
    """Leading pages of a key list held on host, then (after those) in L3."""

    host_pages: int
    storage_pages: int
    #: the storage tier was asked (so when ``pages`` < the keys asked, key ``pages`` is not in L3)
    probed: bool = False
    #: a hybrid model: the KV group whose objects were missing where the full pages ran on (None: the
    #: full pages themselves are the limit)
    limited_by: str | None = None

    @property
    def pages(self) -> int:
        return self.host_pages + self.storage_pages


@dataclass(frozen=True, slots=True)
class OffloadResult:
    requested: int
    already_held: int
    saved: int
    #: pages not saved now: no host page could be freed (all locked or being saved to L3), or the
    #: prefix before them is still arriving; the engine may offer them again
    no_space: int
    #: pages whose device -> host copy failed (not cached)
    failed: int = 0
    #: the write-through L3 save of the saved pages, when one started
    l3_save_op: int | None = None
    #: ``wait=False``: the device -> host copy in flight (``saved`` pages count once it completes)
    copy_op: int | None = None
    #: ``wait=False``, a hybrid model: the copy of objects the engine has beside pages the cache held
    #: already without them (the engine keeps those blocks until it completes too)
    objects_op: int | None = None


@dataclass(eq=False)
class EngineLoad:
    """A load into engine blocks: the first ``loaded`` of ``requested`` pages are coming.

    ``wait_layer(i)`` blocks until layer ``i`` of those pages is in device memory.
    Pages ``loaded:`` were not available (evicted, missing or failed in L3) and must
    be recomputed by the engine. Hand it back with :meth:`EngineDeviceCore.release`.
    The core records what the load keeps (its locks, held objects, outcome) through
    its methods; nothing else writes them."""

    requested: int
    loaded: int
    from_host: int
    from_storage: int
    device_pages: list[int]
    op: int | None = None
    waiter: Waiter | None = field(default=None, repr=False)
    #: planned (:meth:`EngineDeviceCore.plan_load`): released when its completion is applied
    release_on_completion: bool = field(default=False, repr=False)
    #: the completion of the copy, once applied (None while in flight)
    outcome: Completion | None = field(default=None, repr=False)
    _locked: PageNode | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    #: a hybrid model: the nodes whose group objects the copy reads (held until it is released)
    _held: list[PageNode] = field(default_factory=list, repr=False)
    #: the deepest page a fetch before the copy brought, locked from the fetch's completion to the copy's
    _fetch_locked: PageNode | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """False when the copy failed: every page of this load must be recomputed."""
        return self.outcome is None or type(self.outcome) is Done

    @property
    def released(self) -> bool:
        return self._released

    def wait_layer(self, layer: int) -> None:
        if self.op is not None and self.waiter is not None:
            self.waiter.wait_layer(self.op, layer)

    def finished(self, outcome: Completion) -> bool:
        """The copy's completion; True when the load releases itself now (a planned one)."""
        self.outcome = outcome
        return self.release_on_completion and self.mark_released()

    def mark_released(self) -> bool:
        """True the first time (the caller then hands back what the load keeps), False after."""
        if self._released:
            return False
        self._released = True
        return True

    def keep_fetched(self, node: PageNode) -> bool:
        """The fetch before the copy completed and ``node``, its deepest page, is locked for the copy: kept
        until the load is released. False when it is released already (the caller unlocks it at once)."""
        if self._released:
            return False
        self._fetch_locked = node
        return True

    def hand_back(self) -> tuple[PageNode | None, PageNode | None, list[PageNode]]:
        """What the load keeps -- its lock, the fetch's lock, its held objects' nodes --, handed back once."""
        out = (self._locked, self._fetch_locked, self._held)
        self._locked = self._fetch_locked = None
        self._held = []
        return out


class OffloadCopy(JobTag):
    """engine device blocks -> host pages, waited for where it is planned (the engine reuses its blocks)."""

    __slots__ = ()


class VoidSave(JobTag):
    """A write-through save planned behind a copy that failed: its pages are gone, its outcome is ignored."""

    __slots__ = ()


class IntoEngine(JobTag):
    """host pages -> engine device blocks; the nodes stay locked by ``load`` until it is released.
    ``groups``: how many objects of each other group it brings."""

    __slots__ = ("load", "groups")

    def __init__(self, nodes: list[PageNode], load: EngineLoad, groups: tuple[GroupLoad, ...] = ()):
        self.nodes = nodes
        self.load = load
        self.groups = groups


class EngineDeviceCore(CoreBase):
    """See the module docstring: ``host`` allocates the ids of the host pool the executors hold;
    the engine allocates its device blocks itself. ``model``: a hybrid model whose full group is
    ``spec``; ``group_hosts``: each other group's host allocator; ``state_every``: the cadence
    of state snapshots, in pages; ``shared_host``: a host tier other engines share
    (:mod:`~kvtier.core.shared_host`, ``host`` its allocator, ``group_hosts`` its object pools' for a hybrid
    model; no L3): a lookup whose tree ends early asks it for the rest, a completed copy out is published to it."""

    def __init__(self, spec: KVSpec, host: PageAllocator, port: ExecutorPort, config: CacheConfig = CacheConfig(),
                 storage_config: StorageConfig = StorageConfig(), *, namespace: Namespace | None = None, stats: CacheStats | None = None,
                 model: ModelSpec | None = None, group_hosts: dict[str, PageAllocator] | None = None, state_every: int = 1,
                 shared_host: SharedHost = NO_SHARED_HOST):
        check_shared_host(shared_host, model, port, hybrid=True)
        super().__init__(spec, host, port, config, storage_config, namespace=namespace, stats=stats)
        self._share_host(shared_host)
        pools = {name: (None, alloc) for name, alloc in (group_hosts or {}).items()}
        self.groups = groups_for(model, pools, spec, tree=self.tree, state_every=state_every, device=None, host=host)
        if shared_host and self.groups:
            self.groups.check_shared()
        self._on |= {OffloadCopy: self._offloaded, IntoEngine: self._finish_into_engine, VoidSave: self._applied_where_waited}
        #: planned offload copy -> the write-through save that follows it
        self._save_after: dict[int, int] = {}

    def check_integrity(self, caller_host_pages: set[int] = frozenset(), *, idle: bool = False) -> None:
        """Prove the accounting: tree + caller-owned + free == total for the host pool, no page owned
        twice, no node with a device page (the engine's blocks are not the tree's); ``idle=True``
        also proves every cached page is evictable."""
        self._check_host(caller_host_pages, idle)
        assert all(n.device_page == NO_PAGE for n in self.tree.nodes.values()), "a node holds a device page in an engine-device core"
        if self.groups:
            self.groups.check({}, {}, idle)

    # ---- queries ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[PageHash], *, shared: bool = True) -> HostLookup:
        """Leading pages of ``keys`` a load can bring: readable host pages, then what L3 holds after them
        (a hybrid model: the longest prefix every group can continue from). ``shared=False``: the shared
        host tier is not asked (:meth:`prefetch_shared` asked it for these keys already)."""
        self.poll()
        if self.tenants is not None:
            self.expire_host()
        path, host, stored, limited_by, probed = self._usable(list(keys), shared, count=True)
        self.tree.touch(path[:host])
        st = self.stats
        st.requests += 1
        st.lookup_pages += len(keys)
        st.host_hit_pages += host
        st.storage_hit_pages += stored
        if limited_by is not None:
            self.groups.component(limited_by).limited += 1
        if self.tenants is not None:
            self.tenants.looked_up(self.tree.current_owner, len(keys), host + stored, self.tree.now)
        return HostLookup(host, stored, probed, limited_by)

    def _usable(self, keys: list[PageHash], shared: bool = True, count: bool = False) -> tuple[list[PageNode], int, int, str | None, bool]:
        """(the tree's path of ``keys``, leading pages usable from host, pages after them usable from L3,
        the group that cut the host prefix short, whether L3 was asked). L3 is asked only where every
        page of the path is readable on host; a hybrid model's prefix from L3 needs every group's
        objects, in the tree before the path's end, in L3 after it. A prefix shorter than ``min_hit_tokens``
        is none (``count``: the lookup counts it)."""
        if not self.shared_host:
            path = self.tree.walk(keys)
        elif shared:
            path = self._shared_walk(keys, None)
        else:  # (a lost region's pages are forgotten as a walk that asks would forget them: never offered)
            self._forget_if_lost()
            path = self.tree.walk(keys)
        host = self.tree.readable_host_run(path)
        limited_by = None
        usable = host
        if self.groups:
            hybrid = self.groups.prefix(path, 0, host)
            usable, limited_by = hybrid.pages, hybrid.limited_by
        probed = self.port.has_storage and host == len(path) < len(keys)
        stored = self._ask(self.port.stored_prefix, keys[host:]) if probed else 0
        if stored and self.groups:
            stored = self.groups.stored_usable(path, 0, keys[: host + stored], stored, self._stored_prefix)
        if self.min_hit_pages and 0 < (host + stored if stored else usable) < self.min_hit_pages:
            self.stats.hits_below_minimum += count  # (shorter than a hit may be: a miss, recomputed)
            return path, 0, 0, None, probed
        if stored:
            return path, host, stored, None, probed
        return path, usable, 0, limited_by, probed

    def _may_adopt_below(self, path: list[PageNode]) -> bool:
        """Only below readable pages: a copy out still in flight that fails takes its pages with it, and
        nothing may hang below them then."""
        return self.tree.readable_host_run(path) == len(path)

    def holds(self, key: PageHash) -> bool:
        node = self.tree.nodes.get(key)
        return node is not None and node.host_page != NO_PAGE and node.host_ready

    # ---- engine device -> host -> L3 ----------------------------------------------------------
    def offload(self, keys: Sequence[PageHash], engine_pages: Sequence[int], *, wait: bool = True,
                groups: dict[str, Sequence[int | None]] | None = None) -> OffloadResult:
        """Copy the pages of ``keys`` the cache does not hold yet out of ``engine_pages[i]`` (all layers)
        into host pages, then write them through to L3 (in the background). ``groups`` (a hybrid
        model): per other group, the engine's id of each page's object, or None where it has none
        (a sliding-window block that left the window); the objects of the new pages go with them.

        ``wait=True``: returns once the copy landed (the engine may reuse its blocks). ``wait=False``:
        returns at once with the copy's ``op``; the pages count as cached when it completes (a
        scheduler whose workers copy reports that later), and until then the engine must keep
        its blocks. Either way a failed copy leaves nothing cached."""
        if len(keys) != len(engine_pages):
            raise PageAlignmentError(f"offload: {len(keys)} page keys but {len(engine_pages)} device pages; pass one device page per key")
        self._check_engine_groups("offload", groups, len(keys))
        self.poll()
        keys, tree = list(keys), self.tree
        path = tree.walk(keys)
        have = len(path)
        want = len(keys) - have
        if self.tree.readable_host_run(path) < have:
            # part of the prefix is still arriving (a copy or a prefetch in flight): pages hang only
            # below readable ones, so that a copy that fails never strands pages below it
            return OffloadResult(len(keys), have, 0, want)
        objects_op = None
        if groups and self.groups and have:  # objects the engine has beside pages held without them
            sources = {name: {path[i]: ids[i] for i in range(have) if ids[i] is not None} for name, ids in groups.items()}
            objects_op = self._backup_objects(path, sources)
            if objects_op is not None and wait:  # (applied through its handler: the nodes are unpinned there)
                self.wait_for((objects_op,))
                objects_op = None
        if path:
            tree.lock(path[-1])  # room for the new pages must not come from this prefix's own pages
        try:
            pages = self._host_pages(want)
        finally:
            if path:
                tree.unlock(path[-1])
        n = len(pages)
        failed, save_op = 0, None
        if n:
            nodes = tree.add_host_chain(keys[have : have + n], pages, path[-1] if path else None, ready=False)
            tree.lock(nodes[-1])  # released when the copy completes
            tree.touch(path + nodes)
            if self.tenants is not None:
                self.tenants.note_use(tree.now)
            tag = OffloadCopy(nodes)
            runs = self._objects_out(nodes, groups, have) if groups and self.groups else ()
            op = self._submit(copy_plan, tag, Tier.DEVICE, list(engine_pages[have : have + n]), Tier.HOST, pages, 0, runs)
            if not wait:  # the engine keeps its blocks until this op completes (a connector's get_finished)
                if self.port.has_storage and self.storage_config.write_policy == "write_through":
                    # planned now, behind the copy: an executor elsewhere gets both in one batch
                    save_op = self._save(nodes, after=op)
                    if save_op is not None:
                        self._save_after[op] = save_op
                return OffloadResult(len(keys), have, n, want - n, 0, save_op, op, objects_op)
            c = self._await(op)
            save_op = self._offloaded(c, tag)
            if type(c) is not Done:
                failed, n = n, 0
        elif path:
            tree.touch(path)
        return OffloadResult(len(keys), have, n, want - n - failed, failed, save_op, None, objects_op)

    def _offloaded(self, c: Completion, tag: OffloadCopy) -> int | None:
        """The copy out of engine blocks completed: the pages are cached (and written through to L3,
        returning that save's op), or, if it failed, gone."""
        nodes, tree = tag.nodes, self.tree
        tree.unlock(nodes[-1])
        chained = self._save_after.pop(c.op, None)
        if type(c) is Done:
            self._backed_up(nodes)
            self.stats.inserted_pages += len(nodes)
            if chained is None and self.port.has_storage and self.storage_config.write_policy == "write_through":
                return self._save(nodes)
            return chained
        self.stats.transfer_failures += 1
        if chained is not None and chained in self._inflight:  # the executor skips it; its pages go now
            self._inflight[chained] = VoidSave([])
        self._forget_host_only(nodes[::-1])  # nothing can hang below pages that were never readable
        return None

    def _check_engine_groups(self, call: str, groups: dict[str, Sequence[int | None]] | None, num_pages: int) -> None:
        """The engine's per-group ids, before anything changes: known groups, one entry per page, ids
        that are whole numbers >= 0 or None."""
        for name, ids in (groups or {}).items():
            self.groups.component(name)
            if not isinstance(ids, (list, tuple)) or len(ids) != num_pages:
                raise PageAlignmentError(f"{call}, KV group {name!r}: pass one engine id (or None) per page ({num_pages}), got "
                                         f"{len(ids) if isinstance(ids, (list, tuple)) else type(ids).__name__}")
            bad = next((i for i in ids if i is not None and (type(i) is not int or i < 0)), None)
            if bad is not None:
                raise PageIndexError(f"{call}, KV group {name!r}: {bad!r} is not an engine id (a whole number >= 0, or None)")

    def _objects_out(self, nodes: list[PageNode], groups: dict[str, Sequence[int | None]], first: int) -> tuple[GroupRun, ...]:
        """The objects of new ``nodes`` (pages ``first:`` of the call) the engine has, each given a host
        id of its group (as many as its pool can give) and attached now: they are readable when
        their pages are, and leave with them if the copy fails."""
        runs = []
        for c in self.groups.components:
            ids = groups.get(c.name)
            if ids is None:
                continue
            at = [j for j in range(len(nodes)) if ids[first + j] is not None]
            got = self.groups.alloc(c, Tier.HOST, len(at)) if at else []
            at = at[: len(got)]
            if not at:
                continue
            host = c.at[Tier.HOST]
            host.update(zip((nodes[j] for j in at), got))
            c.note(Tier.HOST, [nodes[j] for j in at])
            c.backed_up += len(at)
            runs.append(GroupRun(c.name, tuple(at), tuple(ids[first + j] for j in at), tuple(got)))
        return tuple(runs)

    def _objects_in(self, nodes: list[PageNode], groups: dict[str, Sequence[int | None]] | None,
                    first: int) -> tuple[int, tuple[GroupRun, ...], list[PageNode]]:
        """A hybrid load of ``nodes`` into the engine, whose own blocks hold pages ``:first``: the
        largest boundary ``d <= len(nodes)`` every group can continue from -- its objects on host (or
        arriving with the fetch), and an engine id for each one after ``first`` -- and the runs that
        copy those objects into the engine's ids (places counted from ``first``), and the nodes they
        hang on, held until the load is released. Without groups: every node, no runs."""
        groups_part = self.groups
        if not groups_part:
            return len(nodes), (), []
        groups = groups or {}
        none = [None] * len(nodes)
        in_tree = groups_part.tree_has(nodes, 0)  # (readable on host: an object still being copied there is not)
        has = {c.name: lambda p, ids=groups.get(c.name) or none, there=in_tree[c.name]: p < first or (ids[p] is not None and there(p))
               for c in groups_part.components}
        d = groups_part.usable(len(nodes), has)
        if d <= first:
            return d, (), []
        runs, held = [], {}
        for c in groups_part.components:
            ids, at = groups[c.name], c.at[Tier.HOST]
            places = [i for i in c.kind.places(d) if i >= first]
            if places:
                runs.append(GroupRun(c.name, tuple(i - first for i in places), tuple(at[nodes[i]] for i in places),
                                     tuple(ids[i] for i in places)))
                held.update(dict.fromkeys(nodes[i] for i in places))
        groups_part.hold(list(held))
        return d, tuple(runs), list(held)

    # ---- L3 -> host -> engine device ----------------------------------------------------------
    def _start_load(self, keys: Sequence[PageHash], engine_pages: Sequence[int], groups: dict[str, Sequence[int | None]] | None):
        """Both loads' start: lock the host-ready prefix of ``keys`` and, when the store holds what follows
        it, start fetching that into new host pages. Returns (keys, path, pages usable from host, the
        locked node, the prefetch handle or None)."""
        if len(keys) != len(engine_pages):
            raise PageAlignmentError(f"load: {len(keys)} page keys but {len(engine_pages)} device pages; pass one device page per key")
        self._check_engine_groups("load", groups, len(keys))
        _check_load_targets(engine_pages, groups)
        self.poll()
        keys = list(keys)
        path, host, stored, _, _ = self._usable(keys)
        run = self.tree.readable_host_run(path)
        locked = path[run - 1] if run else None
        self.tree.lock(locked)
        handle = None
        if stored >= max(1, self.storage_config.min_prefetch_pages):  # (L3 counts only after every path page: host == run)
            handle = self._prefetch(MatchResult(keys, [], path, (), stored, owner=self.tree.current_owner))
        return keys, path, host, locked, handle

    def _engine_load(self, keys: list[PageHash], engine_pages: Sequence[int], nodes: list[PageNode], host: int, first: int,
                     groups: dict[str, Sequence[int | None]] | None, locked: PageNode | None, planned: bool,
                     handle: PrefetchHandle | None = None) -> EngineLoad:
        """The copy of ``nodes`` (a hybrid model: as far as every group can continue) into the engine."""
        n, runs, held = self._objects_in(nodes, groups, first)
        nodes = nodes[:n]
        load = EngineLoad(len(keys), n, min(host, n), max(0, n - host), list(engine_pages[first:n]), waiter=self,
                          release_on_completion=planned, _locked=locked, _held=held)
        if n:
            self.tree.touch(nodes)
        if n > first:
            tag = IntoEngine(nodes[first:], load, tuple(GroupLoad(run.group, len(run.at)) for run in runs))
            load.op = self._submit(copy_plan, tag, Tier.HOST, [node.host_page for node in nodes[first:]],
                                   Tier.DEVICE, list(engine_pages[first:n]), handle.op if handle is not None else 0, runs)
            if handle is not None:  # the pages it fetches stay locked for this copy once they arrived
                handle.then = load
        elif planned:
            self.release(load)  # (a fetch planned anyway still lands in host pages for later requests)
        self.stats.load_shortfall_pages += len(keys) - n
        return load

    def load_into(self, keys: Sequence[PageHash], engine_pages: Sequence[int], *,
                  groups: dict[str, Sequence[int | None]] | None = None) -> EngineLoad:
        """Bring the leading available pages of ``keys`` into ``engine_pages``, layer by layer: those on
        host, then those the store holds (prefetched per the storage config's policy). ``groups`` (a
        hybrid model): per other group, the engine's id of each page's object, or None."""
        keys, path, host, locked, handle = self._start_load(keys, engine_pages, groups)
        tree = self.tree
        n = host
        if handle is not None:
            self.resolve_prefetch(handle)
            path = tree.walk(keys)
            arrived = tree.readable_host_run(path)
            if arrived > host:
                tree.lock(path[arrived - 1])
                tree.unlock(locked)
                locked, n = path[arrived - 1], arrived
        if self.min_hit_pages and 0 < n < self.min_hit_pages:
            # what arrived is shorter than the minimum (L3 pages that made it up were not fetched, or came back short)
            self.stats.hits_below_minimum += 1
            n = 0
        return self._engine_load(keys, engine_pages, path[:n], host, 0, groups, locked, planned=False)

    def plan_load(self, keys: Sequence[PageHash], engine_pages: Sequence[int], *, first: int = 0,
                  groups: dict[str, Sequence[int | None]] | None = None) -> EngineLoad:
        """:meth:`load_into` for a core whose executors run elsewhere: nothing waits.

        The host pages ready now and the pages the store holds (fetched into new host pages,
        :meth:`prefetch`) are copied into ``engine_pages`` by one plan that follows the fetch: the
        executor copies what arrived and completes the copy cut short at the first page that did
        not, and the engine recomputes from there. The host pages stay locked until the copy's
        completion is applied; then the load releases itself. ``first``: the engine already holds
        the first pages (its own prefix cache); only pages ``first:`` are copied. ``groups``: as
        for :meth:`load_into`; the ids at pages before ``first`` are the engine's own objects."""
        keys, path, host, locked, handle = self._start_load(keys, engine_pages, groups)
        nodes = path[:host]
        if handle is not None:  # its own lock holds the fetched pages until the fetch completes, the copy's after that
            nodes = nodes + handle.nodes
        return self._engine_load(keys, engine_pages, nodes, host, first, groups, locked, planned=True, handle=handle)

    def _finish_into_engine(self, c: Completion, tag: IntoEngine) -> None:
        if tag.groups:  # (a copy cut short counts as failed, as its pages do)
            self.groups.count_loads(tag.groups, type(c) is Done)
        if type(c) is Done:
            self.stats.loaded_pages += len(tag.nodes)
            self.stats.loaded_bytes += len(tag.nodes) * self._page_bytes
        else:
            self.stats.transfer_failures += 1
        if tag.load.finished(c):
            self._unlock_load(tag.load)

    def release(self, load: EngineLoad) -> None:
        """Wait for ``load``'s copy to land, then unlock its host pages. Idempotent."""
        if not load.mark_released():
            return
        try:
            if load.op is not None and load.op in self._inflight:
                self.wait_for((load.op,))
        finally:
            self._unlock_load(load)

    def _fetched_for(self, load: EngineLoad, node: PageNode) -> None:
        self.tree.lock(node)
        if not load.keep_fetched(node):
            self.tree.unlock(node)

    def _unlock_load(self, load: EngineLoad) -> None:
        locked, fetch_locked, held = load.hand_back()
        self.tree.unlock(locked)
        self.tree.unlock(fetch_locked)
        if held:
            self.groups.release(held)


def _check_load_targets(engine_pages: Sequence[int], groups: dict[str, Sequence[int | None]] | None) -> None:
    """A load's engine ids name each destination once: an engine block per page, an id per object of a
    group (two copies into one would race for it, as a plan's would, :func:`~kvtier.core.plans.plan_error`).
    Raises :class:`PageOwnershipError` before the core changes anything."""
    twice = first_duplicate(engine_pages)
    if twice is not None:
        raise PageOwnershipError(f"load: engine block {twice} is named for two pages; each page lands in a block of its own")
    for name, ids in (groups or {}).items():
        twice = first_duplicate([i for i in ids if i is not None])
        if twice is not None:
            raise PageOwnershipError(f"load, KV group {name!r}: engine id {twice} is named for two objects; each object lands in "
                                     "an id of its own")
