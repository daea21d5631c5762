"""Host (L2) and storage (L3) tiers behind an engine that owns its device memory.

:class:`~kvtier.cache.HierarchicalCache` owns its device pool. An engine such as
vLLM owns its GPU blocks and its own device prefix cache, so what it needs from
kvtier is the part below that. :class:`OffloadCache` is that, composed like the
rest: the policy core in its engine-device form
(:class:`~kvtier.core.engine_device.EngineDeviceCore`: one prefix tree, host
LRU, write policies, L3 save and prefetch state) over a
:class:`~kvtier.executors.local.LocalExecutor` whose transfer engine copies
between the engine's blocks and kvtier's host pages and whose L3 tier moves
host pages to and from the store. It adds a lock (an engine may call it from
its scheduler and its forward thread) and the counters the connector reports.

Faults become shorter hits, never exceptions: a load reports how many leading
pages arrived and the engine recomputes the rest. Every call takes page keys
(see :mod:`kvtier.hashing`) and device block ids; pages are whole by
construction, so no partial page can reach a transfer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.engine_device import EngineDeviceCore, EngineLoad, HostLookup, OffloadResult
from kvtier.errors import ConfigError
from kvtier.executors.local import LocalExecutor
from kvtier.hashing import PageHash
from kvtier.l3.tier import StorageTier
from kvtier.pages import checked_pages
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer.engine import TransferEngine

#: what the connector has always called these results
OffloadLookup = HostLookup
SaveResult = OffloadResult
OffloadLoad = EngineLoad


@dataclass
class OffloadStats:
    lookups: int = 0
    lookup_host_pages: int = 0
    lookup_storage_pages: int = 0
    saved_pages: int = 0
    save_already_held: int = 0
    save_no_space: int = 0
    loaded_from_host: int = 0
    loaded_from_storage: int = 0
    #: pages a load was asked for but could not bring (recomputed by the engine)
    load_shortfall: int = 0
    evicted_pages: int = 0
    l3_save_jobs: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class OffloadCache:
    def __init__(
        self,
        device: DevicePool,
        host: HostPool,
        storage: StorageTier | None = None,
        storage_config: StorageConfig = StorageConfig(),
        *,
        io_backend: str = "direct",
    ):
        if device.spec != host.spec:
            raise ConfigError(f"device pool holds {device.spec.name!r} but host pool holds {host.spec.name!r}; build both from one KVSpec")
        self.spec = host.spec
        self.device = device
        self.host = host
        self.storage = storage
        self.storage_config = storage_config
        self.engine = TransferEngine(host, device, io_backend, name="kvtier-offload")
        self.core = EngineDeviceCore(
            self.spec,
            host.allocator,
            LocalExecutor(self.engine, storage),
            CacheConfig(io_backend=io_backend, preallocate_nodes=False),
            storage_config,
        )
        self.stats = OffloadStats()
        self._mutex = threading.RLock()
        self._closed = False

    def _sync_stats(self) -> None:
        self.stats.evicted_pages = self.core.stats.host_evicted_pages

    # ---- queries ---------------------------------------------------------------------
    def lookup(self, keys: Sequence[PageHash]) -> HostLookup:
        with self._mutex:
            found = self.core.lookup(keys)
            self.stats.lookups += 1
            self.stats.lookup_host_pages += found.host_pages
            self.stats.lookup_storage_pages += found.storage_pages
            return found

    def holds(self, key: PageHash) -> bool:
        with self._mutex:
            return self.core.holds(key)

    @property
    def num_host_pages_used(self) -> int:
        return self.host.allocator.num_used

    # ---- device -> host -> L3 ------------------------------------------------------
    def save(self, keys: Sequence[PageHash], device_pages: Sequence[int]) -> OffloadResult:
        """Copy the pages of ``keys`` not yet on host from ``device_pages`` (all layers), then write them through to L3.

        Returns once the bytes are in host memory, so the engine may reuse the
        device pages; the L3 write continues in the background.
        """
        if len(keys) != len(device_pages):
            raise ConfigError(f"save: {len(keys)} page keys but {len(device_pages)} device pages; pass one device page per key")
        device_pages = checked_pages(
            device_pages, self.device.num_pages, pool=self.device.name, side="device"
        ).tolist()  # before any lock or copy
        with self._mutex:
            result = self.core.offload(keys, device_pages)
            self.stats.saved_pages += result.saved
            self.stats.save_already_held += result.already_held
            self.stats.save_no_space += result.no_space
            self.stats.l3_save_jobs += result.l3_save_op is not None
            self._sync_stats()
            return result

    # ---- L3 -> host -> device ----------------------------------------------------
    def load(self, keys: Sequence[PageHash], device_pages: Sequence[int]) -> EngineLoad:
        """Bring the leading available pages of ``keys`` into ``device_pages``, layer by layer."""
        if len(keys) != len(device_pages):
            raise ConfigError(f"load: {len(keys)} page keys but {len(device_pages)} device pages; pass one device page per key")
        device_pages = checked_pages(
            device_pages, self.device.num_pages, pool=self.device.name, side="device"
        ).tolist()  # before any lock or copy
        with self._mutex:
            ld = self.core.load_into(keys, device_pages)
            self.stats.loaded_from_host += ld.from_host
            self.stats.loaded_from_storage += ld.from_storage
            self.stats.load_shortfall += ld.requested - ld.loaded
            self._sync_stats()
            return ld

    def release(self, load: EngineLoad) -> None:
        """Wait for ``load`` to land and unlock its host pages. Idempotent."""
        with self._mutex:
            self.core.release(load)

    # ---- lifecycle -------------------------------------------------------------------
    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait for device copies and L3 writes in flight (L3 bounded by ``timeout_s``); True when all finished."""
        self.engine.drain()
        ok = self.storage.drain(timeout_s) if self.storage is not None else True
        with self._mutex:
            self.core.poll()
            self._sync_stats()
        return ok

    def check_integrity(self) -> None:
        """The core's accounting: tree and host allocator agree, no page owned twice, locks sane."""
        with self._mutex:
            self.core.check_integrity()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain()
        with self._mutex:
            self.core.port.close()

    def __enter__(self) -> OffloadCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
