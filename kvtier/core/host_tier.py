"""The host tier's policy and the L3 tier below it: host pages allocated and evicted, prefetched from L3
and saved to it.

Host eviction takes leaves whose device copy is gone, least recently used
first, saving them to L3 first under ``write_back``. Locked pages, pages not
yet readable and pages being saved are never taken. Whoever owns the device,
kvtier owns the host pool: both cores share this layer.

Prefetched pages become tree nodes at once, with host pages that are not yet
readable (locked until the fetch completes); :meth:`HostTier.resolve_prefetch`
waits as the prefetch policy says and makes the arrived ones readable, and
the fetch's completion frees what never arrived. A save marks its pages
``SAVING`` (so host eviction skips them while the executor reads them) and
its completion marks the leading pages the store now holds ``STORED``.
"""

from __future__ import annotations

from kvtier.alloc import Allocation
from kvtier.core.dispatch import PlanDispatch
from kvtier.core.plans import HOST, STORAGE, Completion, CutShort, Failed, Reason, Tier, completed_pages, fetch_plan, save_plan
from kvtier.core.results import EvictResult, MatchResult
from kvtier.core.tags import EvictionSave, PrefetchHandle, Save
from kvtier.radix import NO_PAGE, NOT_STORED, SAVING, STORED, PageNode, host_page_of


class HostTier(PlanDispatch):
    """Host pages and L3 (the layer above :class:`~kvtier.core.dispatch.PlanDispatch`)."""

    #: host pages and quotas per tenant (:mod:`kvtier.core.tenants`; set by :class:`~kvtier.core.base.CoreBase`)
    tenants = None
    #: while host room is made for a run of pages: their owners (None: the request's, the tree's current owner)
    _room_owners: frozenset[int] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._on |= {Save: self._finish_save, EvictionSave: self._applied_where_waited, PrefetchHandle: self._finish_prefetch}

    def prefetch(self, match: MatchResult) -> PrefetchHandle | None:
        """Start bringing ``match``'s storage pages into host pages; ``None`` when skipped.

        New tree nodes are created at once with host pages in flight (not yet
        readable, locked); :meth:`resolve_prefetch` makes the arrived ones usable.
        """
        self.poll()
        return self._prefetch(match)

    def _prefetch(self, match: MatchResult) -> PrefetchHandle | None:
        """:meth:`prefetch` inside a call that polled already (``begin``, a load: one poll per entry)."""
        n = match.num_storage_pages
        if not self.port.has_storage or n == 0:
            return None
        if n < self.storage_config.min_prefetch_pages:
            return None
        parent = match.last_node
        keys = match.keys[match.num_device_pages + match.num_host_pages :][:n]
        if (parent is not None and self.tree.nodes.get(parent.key) is not parent) or any(k in self.tree.nodes for k in keys[:1]):
            return None  # stale match: the tree changed under it
        self.tree.current_owner = match.owner  # (its pages are the matching request's, whoever asked since)
        if parent is not None:
            self.tree.lock(parent)
        pages = self._host_pages(n)
        if parent is not None:
            self.tree.unlock(parent)
        keys = keys[: len(pages)]
        if not keys:
            return None
        nodes = self.tree.add_host_chain(keys, pages, parent, ready=False, stored=STORED)
        self.tree.touch(nodes)
        self.tree.lock(nodes[-1])  # released when the plan completes
        handle = PrefetchHandle(nodes)
        groups = self.groups.prefetch_runs(len(match.nodes), nodes) if self.groups else ()
        handle.op = self._submit(fetch_plan, handle, keys, pages, groups)
        return handle

    def resolve_prefetch(self, handle: PrefetchHandle | None, policy: str | None = None) -> int:
        """Wait per ``policy`` (default: the storage config's), make arrived pages readable; returns pages usable."""
        if handle is None:
            return 0
        policy = policy or self.storage_config.prefetch_policy
        self.poll()
        if handle.op in self._inflight:
            self._apply_arrived(
                handle, self._ask(self.port.settle, handle.op, policy, self.storage_config.prefetch_budget_s(handle.requested))
            )
            self.poll()
            if handle.op in self._inflight:  # settled, the rest cancelled, yet a read is still running: give it up now
                self._give_up_prefetch(handle)
        return handle.applied

    def _give_up_prefetch(self, handle: PrefetchHandle) -> None:
        """The pages that did not arrive within the policy's budget are dropped now: the prefetch's lock
        is released at once (pages computed onto its nodes meanwhile stay evictable), its unarrived
        host pages are held until the read that may still land in them answers, and that late
        completion is discarded (:meth:`PlanDispatch._apply` releases the hold)."""
        del self._inflight[handle.op]
        held = [n.host_page for n in handle.nodes[handle.applied :] if n.host_page != NO_PAGE and not n.host_ready]
        self.host_alloc.hold(held)
        self._held_for[handle.op] = held
        self.groups.hold_late(handle.op, [n for n in handle.nodes[handle.applied :] if not n.host_ready])
        self.stats.prefetches_given_up += 1
        self.tree.unlock(handle.nodes[-1])
        self._drop_unarrived(handle)

    def _apply_arrived(self, handle: PrefetchHandle, arrived: int) -> None:
        self.tree.mark_host_ready(handle.nodes[handle.applied : arrived])
        if arrived > handle.applied:
            self.stats.storage_prefetched_pages += arrived - handle.applied
            self.stats.storage_prefetched_bytes += (arrived - handle.applied) * self._page_bytes
            handle.applied = arrived

    def _finish_prefetch(self, c: Completion, handle: PrefetchHandle) -> None:
        self._apply_arrived(handle, completed_pages(c, handle.requested))
        if type(c) is CutShort:
            self.stats.storage_corrupt_pages += c.corrupt
            if c.reason is Reason.CORRUPT:  # the lookup counted these pages as L3 hits: report what is not served
                self.stats.storage_corrupt_miss_pages += handle.requested - self._usable_arrived(handle)
        if self._is_fault(c):
            self.stats.storage_failures += 1
        if handle.then is not None and handle.applied:  # a copy still reads what arrived: its lock takes over
            self._fetched_for(handle.then, handle.nodes[handle.applied - 1])
        self.tree.unlock(handle.nodes[-1])
        self._drop_unarrived(handle)

    def _usable_arrived(self, handle: PrefetchHandle) -> int:
        """Of a prefetch's pages, those that arrived and a request can continue from (a hybrid model: as far as
        every group's objects are there, :meth:`~kvtier.core.group_objects.Groups.usable_arrived`)."""
        if not self.groups or not handle.applied:
            return handle.applied
        return self.groups.usable_arrived(handle.nodes[handle.applied - 1], handle.applied)

    def _computed_under_prefetch(self, nodes: list[PageNode]) -> None:
        """``nodes`` (one path's run, root side first) got device pages while a prefetch that gave them their
        host pages failed. Only a core whose tree holds device pages has any
        (:class:`~kvtier.core.cache_core.CacheCore` backs them up)."""

    def _fetched_for(self, load, node: PageNode) -> None:
        """A core whose copies follow its fetches (:class:`~kvtier.core.engine_device.EngineDeviceCore`)
        locks ``node`` -- the deepest page that arrived -- for the copy ``load``; others have none."""

    def _drop_unarrived(self, handle: PrefetchHandle) -> None:
        """Pages that never arrived: their host page will never be readable, so it goes back now.
        A node a request computed meanwhile (insert gave it a device page while the prefetch
        was in flight) stays as a device page with no host copy -- evictable like any other,
        and backed up under write_through; a node nobody built on is removed."""
        computed: list[PageNode] = []
        for node in reversed(handle.nodes[handle.applied :]):  # deepest first
            if node.host_page != NO_PAGE and not node.host_ready:
                self.groups.left(Tier.HOST, (node,))
                self.host_alloc.free([self.tree.clear_host(node)])
            if node.device_page != NO_PAGE:
                computed.append(node)
            elif not node.num_children and not node.lock_ref and node.host_page == NO_PAGE:
                self.tree.remove(node)
        if computed:
            self._computed_under_prefetch(computed[::-1])  # a contiguous run of one path, root side first

    def _save(self, nodes: list[PageNode], *, after: int = 0) -> int | None:
        """Plan an L3 save of ready host pages on one root-to-leaf path; returns its op.

        No lock: ``SAVING`` keeps the host pages from being evicted while the
        executor reads them, and the device copies stay free to go. A save the
        executor skips (back-pressure) completes as Failed(SKIPPED): not stored."""
        if not self.port.has_storage or not nodes:
            return None
        self.tree.set_stored(nodes, SAVING)
        groups = self.groups.runs(nodes, HOST, STORAGE) if self.groups else ()
        return self._submit(save_plan, Save(nodes), [n.key for n in nodes], list(map(host_page_of, nodes)), after, groups,
                            self._owner_tags(nodes))

    def _owner_tags(self, nodes: list[PageNode]) -> tuple[int, ...]:
        """The L3 owner tags of ``nodes``' pages (none without a tenants' ledger: every page the namespace's)."""
        if self.tenants is None:
            return ()
        tags = self.tenants.tags
        return tuple(tags[n.owner] for n in nodes)

    def _apply_saved(self, c: Completion, nodes: list[PageNode]) -> None:
        """The leading pages the store holds now are STORED; the rest may be saved again later."""
        ok = completed_pages(c, len(nodes))
        self.tree.set_stored(nodes[:ok], STORED)
        self.tree.set_stored(nodes[ok:], NOT_STORED)
        saved = ok - (c.existing if type(c) is not Failed else 0)
        self.stats.storage_saved_pages += saved
        self.stats.storage_saved_bytes += saved * self._page_bytes
        if self._is_fault(c):
            self.stats.storage_failures += 1

    def _finish_save(self, c: Completion, tag: Save) -> None:
        self._apply_saved(c, tag.nodes)

    def _save_for_eviction(self, victims: list[PageNode]) -> None:
        """write_back to L3: save victims synchronously before their host pages are freed.

        Victims are leaves of possibly different paths; a save that stops early leaves the
        rest unstored (they are freed all the same: write_back is best effort)."""
        self.tree.set_stored(victims, SAVING)
        groups = self.groups.runs(victims, Tier.HOST, Tier.STORAGE) if self.groups else ()
        c = self._await(self._submit(save_plan, EvictionSave(victims), [v.key for v in victims], [v.host_page for v in victims], 0, groups,
                                     self._owner_tags(victims)))
        self._apply_saved(c, victims)

    # ---- host pages ------------------------------------------------------------------------------
    def _host_pages(self, n: int, owner: int | None = None, *, owners: frozenset[int] | None = None) -> list[int]:
        """Up to ``n`` host pages for ``owner``'s pages (default: the request's, the tree's current owner), evicting
        as the tiers' LRU and the tenants' quotas allow: as many as could be had, the leading ones of a run.
        ``owners``: the pages are of several tenants, each within its cap already (:meth:`_within_caps`)."""
        if self.tenants is not None and owners is None:
            owner = self.tree.current_owner if owner is None else owner
            owners = frozenset((owner,))
            n = self._room_under_cap(owner, n)
            if not n:
                return []
        self._room_owners = owners
        try:
            got = self._alloc_host(n)
            if not got.ok:
                got = self.host_alloc.alloc(min(n, self.host_alloc.num_free))
        finally:
            self._room_owners = None
        return got.pages

    def _room_under_cap(self, owner: int, n: int) -> int:
        """How many of ``n`` more host pages ``owner`` may have: at its cap its own least recently used pages make room
        first, and what still does not fit gets none (counted)."""
        tenants = self.tenants
        over = tenants.over_cap(owner, n)
        if not over:
            return n
        self._evict_victims(self.tree.host_victims(over, allowed=lambda node: node.owner == owner))
        room = tenants.room_under_cap(owner)
        if room < n:
            tenants.count("capped_pages", owner, n - room)
        return min(n, room)

    def _within_caps(self, victims: list[PageNode]) -> list[PageNode]:
        """Of device eviction ``victims`` (descendants first) to back up to host, those their owners' caps let in:
        per owner, the ones nearest the root (a copy of a page whose parent gets none would be dropped with it)."""
        need: dict[int, int] = {}
        for v in victims:
            need[v.owner] = need.get(v.owner, 0) + 1
        cut = {o: k - self._room_under_cap(o, k) for o, k in need.items()}
        if not any(cut.values()):
            return victims
        kept = []
        for v in victims:
            if cut[v.owner]:
                cut[v.owner] -= 1
            else:
                kept.append(v)
        return kept

    def _alloc_host(self, n: int) -> Allocation:
        got = self.host_alloc.alloc(n)
        if got.ok:
            return got
        if self.groups.sharing:  # pages and window pages in one pool: weighed together
            self._make_room(Tier.HOST, n - self.host_alloc.num_free)
        else:
            self._evict_host_for_room(n - self.host_alloc.num_free)
        got = self.host_alloc.alloc(n)
        if not got.ok and self.port.has_storage and self.port.can_wait:
            # host pages being saved to L3 (or fetched into) cannot go yet: wait for them, then try once more
            # (a port that cannot wait -- a scheduler's workers answer next step -- gets fewer pages now)
            if self.wait_for(self._ops_for(Save, PrefetchHandle)) > 0:
                self._make_room(Tier.HOST, n - self.host_alloc.num_free)
                got = self.host_alloc.alloc(n)
        return got

    def _make_room(self, tier: Tier, n: int) -> None:
        """Free ``n`` ids of ``tier``'s pool. Here, the host pool's pages; a core that owns device pages, and
        pools shared with other groups' objects, weighs those too
        (:meth:`~kvtier.core.device_space.DeviceSpace._make_room`)."""
        assert tier is Tier.HOST, f"a core without device pages has no {tier.name.lower()} room to make"
        self._evict_host_for_room(n)

    def evict_host(self, n: int, older_than: int | None = None) -> EvictResult:
        """Free at least ``n`` host pages whose device copy is gone, LRU leaves first (``older_than``:
        only pages last used before that stamp). An operator's call: every tenant's pages may go (room made for a
        request's pages keeps other tenants' guaranteed shares, :meth:`_evict_host_for_room`)."""
        victims = self.tree.host_victims(n, older_than)
        self._evict_victims(victims)
        return EvictResult(n, len(victims))

    def _room_filter(self):
        """What room for the pages being placed may take (:meth:`~kvtier.core.tenants.TenantLedger.allowed_for` of their
        owners: another tenant's pages only above its guarantee); None without a ledger."""
        if self.tenants is None:
            return None
        return self.tenants.allowed_for(self.tree.current_owner if self._room_owners is None else self._room_owners)

    def _evict_host_for_room(self, n: int, older_than: int | None = None) -> EvictResult:
        """:meth:`evict_host` for room a request's pages need: no other tenant's guaranteed share is taken."""
        victims = self.tree.host_victims(n, older_than, self._room_filter())
        self._evict_victims(victims)
        return EvictResult(n, len(victims))

    def _evict_victims(self, victims: list[PageNode], *, save: bool = True) -> None:
        """Host eviction of ``victims`` (:meth:`~kvtier.radix.PrefixTree.host_victims`' answer), saved to L3 first
        under write_back when ``save``."""
        if not victims:
            return
        if self.on_host_evicted is not None:
            self.on_host_evicted([v.key for v in victims])
        if save and self.port.has_storage and self.storage_config.write_policy == "write_back":
            unsaved = self.tree.not_stored(victims)
            if unsaved:
                self._save_for_eviction(unsaved)
        if self.tenants is not None:
            self.tenants.count_nodes("evicted_pages" if save else "expired_pages", victims)
        self.stats.host_evicted_pages += self._forget_host_only(victims)

    def expire_host(self) -> int:
        """Host pages that outlived their tenant's ``ttl_s`` leave now (not written back to L3); returns how many.
        Every lookup calls it; a sweep runs at most every eighth of the shortest TTL."""
        tenants = self.tenants
        if tenants is None or not tenants.has_ttl:
            return 0
        due = tenants.expiry(self.tree.now)
        if due is None:
            return 0
        expired, before = due
        victims = self.tree.host_victims(len(self.tree.hosted), before, expired)
        self._evict_victims(victims, save=False)
        return len(victims)

    def _forget_host_only(self, nodes: list[PageNode]) -> int:
        """Remove host-only ``nodes`` (deepest first: each is a leaf when it goes) and free their host
        pages; returns how many."""
        if self.groups:
            self.groups.left(Tier.HOST, nodes)
        pages = self.tree.remove_host_only(nodes)
        self.host_alloc.free(pages)
        return len(pages)
