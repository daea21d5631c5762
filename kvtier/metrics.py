"""Cache statistics: a plain counters dataclass, snapshots, and an injected Prometheus collector.

Nothing here is global: a cache owns its :class:`CacheStats`; Prometheus export
is a collector registered in a registry the caller passes in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class CacheStats:
    requests: int = 0
    lookup_pages: int = 0
    device_hit_pages: int = 0
    host_hit_pages: int = 0
    storage_hit_pages: int = 0
    #: requests whose cached prefix was shorter than ``min_hit_tokens``: served as a miss, recomputed
    hits_below_minimum: int = 0
    inserted_pages: int = 0
    duplicate_pages: int = 0
    device_evicted_pages: int = 0
    host_evicted_pages: int = 0
    dropped_pages: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    backed_up_pages: int = 0
    backed_up_bytes: int = 0
    load_shortfall_pages: int = 0
    backup_skipped_pages: int = 0
    transfer_failures: int = 0
    #: device pages a failed host->device load left with wrong bytes (never offered; see core.failed_loads)
    load_failed_pages: int = 0
    #: completions for plans the core never made (or already applied): ignored
    unknown_completions: int = 0
    #: plans not every rank reported within the bound: failed (a miss), their host pages held until they answer
    timed_out_plans: int = 0
    #: prefetches whose unarrived pages were dropped when the policy's budget ran out (their locks released at once)
    prefetches_given_up: int = 0
    #: plans in flight when the executor port was lost (its worker died or broke its protocol): failed
    lost_plans: int = 0
    storage_saved_pages: int = 0
    storage_saved_bytes: int = 0
    storage_prefetched_pages: int = 0
    storage_prefetched_bytes: int = 0
    storage_failures: int = 0
    #: objects that failed their check on read (wrong size, header, checksum, key): each deleted, so the next save repairs it
    storage_corrupt_pages: int = 0
    #: of ``storage_hit_pages`` (what the store held at lookup), the pages a prefetch could not serve because an
    #: object failed its check: its page and the ones after it (a hybrid model: also those before it that no boundary
    #: can be served from without it). Misses after all: ``miss_pages`` counts them
    storage_corrupt_miss_pages: int = 0
    #: host pages other engines published to the node service that this cache took into its host tier
    #: (a match found them after its own prefix; they count as host hits there)
    shared_host_pages: int = 0
    #: host pages forgotten because the node service was lost (the engine goes on without it: misses)
    shared_host_lost_pages: int = 0

    def snapshot(self) -> CacheStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def miss_pages(self) -> int:
        """Pages looked up and served by no tier (an L3 hit a corrupt object kept from being served included)."""
        return self.lookup_pages - self.device_hit_pages - self.host_hit_pages - self.storage_hit_pages + self.storage_corrupt_miss_pages

    def hit_ratio(self, tier: str) -> float:
        hits = getattr(self, f"{tier}_hit_pages")
        return hits / self.lookup_pages if self.lookup_pages else 0.0


class PrometheusCollector:
    """Exports a stats source as ``kvtier_<field>_total`` counters. Register it in your registry::

        registry = prometheus_client.CollectorRegistry()
        registry.register(PrometheusCollector(lambda: cache.stats.snapshot(), labels={"instance": "0"}))
    """

    def __init__(self, source, labels: dict[str, str] | None = None, prefix: str = "kvtier"):
        self.source = source
        self.labels = labels or {}
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = self.source()
        for name, value in stats.as_dict().items():
            fam = CounterMetricFamily(f"{self.prefix}_{name}", f"kvtier cache counter {name}", labels=list(self.labels))
            fam.add_metric(list(self.labels.values()), value)
            yield fam


class TenantCollector:
    """Exports a cache's per-tenant rows (:meth:`~kvtier.core.base.CoreBase.tenant_usage`) with a ``tenant`` label, the
    tenant's digest (never its name): ``kvtier_tenant_host_pages`` (a gauge) and ``kvtier_tenant_<counter>_total``::

        registry.register(TenantCollector(cache.tenant_usage))
    """

    COUNTERS = ("lookup_pages", "hit_pages", "evicted_pages", "expired_pages", "capped_pages")

    def __init__(self, source, prefix: str = "kvtier"):
        self.source = source
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rows = self.source()
        held = GaugeMetricFamily(f"{self.prefix}_tenant_host_pages", "host pages a tenant holds", labels=["tenant"])
        for row in rows:
            held.add_metric([row.tenant], row.host_pages)
        yield held
        for name in self.COUNTERS:
            fam = CounterMetricFamily(f"{self.prefix}_tenant_{name}", f"kvtier per-tenant counter {name}", labels=["tenant"])
            for row in rows:
                fam.add_metric([row.tenant], getattr(row, name))
            yield fam
