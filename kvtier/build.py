"""Compose a cache from config: pools, transfer engine, optional L3 tier."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, ConfigError, StorageConfig, _help, check_number
from kvtier.hashing import Namespace
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class TierConfig:
    """Sizes and placement of the device (L1) and host (L2) pools."""

    device_pages: int = _help("device (L1) pool size in pages", 64)
    host_pages: int = _help("host (L2) pool size in pages (ignored when host_gb is set)", 96)
    host_gb: float | None = _help("host (L2) pool size in GB; checked against available memory", None)
    host_layout: str = _help("host layout: layer_first or page_first", "page_first")
    device: str = _help("where the device pool lives: cpu or cuda", "cpu")

    def __post_init__(self) -> None:
        check_number(self, "device_pages", at_least=1, integer=True)
        check_number(self, "host_pages", at_least=1, integer=True)
        check_number(self, "host_gb", above=0)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"TierConfig.device must be cpu or cuda; got {self.device!r}")

    def host_pages_for(self, spec: KVSpec) -> int:
        return self.host_pages if self.host_gb is None else max(1, int(self.host_gb * (1 << 30)) // spec.page_bytes)


def open_storage_tier(storage: StorageConfig, host: HostPool, namespace: Namespace):
    """The L3 tier over ``host`` for ``storage.url`` (None when L3 is off)."""
    if not storage.url:
        return None
    from kvtier.l3 import open_backend
    from kvtier.l3.tier import StorageTier

    return StorageTier(open_backend(storage.url), host, namespace, batch_pages=storage.batch_pages, io_threads=storage.io_threads, queue_depth=storage.queue_depth)


def build_cache(spec: KVSpec, tiers: TierConfig = TierConfig(), cache: CacheConfig = CacheConfig(), storage: StorageConfig = StorageConfig(),
                namespace: Namespace | None = None) -> HierarchicalCache:
    namespace = namespace or Namespace(spec.name, spec.fingerprint())
    device = DevicePool(spec, tiers.device_pages, tiers.device)
    host = HostPool(spec, tiers.host_pages_for(spec), tiers.host_layout)
    tier = open_storage_tier(storage, host, namespace)
    return HierarchicalCache(device, host, cache, namespace=namespace, storage=tier, storage_config=storage)
