"""The hierarchical cache in one process: the policy core over this process's pools.

:class:`HierarchicalCache` is :class:`~kvtier.core.CacheCore` composed
with a :class:`~kvtier.executors.local.LocalExecutor` over a device pool, a
host pool, their :class:`~kvtier.transfer.engine.TransferEngine` and an optional
L3 :class:`~kvtier.l3.tier.StorageTier`. It adds nothing to the policy: the
core decides, the executor moves the bytes. An engine whose workers hold the
bytes in other processes composes the core with their ports instead.
"""

from __future__ import annotations

from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import (Backup, CacheCore, EvictionBackup, EvictionSave, EvictResult, InsertResult, JobTag, LoadBack, LoadResult,
                                MatchResult, PrefetchHandle, Save)
from kvtier.errors import SpecError
from kvtier.executors.local import LocalExecutor
from kvtier.hashing import Namespace
from kvtier.l3.tier import StorageTier
from kvtier.metrics import CacheStats
from kvtier.transfer.engine import TransferEngine

__all__ = [
    "Backup",
    "EvictResult",
    "EvictionBackup",
    "EvictionSave",
    "HierarchicalCache",
    "InsertResult",
    "JobTag",
    "LoadBack",
    "LoadResult",
    "MatchResult",
    "PrefetchHandle",
    "Save",
]


class HierarchicalCache(CacheCore):
    """The core over ``device_pool`` and ``host_pool`` (their allocators are the core's page ids)
    with a local executor; ``storage`` adds L3."""

    def __init__(
        self,
        device_pool,
        host_pool,
        config: CacheConfig = CacheConfig(),
        *,
        namespace: Namespace | None = None,
        engine: TransferEngine | None = None,
        stats: CacheStats | None = None,
        storage: StorageTier | None = None,
        storage_config: StorageConfig = StorageConfig(),
    ):
        if device_pool.spec != host_pool.spec:
            raise SpecError("device and host pools must be built from the same KVSpec")
        self.device = device_pool
        self.host = host_pool
        self.engine = engine or TransferEngine(host_pool, device_pool, config.io_backend)
        self.storage = storage
        super().__init__(
            device_pool.spec,
            device_pool.allocator,
            host_pool.allocator,
            LocalExecutor(self.engine, storage),
            config,
            storage_config,
            namespace=namespace,
            stats=stats,
        )
