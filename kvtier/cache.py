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
from kvtier.core.shared_host import NO_SHARED_HOST
from kvtier.core import (Backup, CacheCore, EvictionBackup, EvictionSave, EvictResult, InsertResult, JobTag, LoadBack, LoadResult,
                                MatchResult, PrefetchHandle, Save)
from kvtier.errors import SpecError
from kvtier.groups import ModelSpec
from kvtier.executors.local import LocalExecutor, group_movers
from kvtier.hashing import Namespace
from kvtier.l3.tier import StorageTier
from kvtier.service.leased import LeasedPages
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
    with a local executor; ``storage`` adds L3.

    A hybrid ``model``: ``device_pool`` / ``host_pool`` hold its full-attention layers, and
    ``group_pools`` each other group's (device pool, host pool), built from the group's
    :meth:`~kvtier.groups.KVGroup.object_spec` (sliding-window pages, state snapshots).

    A ``host_pool`` over the node service's region (:func:`~kvtier.service.attach.attach_host_pool`):
    the host tier is shared with every engine attached to the service; closing the cache detaches."""

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
        model: ModelSpec | None = None,
        group_pools: dict[str, tuple[object, object]] | None = None,
        state_every: int = 1,
    ):
        if device_pool.spec != host_pool.spec:
            raise SpecError("device and host pools must be built from the same KVSpec")
        self.device = device_pool
        self.host = host_pool
        self.engine = engine or TransferEngine(host_pool, device_pool, config.io_backend)
        self.storage = storage
        self.group_pools = dict(group_pools or {})
        for name, (dev, host) in self.group_pools.items():
            want = model.group(name).object_spec() if model is not None else None
            if dev.spec != host.spec or (want is not None and dev.spec != want):
                raise SpecError(f"KV group {name!r}: its device and host pools must both be built from the group's object_spec()")
        # each group's objects: its own transfer engine, and the same store under their own keys
        executor = LocalExecutor(self.engine, storage, *group_movers(self.group_pools, config.io_backend, storage))
        try:
            super().__init__(
                device_pool.spec,
                device_pool.allocator,
                host_pool.allocator,
                executor,
                config,
                storage_config,
                namespace=namespace,
                stats=stats,
                model=model,
                group_pools={name: (dev.allocator, host.allocator) for name, (dev, host) in self.group_pools.items()},
                state_every=state_every,
                shared_host=host_pool.allocator if isinstance(host_pool.allocator, LeasedPages) else NO_SHARED_HOST,
            )
        except Exception:
            executor.close()  # (its transfer threads: a refused configuration leaves nothing running)
            self._detach(quiesced=True)
            raise

    def close(self) -> None:
        """Finish every plan in flight, close the executor, then detach from the node service (if any:
        quiesced when every plan finished; else the service keeps this engine's pages until it exits)."""
        finished = False
        try:
            super().close()
            finished = True
        finally:
            self._detach(quiesced=finished)

    def _detach(self, *, quiesced: bool) -> None:
        if isinstance(self.host.allocator, LeasedPages):
            self.host.allocator.close(quiesced=quiesced)
