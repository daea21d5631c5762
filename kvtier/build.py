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
    host = _host_pool(spec, tiers, model, storage, namespace)
    pools = {g.name: (device, host) if share_window_pools and g.kind == "sliding_window" and g.object_spec() == spec else
             (DevicePool(g.object_spec(), device.num_pages, tiers.device), HostPool(g.object_spec(), host.num_pages, tiers.host_layout))
             for g in model.groups if g.kind != "full"}
    tier = open_storage_tier(storage, host, namespace)
    return HierarchicalCache(device, host, cache, namespace=namespace, storage=tier, storage_config=storage, model=model,
                             group_pools=pools, state_every=state_every)


def _host_pool(spec: KVSpec, tiers: TierConfig, model: ModelSpec, storage: StorageConfig, namespace: Namespace) -> HostPool:
    """The host pool: this process's own, or a view of the node service's region (``tiers.service``)."""
    if tiers.service is None:
        return HostPool(spec, tiers.host_pages_for(spec.page_bytes), tiers.host_layout)
    if model.is_hybrid or storage.url is not None:  # refused before connecting
        raise ConfigError("TierConfig.service (the node service) serves models of full attention only, with no storage URL of the "
                          "engine's own (the service keeps the tiers below the engine): drop StorageConfig.url, or the service")
    from kvtier.service.attach import attach_host_pool

    return attach_host_pool(tiers.service, spec, tiers.host_layout, namespace, tiers.host_pages_for(spec.page_bytes),
                            deadline_s=tiers.service_timeout_s, lookup_deadline_s=tiers.service_lookup_timeout_s,
                            service_uid=tiers.service_uid, required=tiers.service_required)
