"""Host pages: allocation with eviction, LRU host-only leaves first.

Host eviction takes leaves whose device copy is gone, least recently used
first, saving them to L3 first under ``write_back``. Locked pages, pages not
yet readable and pages being saved are never taken. Shared by both cores:
whoever owns the device, kvtier owns the host pool.
"""

from __future__ import annotations

from kvtier.alloc import Allocation
from kvtier.core.plans import Tier
from kvtier.core.results import EvictResult
from kvtier.core.tags import PrefetchHandle, Save
from kvtier.radix import PageNode


class HostSpace:
    """Host allocation and eviction, part of :class:`~kvtier.core.base.CoreBase`."""

    def _alloc_host(self, n: int) -> Allocation:
        got = self.host_alloc.alloc(n)
        if got.ok:
            return got
        self._make_room(Tier.HOST, n - self.host_alloc.num_free)
        got = self.host_alloc.alloc(n)
        if not got.ok and self.port.has_storage and self.port.can_wait:
            # host pages being saved to L3 (or fetched into) cannot go yet: wait for them, then try once more
            # (a port that cannot wait -- a scheduler's workers answer next step -- gets fewer pages now)
            if self.wait_for(self._ops_for(Save, PrefetchHandle)) > 0:
                self._make_room(Tier.HOST, n - self.host_alloc.num_free)
                got = self.host_alloc.alloc(n)
        return got

    def _make_room(self, tier: Tier, n: int) -> None:
        """Free ``n`` ids of ``tier``'s pool: its pages' eviction (a core whose other KV groups share the
        pool weighs their objects too, :mod:`~kvtier.core.group_residency`)."""
        if tier is Tier.HOST:
            self.evict_host(n)
        else:
            self.evict_device(n)

    def evict_host(self, n: int, older_than: int | None = None) -> EvictResult:
        """Free at least ``n`` host pages whose device copy is gone, LRU leaves first (``older_than``:
        only pages last used before that stamp)."""
        victims = self.tree.host_victims(n, older_than)
        if victims and self.on_host_evicted is not None:
            self.on_host_evicted([v.key for v in victims])
        if self.port.has_storage and self.storage_config.write_policy == "write_back":
            unsaved = self.tree.not_stored(victims)
            if unsaved:
                self._save_for_eviction(unsaved)
        self.stats.host_evicted_pages += self._forget_host_only(victims)
        return EvictResult(n, len(victims))

    def _forget_host_only(self, nodes: list[PageNode]) -> int:
        """Remove host-only ``nodes`` (deepest first: each is a leaf when it goes) and free their host
        pages; returns how many."""
        self._groups_left(Tier.HOST, nodes)
        pages = self.tree.remove_host_only(nodes)
        self.host_alloc.free(pages)
        return len(pages)
