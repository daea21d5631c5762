"""Device pages kvtier owns: page ids for requests, backups to host, device eviction.

Device eviction takes LRU leaves: first pages whose host copy is ready (free to
drop), then device-only pages, backed up to host first (``on_device_evict=
"backup"``) or dropped; a device-only page with host-only pages below it that
can get no host copy leaves with them. Locked pages and pages in flight are
never taken. (Host eviction, which both cores share: :mod:`~kvtier.core.host_tier`.)
"""

from __future__ import annotations

from kvtier.alloc import Allocation, PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.base import CoreBase
from kvtier.core.plans import DEVICE, HOST, Completion, Done, Tier, copy_plan
from kvtier.core.port import ExecutorPort
from kvtier.core.results import EvictResult
from kvtier.core.tags import Backup, EvictionBackup, GroupBackup, LoadBack, Save
from kvtier.hashing import Namespace
from kvtier.metrics import CacheStats
from kvtier.radix import NO_PAGE, SAVING, PageNode, device_page_of
from kvtier.spec import KVSpec


class _Leaving:
    """Device eviction victims decided but not yet cleared, so that a round frees its pages in one
    call: the tree still counts them as children, so the counts of what is leaving come along."""

    __slots__ = ("leaving", "gone", "device_children", "children_gone")

    def __init__(self) -> None:
        self.leaving: list[PageNode] = []  # off the device, in victim order (descendants first)
        self.gone: list[PageNode] = []  # of those, the ones that leave the tree
        self.device_children: dict[PageNode | None, int] = {}  # parent -> its children in ``leaving``
        self.children_gone: dict[PageNode | None, int] = {}  # parent -> its children in ``gone``

    def add(self, node: PageNode, *, gone: bool) -> None:
        self.leaving.append(node)
        parent = node.parent
        self.device_children[parent] = self.device_children.get(parent, 0) + 1
        if gone:
            self.gone.append(node)
            self.children_gone[parent] = self.children_gone.get(parent, 0) + 1


class DeviceSpace(CoreBase):
    """Device allocation, backups and device eviction: the layer of :class:`~kvtier.core.cache_core.CacheCore`
    above :class:`~kvtier.core.base.CoreBase`. ``device`` allocates the ids of the device pool the
    executors hold."""

    def __init__(self, spec: KVSpec, device: PageAllocator, host: PageAllocator, port: ExecutorPort, config: CacheConfig,
                 storage_config: StorageConfig, *, namespace: Namespace | None, stats: CacheStats | None):
        super().__init__(spec, host, port, config, storage_config, namespace=namespace, stats=stats, device_pages=device.num_pages)
        self.dev_alloc = device
        #: device pages whose host->device load is still in flight: node -> the load's op
        self._loading: dict[PageNode, int] = {}
        self._on |= {Backup: self._finish_backup, EvictionBackup: self._applied_where_waited}

    def _make_room(self, tier: Tier, n: int) -> None:
        """Free ``n`` ids of ``tier``'s pool. Where other groups' objects share it (one budget for a page
        and its window), both kinds go in one least-recently-used order, a window page before a full
        page of equal recency: window objects no newer than the oldest page that could go, then pages
        older than the oldest window object that could go, and again."""
        device = tier is Tier.DEVICE
        evict_pages = self.evict_device if device else self._evict_host_for_room
        sharing = self.groups.sharing
        if not sharing:
            evict_pages(n)
            return
        alloc = self.dev_alloc if device else self.host_alloc
        oldest_page = self.tree.oldest_device_leaf if device else self.tree.oldest_host_leaf
        evict_group = self.groups.evict
        want = alloc.num_free + n
        while alloc.num_free < want:
            before = alloc.num_free
            page_stamp = oldest_page()
            for c in sharing:
                if alloc.num_free < want:
                    evict_group(c, tier, want - alloc.num_free, up_to=page_stamp)
            if alloc.num_free < want:
                stamps = [st for st in (evict_group(c, tier, 0) for c in sharing) if st is not None]
                evict_pages(want - alloc.num_free, older_than=min(stamps, default=None))
            if alloc.num_free == before:
                return

    def alloc_device(self, n: int) -> Allocation:
        """``n`` device pages, evicting LRU device pages if needed; ``ok`` False if impossible."""
        self.poll()
        return self._alloc_device(n)

    def _alloc_device(self, n: int) -> Allocation:
        """:meth:`alloc_device` inside a call that polled already (one poll per entry)."""
        got = self.dev_alloc.alloc(n)
        if got.ok:
            return got
        if self.groups.sharing:  # pages and window pages in one pool: weighed together
            self._make_room(Tier.DEVICE, n - self.dev_alloc.num_free)
        else:
            self.evict_device(n - self.dev_alloc.num_free)
        got = self.dev_alloc.alloc(n)
        if not got.ok and self.poll_inflight():
            # pages pinned only by transfers in flight: wait for them, then try once more
            self._make_room(Tier.DEVICE, n - self.dev_alloc.num_free)
            got = self.dev_alloc.alloc(n)
        if not got.ok and self.port.has_storage and self.port.can_wait and self.wait_for(self._ops_for(Save)) > 0:
            # a device page that can get no host copy leaves with the host pages below it, which L3 saves still read
            # (a tenant at its cap, a full host tier): once saved, they may go
            self._make_room(Tier.DEVICE, n - self.dev_alloc.num_free)
            got = self.dev_alloc.alloc(n)
        return got

    def poll_inflight(self) -> bool:
        """Wait for device<->host plans in flight and apply them; True if any finished."""
        return self.wait_for(self._ops_for(Backup, LoadBack, GroupBackup)) > 0

    def _settle_shared_pages(self) -> None:
        """Before the tree forgets a lost shared host tier's pages: the backups and loads back that touch
        them complete first (their completions read the nodes)."""
        self.poll_inflight()

    def free_device(self, pages: list[int]) -> None:
        """Return caller-owned device pages (e.g. a request's partial tail page)."""
        self.dev_alloc.free(pages)

    def _backup(self, nodes: list[PageNode]) -> int:
        """Start async device->host backups of ``nodes`` (one root-to-leaf path). Returns pages started."""
        # (a shared host tier -- the node service's -- may give fewer than its num_free said: another engine took
        # them meanwhile; then the allocation is empty, and so is the backup)
        pages = self._host_pages(len(nodes), nodes[-1].owner)
        if len(pages) < len(nodes):
            self.stats.backup_skipped_pages += len(nodes) - len(pages)
            nodes = nodes[: len(pages)]
        if not nodes:
            return 0
        self.tree.set_hosts(nodes, pages, ready=False)
        self.tree.lock(nodes[-1])  # deepest: pins every node of the path until the bytes land
        groups = self.groups.runs(nodes, DEVICE, HOST) if self.groups else ()
        self._submit(copy_plan, Backup(nodes), DEVICE, list(map(device_page_of, nodes)), HOST, pages, 0, groups)
        return len(nodes)

    def _finish_backup(self, c: Completion, tag: Backup) -> None:
        nodes = tag.nodes
        tree = self.tree
        ok = type(c) is Done
        if ok:
            self._backed_up(nodes)
        else:
            self.stats.transfer_failures += 1
            self.groups.left(Tier.HOST, nodes)
            self.host_alloc.free([tree.clear_host(n) for n in nodes])
        tree.unlock(nodes[-1])
        if ok and self.port.has_storage and self.storage_config.write_policy == "write_through":
            self._save(tree.not_stored(nodes))

    def evict_device(self, n: int, older_than: int | None = None) -> EvictResult:
        """Free at least ``n`` device pages if possible, LRU leaves first; locked pages are never touched.
        ``older_than``: only pages last used before that stamp (see :meth:`_make_room`).

        Rounds until enough is free or nothing moves: first pages whose host
        copy is ready (dropping the device copy costs nothing), then device-only
        pages, backed up to host first (``on_device_evict="backup"``) or dropped.
        """
        freed = backed = dropped = 0
        tree = self.tree
        while freed < n:
            before = freed
            if self.groups:  # their other groups' objects leave with the pages
                cleared: list[PageNode] = []
                cheap = tree.drop_backed_up_bounded(n - freed, cleared, older_than)
                if cleared:
                    self.groups.left(Tier.DEVICE, cleared)
            else:
                cheap = tree.drop_backed_up(n - freed)
            self.dev_alloc.free(cheap)
            freed += len(cheap)
            if freed < n:
                victims = tree.device_victims(n - freed, older_than=older_than)
                unbacked = [v for v in victims if v.host_page == NO_PAGE]
                if unbacked and self.config.on_device_evict == "backup":
                    backed += self._backup_for_eviction(unbacked)
                batch = _Leaving()
                for v in victims:  # descendants before ancestors: each clear keeps residency prefix-closed
                    if v.device_children != batch.device_children.get(v, 0):
                        continue  # a descendant could not leave (its backup failed): keep this one too
                    if v.host_page != NO_PAGE and v.host_ready:
                        batch.add(v, gone=False)
                        freed += 1
                    elif v.host_page == NO_PAGE and v.num_children == batch.children_gone.get(v, 0):
                        batch.add(v, gone=True)  # no copy left and nothing below: it leaves the tree
                        dropped += 1
                        freed += 1
                    elif v.host_page == NO_PAGE:
                        self._clear_batch(batch)
                        if self._drop_with_host_subtree(v):
                            # no host copy could be made (drop policy, host full, failed copy), and host-only
                            # pages hang from it (a prefetch landed under it): they cannot outlive their prefix
                            dropped += 1
                            freed += 1
                self._clear_batch(batch)
            if freed == before:
                break
        self.stats.device_evicted_pages += freed
        self.stats.dropped_pages += dropped
        return EvictResult(n, freed, backed, dropped)

    def _clear_batch(self, batch: _Leaving) -> None:
        """Take ``batch``'s pages off the device (descendants first), remove the ones that leave the
        tree, free their device pages; empties the batch."""
        if batch.leaving:
            tree = self.tree
            if self.groups:
                self.groups.left(Tier.DEVICE, batch.leaving)
            pages = tree.clear_devices(batch.leaving)
            for node in batch.gone:
                tree.remove(node)
            self.dev_alloc.free(pages)
            batch.__init__()

    def _drop_with_host_subtree(self, v: PageNode) -> bool:
        """Drop device-only ``v`` and the host-only pages below it; False (nothing changed) while one
        of them is in use (locked, not yet readable, or being saved to L3)."""
        below = self.tree.host_only_below(v)
        if any(n.lock_ref or n.device_page != NO_PAGE or not n.host_ready or n.stored == SAVING for n in below):
            return False
        room = self._room_filter()
        if room is not None:  # (host pages of a tenant at its guarantee stay, and so does the page they hang from)
            if not all([room(n) for n in below]):
                return False
            self.tenants.count_nodes("evicted_pages", below)
        tree = self.tree
        self.stats.host_evicted_pages += self._forget_host_only(below)
        self.groups.left(Tier.DEVICE, (v,))
        self.dev_alloc.free([tree.clear_device(v)])
        tree.remove(v)
        return True

    def _backup_for_eviction(self, victims: list[PageNode]) -> int:
        """Synchronous backup of eviction victims (write_back): they are freed right after."""
        owners = None
        if self.tenants is not None:
            victims = self._within_caps(victims)
            owners = frozenset(v.owner for v in victims)
        pages = self._host_pages(len(victims), owners=owners) if victims else []
        victims = victims[len(victims) - len(pages) :]  # (descendants first: the ones nearest the root get the copies)
        if not victims:
            return 0
        self.tree.set_hosts(victims, pages, ready=False)  # victims are LRU-ordered, descendants first
        self.tree.pin(victims)  # on device: each lock covers its node alone
        groups = self.groups.runs(victims, Tier.DEVICE, Tier.HOST) if self.groups else ()
        op = self._submit(copy_plan, EvictionBackup(victims), Tier.DEVICE, list(map(device_page_of, victims)), Tier.HOST, pages, 0,
                          groups)
        c = self._await(op)
        self.tree.unpin(victims)
        if type(c) is not Done:
            self.stats.transfer_failures += 1
            self.groups.left(Tier.HOST, victims)
            self.host_alloc.free([self.tree.clear_host(v) for v in victims])
            return 0
        self._backed_up(victims)
        if self.port.has_storage and self.storage_config.write_policy == "write_through":
            self._save(self.tree.not_stored(victims))  # every new host copy goes to L3
        return len(victims)
