"""Replay a trace through :class:`HierarchicalCache` itself, over pools that hold no bytes.

This is the reference: the real policy code (LRU per tier, write_through
backups, L3 saves and wait_complete prefetch) with accounting-only pools, one
cache per node and one shared ``memory://`` L3. Every configuration runs here;
:mod:`kvtier.plan.replay_lru` is the fast model of the same policy for the
configurations where it is exact.
"""

from __future__ import annotations

from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.hashing import Namespace, PageHash
from kvtier.l3.memory import MemoryBackend
from kvtier.l3.tier import StorageTier
from kvtier.plan.config import L3_BATCH_PAGES, Capacity, PlanConfig, ReplayCounts, attribute_hits
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec
from kvtier.workloads.mooncake import TraceRequest


def _block_key(h: int) -> PageHash:
    return PageHash(h.to_bytes(16, "little", signed=False))


def _node_cache(spec: KVSpec, cap: Capacity, storage: MemoryBackend | None, cache_cfg: CacheConfig) -> HierarchicalCache:
    dev = DevicePool(spec, cap.device, materialize=False)
    host = HostPool(spec, cap.host, materialize=False)
    ns = Namespace(spec.name, spec.fingerprint())
    tier = StorageTier(storage, host, ns, batch_pages=L3_BATCH_PAGES) if storage is not None else None
    return HierarchicalCache(dev, host, cache_cfg, namespace=ns, storage=tier, storage_config=StorageConfig(url="memory://"))


def replay_cache(requests: list[TraceRequest], cfg: PlanConfig, cache_cfg: CacheConfig, spec: KVSpec, cap: Capacity,
                 *, per_request: bool = False) -> ReplayCounts:
    block = spec.page_size
    storage = MemoryBackend(max_objects=cap.storage) if cap.storage is not None else None
    caches = [_node_cache(spec, cap, storage, cache_cfg) for _ in range(cfg.nodes)]
    out = ReplayCounts("cache", per_request=[] if per_request else None)
    hits = out.hit_blocks
    for i, r in enumerate(requests):
        node = caches[cfg.node_of(i, r)]
        keys = [_block_key(h) for h in r.hash_ids[: r.input_length // block]]
        usable_max = (r.input_length - 1) // block
        m = node.match(keys)
        node.lock(m.last_node)
        on_host = m.num_host_pages
        if m.num_storage_pages and m.num_device_pages + m.num_host_pages < usable_max:
            h = node.prefetch(m)
            node.resolve_prefetch(h, "wait_complete")
            if h is not None:
                m2 = node.match(keys, count=False)
                node.lock(m2.last_node)
                node.unlock(m.last_node)
                m = m2
        on_device = m.num_device_pages
        ld = node.load_back(m)
        usable = min(len(ld.device_pages), usable_max)
        total = -(-r.input_length // block)
        new = node.alloc_device(total - usable)
        if new.ok:
            pages = ld.device_pages[:usable] + new.pages
            full = len(keys)
            node.insert(keys, pages[:full])
            if total > full:
                node.free_device(pages[full:])
        node.unlock(m.last_node)
        served = attribute_hits(usable, on_device, on_host)
        for tier, n in zip(("device", "host", "storage"), served):
            hits[tier] += n
        if out.per_request is not None:
            out.per_request.append(served)
        out.input_tokens += r.input_length
    # read before close: close() applies the last backups, which the replay never waited for
    out.backed_up_blocks = sum(c.stats.backed_up_pages for c in caches)
    out.storage_saved_blocks = sum(c.stats.storage_saved_pages for c in caches)
    for c in caches:
        c.close()
    return out
