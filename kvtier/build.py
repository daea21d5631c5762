"""Compose a cache from config: pools, transfer engine, optional L3 tier.

(``TierConfig`` lives in :mod:`kvtier.config` with every other config; it is
importable from here too, where ``build_cache`` takes it.)"""

from __future__ import annotations

from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig, TierConfig
from kvtier.groups import ModelSpec
from kvtier.hashing import Namespace
from kvtier.l3.tier import open_storage_tier
from kvtier.errors import ConfigError
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec

__all__ = ["TierConfig", "build_cache", "build_hybrid_cache", "open_storage_tier"]


def build_cache(
    spec: KVSpec,
    tiers: TierConfig = TierConfig(),
    cache: CacheConfig = CacheConfig(),
    storage: StorageConfig = StorageConfig(),
    namespace: Namespace | None = None,
) -> HierarchicalCache:
    # one full group: same name, fingerprint and pools as the spec's, no other group's pools
    return build_hybrid_cache(ModelSpec.of(spec), tiers, cache, storage, namespace)


def build_hybrid_cache(
    model: ModelSpec,
    tiers: TierConfig = TierConfig(),
    cache: CacheConfig = CacheConfig(),
    storage: StorageConfig = StorageConfig(),
    namespace: Namespace | None = None,
    *,
    state_every: int = 1,
    share_window_pools: bool = True,
) -> HierarchicalCache:
    """:func:`build_cache` for a hybrid model (any :class:`~kvtier.groups.ModelSpec`): the tiers' pools
    hold its full-attention group's layers, and each other group gets as many objects per tier as
    there are pages there.

    ``share_window_pools``: a sliding-window group whose page is a full page (the same buffers over as
    many layers: gpt-oss's) keeps its pages in the full pages' own pools -- one budget per tier, where
    window pages no request reads go before full pages of equal recency, so a tier holds more of the
    prefixes it is asked for (vLLM's hybrid allocator shares its block pool the same way)."""
    spec = model.full_group().attention
    namespace = namespace or Namespace(model.name, model.fingerprint())
    device = DevicePool(spec, tiers.device_pages, tiers.device)
    others = [g for g in model.groups if g.kind != "full"]
    shared = {g.name for g in others if share_window_pools and g.kind == "sliding_window" and g.object_spec() == spec}
    own = {g.name: g.object_spec() for g in others if g.name not in shared}
    host = _host_pool(spec, tiers, storage, namespace, own)
    hosts = (object_host_pools(host, list(own)) if tiers.service is not None else
             {name: HostPool(ospec, host.num_pages, tiers.host_layout) for name, ospec in own.items()})
    pools = {g.name: (device, host) if g.name in shared else (DevicePool(g.object_spec(), device.num_pages, tiers.device), hosts[g.name])
             for g in others}
    tier = open_storage_tier(storage, host, namespace)
    return HierarchicalCache(device, host, cache, namespace=namespace, storage=tier, storage_config=storage, model=model,
                             group_pools=pools, state_every=state_every)


def _host_pool(spec: KVSpec, tiers: TierConfig, storage: StorageConfig, namespace: Namespace, objects: dict[str, KVSpec]) -> HostPool:
    """The host pool: this process's own, or a view of the node service's region (``tiers.service``), whose region then
    holds ``objects``' pools too (a hybrid model's groups with objects of their own: :func:`object_host_pools`)."""
    if tiers.service is None:
        return HostPool(spec, tiers.host_pages_for(spec.page_bytes), tiers.host_layout)
    if storage.url is not None:  # refused before connecting
        raise ConfigError("TierConfig.service (the node service) serves engines with no storage URL of their own (the service keeps "
                          "the tiers below the engine): drop StorageConfig.url, or the service")
    from kvtier.service.attach import attach_host_pool

    # (one share of region pages: a page and one object of each pool per page, as the engine's own host tier would hold)
    per_page = spec.page_bytes + sum(ospec.page_bytes for ospec in objects.values())
    return attach_host_pool(tiers.service, spec, tiers.host_layout, namespace, tiers.host_pages_for(per_page), objects=objects,
                            deadline_s=tiers.service_timeout_s, lookup_deadline_s=tiers.service_lookup_timeout_s,
                            service_uid=tiers.service_uid, required=tiers.service_required)


def object_host_pools(host: HostPool, objects: list[str]) -> dict[str, HostPool]:
    from kvtier.service.attach import object_host_pools as pools_of

    return pools_of(host, objects)
