"""When backups happen under each write policy; stats and Prometheus export."""

import prometheus_client
import pytest

from kvtier.alloc import PageAllocator
from kvtier.cache import HierarchicalCache
from kvtier.errors import ConfigError
from kvtier.config import CacheConfig
from kvtier.pools import DevicePool, HostPool
from kvtier.metrics import PrometheusCollector
from support.pools import tiny_specs
from support.cache_helpers import make_cache, serve

REQ = list(range(16))  # 4 full pages at page_size 4


def spec():
    return tiny_specs(page_size=4, num_layers=2)["dsa"]


def test_write_through_backs_up_at_insert():
    cache = make_cache(spec(), 8, 8, write_policy="write_through")
    serve(cache, REQ)
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 4 and cache.host_alloc.num_used == 4
    # host copies equal device copies, byte for byte
    for node in cache.tree.nodes.values():
        assert node.host_ready and cache.host.page_bytes(node.host_page) == cache.device.page_bytes(node.device_page)
    # evicting now needs no backup
    r = cache.evict_device(4)
    assert (r.evicted, r.backed_up) == (4, 0)
    cache.check_integrity()
    cache.close()


def test_write_through_selective_backs_up_after_n_hits():
    cache = make_cache(spec(), 8, 8, write_policy="write_through_selective", write_through_threshold=2)
    serve(cache, REQ)  # inserted: 0 hits
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 0
    serve(cache, REQ)  # 1st hit
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 0
    serve(cache, REQ[:8])  # 2nd hit on the first 2 pages only
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 2
    serve(cache, REQ)  # 2nd hit on pages 3-4, 3rd on pages 1-2 (already backed up)
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 4
    cache.check_integrity()
    cache.close()


def test_write_back_backs_up_only_on_eviction():
    cache = make_cache(spec(), 8, 8, write_policy="write_back")
    serve(cache, REQ)
    serve(cache, REQ)
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 0 and cache.host_alloc.num_used == 0
    r = cache.evict_device(2)
    assert (r.evicted, r.backed_up) == (2, 2) and cache.stats.backed_up_pages == 2
    cache.check_integrity()
    cache.close()


def test_backup_skipped_when_host_full_and_pinned():
    cache = make_cache(spec(), 8, 2, write_policy="write_through")
    serve(cache, REQ)  # 4 pages to back up, host holds 2 and nothing is evictable (all on device)
    cache.wait_idle()
    assert cache.stats.backed_up_pages == 2 and cache.stats.backup_skipped_pages == 2
    cache.check_integrity()
    cache.close()


class SharedWithARival(PageAllocator):
    """A host allocator another engine shares, as the node service's region is: its free count is a moment's, and
    when an engine that found too few pages comes back for what was free, the rival has taken it."""

    def __post_init__(self):
        super().__post_init__()
        self.rivals: set[int] = set()
        self.failed = 0  # the last allocation that found too few pages

    def rival(self, n: int) -> None:
        self.rivals.update(super().alloc(n).pages)

    def alloc(self, n):
        if 0 < n < self.failed:  # (back for fewer: the rival was quicker)
            self.rival(self.num_free)
        got = super().alloc(n)
        self.failed = 0 if got.ok else n
        return got

    def allocated_pages(self) -> set[int]:  # (this engine's: the rival's pages are not in its books)
        return super().allocated_pages() - self.rivals


def test_a_backup_whose_shared_host_tier_gives_fewer_pages_than_it_said_is_skipped_not_a_partial_plan():
    """The soak found it: a backup that got no pages at once and then fewer than the free count promised planned
    its whole path onto no host pages (a PageAlignmentError in the engine's commit). It is skipped, and counted."""
    host = HostPool(spec(), 6, "layer_first", allocator=SharedWithARival(6, "shared host"))
    cache = HierarchicalCache(DevicePool(spec(), 8), host, CacheConfig(write_policy="write_through"))
    host.allocator.rival(3)  # half of it another engine's already: 4 pages to back up, 3 free
    serve(cache, REQ)
    cache.wait_idle()
    assert (cache.stats.backed_up_pages, cache.stats.backup_skipped_pages) == (0, 4)
    cache.check_integrity()
    cache.close()


def test_config_errors_name_field():
    with pytest.raises(ConfigError, match="write_policy must be one of write_through, write_through_selective, write_back"):
        CacheConfig(write_policy="sometimes")
    with pytest.raises(ConfigError, match="write_through_threshold"):
        CacheConfig(write_through_threshold=0)


def test_stats_snapshot_and_prometheus_export():
    cache = make_cache(spec(), 8, 8, write_policy="write_back")
    serve(cache, REQ)
    cache.evict_device(4)
    serve(cache, REQ)
    cache.wait_idle()
    snap = cache.stats.snapshot()
    assert (snap.requests, snap.lookup_pages, snap.host_hit_pages, snap.device_hit_pages) == (2, 8, 4, 0)
    assert snap.hit_ratio("host") == 0.5 and snap.miss_pages == 4
    assert snap.loaded_bytes == 4 * cache.spec.page_bytes
    registry = prometheus_client.CollectorRegistry()
    registry.register(PrometheusCollector(cache.stats.snapshot, labels={"instance": "a"}))
    assert registry.get_sample_value("kvtier_host_hit_pages_total", {"instance": "a"}) == 4
    assert registry.get_sample_value("kvtier_loaded_bytes_total", {"instance": "a"}) == 4 * cache.spec.page_bytes
    cache.close()
