"""Host (L2) and storage (L3) tiers behind an engine that owns its device memory.

:class:`~kvtier.cache.HierarchicalCache` owns its device pool. An engine such as
vLLM owns its GPU blocks and its own device prefix cache, so what it needs from
kvtier is the part below that: :class:`OffloadCache` keeps whole pages in a host
pool, writes them through to L3, and brings them back into blocks the engine
names, layer by layer.

* **Space**: one :class:`~kvtier.pools.HostPool`; the index maps page key -> host
  page with LRU order and lock counts. Pages locked by a load in flight or by an
  L3 save reading them are never evicted.
* **Policy**: a chained prefix is touched deepest-first, so its root is the most
  recent and LRU drops leaves before the pages they hang from. A save or a
  storage prefetch that cannot get room for every page keeps the leading pages
  that fit (a prefix stays a prefix).
* **Movement**: device <-> host goes through the :class:`TransferEngine` (per-layer
  completion for loads); host <-> L3 through the :class:`StorageTier`. Faults
  become shorter hits, never exceptions: a load reports how many leading pages
  arrived and the engine recomputes the rest.

Every call takes page keys (see :mod:`kvtier.hashing`) and device page indices;
pages are whole by construction, so no partial page can reach a transfer.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvtier.config import StorageConfig
from kvtier.errors import ConfigError
from kvtier.hashing import PageHash
from kvtier.pages import checked_pages
from kvtier.l3.tier import StorageJob, StorageTier
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer.engine import TransferEngine, TransferJob


@dataclass(frozen=True, slots=True)
class OffloadLookup:
    """Leading pages of a key list held on host, then (after those) in L3."""

    host_pages: int
    storage_pages: int

    @property
    def pages(self) -> int:
        return self.host_pages + self.storage_pages


@dataclass(frozen=True, slots=True)
class SaveResult:
    requested: int
    already_held: int
    saved: int
    #: pages not saved because every host page was locked (load or L3 save in flight)
    no_space: int


@dataclass(eq=False)
class OffloadLoad:
    """A load into engine pages: the first ``loaded`` of ``requested`` pages are coming.

    ``wait_layer(i)`` blocks until layer ``i`` of those pages is in device memory.
    Pages ``loaded:`` were not available (evicted, missing or failed in L3) and must
    be recomputed by the engine. Call :meth:`OffloadCache.release` when done.
    """

    requested: int
    loaded: int
    from_host: int
    from_storage: int
    device_pages: list[int]
    job: TransferJob | None = None
    _locked: list[PageHash] = field(default_factory=list, repr=False)
    _released: bool = field(default=False, repr=False)

    def wait_layer(self, layer: int) -> None:
        if self.job is not None:
            self.job.wait_layer(layer)

    def wait(self) -> None:
        if self.job is not None:
            self.job.wait()


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


class _Entry:
    __slots__ = ("page", "locks")

    def __init__(self, page: int):
        self.page = page
        self.locks = 0


class OffloadCache:
    def __init__(self, device: DevicePool, host: HostPool, storage: StorageTier | None = None, storage_config: StorageConfig = StorageConfig(), *, io_backend: str = "direct"):
        if device.spec != host.spec:
            raise ConfigError(f"device pool holds {device.spec.name!r} but host pool holds {host.spec.name!r}; build both from one KVSpec")
        self.spec = host.spec
        self.device = device
        self.host = host
        self.storage = storage
        self.storage_config = storage_config
        self.engine = TransferEngine(host, device, io_backend, name="kvtier-offload")
        self.stats = OffloadStats()
        self._index: OrderedDict[PageHash, _Entry] = OrderedDict()
        self._saving: list[tuple[StorageJob, list[PageHash]]] = []
        #: prefetches abandoned at their deadline: their host pages are freed once the worker is done
        self._orphans: list[tuple[StorageJob, list[int]]] = []
        self._mutex = threading.RLock()
        self._closed = False

    # ---- queries ---------------------------------------------------------------------
    def lookup(self, keys: Sequence[PageHash]) -> OffloadLookup:
        with self._mutex:
            self._poll()
            host = self._host_prefix(keys)
            stored = self.storage.stored_prefix(list(keys[host:])) if self.storage is not None and host < len(keys) else 0
            self._touch(keys[:host])
            self.stats.lookups += 1
            self.stats.lookup_host_pages += host
            self.stats.lookup_storage_pages += stored
            return OffloadLookup(host, stored)

    def holds(self, key: PageHash) -> bool:
        with self._mutex:
            return key in self._index

    @property
    def num_host_pages_used(self) -> int:
        return len(self._index)

    # ---- device -> host -> L3 ------------------------------------------------------
    def save(self, keys: Sequence[PageHash], device_pages: Sequence[int]) -> SaveResult:
        """Copy the pages of ``keys`` not yet on host from ``device_pages`` (all layers), then write them through to L3.

        Returns once the bytes are in host memory, so the engine may reuse the
        device pages; the L3 write continues in the background.
        """
        if len(keys) != len(device_pages):
            raise ConfigError(f"save: {len(keys)} page keys but {len(device_pages)} device pages; pass one device page per key")
        device_pages = checked_pages(device_pages, self.device.num_pages, pool=self.device.name, side="device").tolist()  # before any lock or copy
        with self._mutex:
            self._poll()
            new = [i for i, k in enumerate(keys) if k not in self._index]
            held = [self._index[k] for k in keys if k in self._index]
            for e in held:  # room for the new pages must not come from this prefix's own pages
                e.locks += 1
            try:
                pages = self._alloc_host(len(new))
            finally:
                for e in held:
                    e.locks -= 1
            new = new[: len(pages)]
            if new:
                new_keys = [keys[i] for i in new]
                try:
                    self.engine.backup([device_pages[i] for i in new], pages).wait()
                except BaseException:
                    self.host.allocator.free(pages)
                    raise
                for k, p in zip(new_keys, pages):
                    self._index[k] = _Entry(p)
            self._touch(keys)
            if new and self.storage is not None:
                self._save_to_storage(new_keys, pages)
            result = SaveResult(len(keys), len(held), len(new), len(keys) - len(held) - len(new))
            self.stats.saved_pages += result.saved
            self.stats.save_already_held += result.already_held
            self.stats.save_no_space += result.no_space
            return result

    def _save_to_storage(self, keys: list[PageHash], pages: list[int]) -> None:
        job = self.storage.submit("save", keys, pages)
        if job is None:  # queue full past the back-pressure wait: counted by the tier
            return
        for k in keys:
            self._index[k].locks += 1
        self._saving.append((job, keys))
        self.stats.l3_save_jobs += 1

    # ---- L3 -> host -> device ----------------------------------------------------
    def load(self, keys: Sequence[PageHash], device_pages: Sequence[int]) -> OffloadLoad:
        """Bring the leading available pages of ``keys`` into ``device_pages``, layer by layer."""
        if len(keys) != len(device_pages):
            raise ConfigError(f"load: {len(keys)} page keys but {len(device_pages)} device pages; pass one device page per key")
        device_pages = checked_pages(device_pages, self.device.num_pages, pool=self.device.name, side="device").tolist()  # before any lock or copy
        with self._mutex:
            self._poll()
            host = self._host_prefix(keys)
            locked = list(keys[:host])
            for k in locked:
                self._index[k].locks += 1
            arrived = self._prefetch(list(keys[host:])) if self.storage is not None and host < len(keys) else []
            locked += arrived
            self._touch(locked)
            n = len(locked)
            job = self.engine.load([self._index[k].page for k in locked], list(device_pages[:n])) if n else None
            self.stats.loaded_from_host += host
            self.stats.loaded_from_storage += len(arrived)
            self.stats.load_shortfall += len(keys) - n
            return OffloadLoad(len(keys), n, host, len(arrived), list(device_pages[:n]), job, locked)

    def _prefetch(self, keys: list[PageHash]) -> list[PageHash]:
        """Fetch the stored prefix of ``keys`` into host pages; returns the keys that arrived (locked, indexed)."""
        for i, k in enumerate(keys):  # stop at a page the host already holds: never index a key twice
            if k in self._index:
                keys = keys[:i]
                break
        stored = self.storage.stored_prefix(keys)
        if stored < self.storage_config.min_prefetch_pages:
            return []
        pages = self._alloc_host(stored)
        if not pages:
            return []
        keys = keys[: len(pages)]
        job = self.storage.submit("prefetch", keys, pages)
        cfg = self.storage_config
        finished = job.settle(cfg.prefetch_policy, cfg.prefetch_budget_s(len(keys)))
        arrived = job.arrived  # leading pages complete and verified; later ones may still be written
        for k, p in zip(keys[:arrived], pages[:arrived]):
            e = self._index[k] = _Entry(p)
            e.locks = 1
        rest = pages[arrived:]
        if rest:
            if finished:
                self.host.allocator.free(rest)
            else:
                self._orphans.append((job, rest))
        return keys[:arrived]

    def release(self, load: OffloadLoad) -> None:
        """Wait for ``load`` to land and unlock its host pages. Idempotent."""
        if load._released:
            return
        load._released = True
        try:
            load.wait()
        finally:
            with self._mutex:
                for k in load._locked:
                    self._index[k].locks -= 1

    # ---- space -----------------------------------------------------------------------
    def _host_prefix(self, keys: Sequence[PageHash]) -> int:
        index = self._index
        n = 0
        for k in keys:
            if k not in index:
                break
            n += 1
        return n

    def _touch(self, keys: Sequence[PageHash]) -> None:
        """Deepest page first, root last: the root ends most recent, so leaves are evicted first."""
        index = self._index
        for k in reversed(keys):
            if k in index:
                index.move_to_end(k)

    def _alloc_host(self, n: int) -> list[int]:
        """Up to ``n`` host pages, evicting unlocked LRU pages for room; fewer when the rest are locked."""
        if n == 0:
            return []
        alloc = self.host.allocator
        short = n - alloc.num_free
        if short > 0:
            victims = []
            for k, e in self._index.items():
                if e.locks == 0:
                    victims.append(k)
                    if len(victims) == short:
                        break
            alloc.free([self._index.pop(k).page for k in victims])
            self.stats.evicted_pages += len(victims)
        return alloc.alloc(min(n, alloc.num_free)).pages

    def _poll(self) -> None:
        """Unlock pages whose L3 save finished; free pages of abandoned prefetches that are done."""
        if self._saving:
            still = []
            for job, keys in self._saving:
                if job.finished.is_set():
                    for k in keys:
                        self._index[k].locks -= 1
                else:
                    still.append((job, keys))
            self._saving = still
        if self._orphans:
            still = []
            for job, pages in self._orphans:
                if job.finished.is_set():
                    self.host.allocator.free(pages)
                else:
                    still.append((job, pages))
            self._orphans = still
        if self.storage is not None:
            self.storage.take_finished()

    # ---- lifecycle -------------------------------------------------------------------
    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait for device copies and L3 writes in flight (bounded); True when all finished."""
        self.engine.drain()
        deadline = time.monotonic() + timeout_s
        with self._mutex:
            jobs = [j for j, _ in self._saving] + [j for j, _ in self._orphans]
        ok = all(j.wait(max(0.0, deadline - time.monotonic())) for j in jobs)
        with self._mutex:
            self._poll()
        return ok

    def check_integrity(self) -> None:
        """Index and allocator agree: every indexed page allocated once, nothing else allocated but orphans."""
        with self._mutex:
            pages = [e.page for e in self._index.values()]
            orphaned = [p for _, ps in self._orphans for p in ps]
            assert len(set(pages)) == len(pages), "a host page is indexed twice"
            assert set(pages) | set(orphaned) == self.host.allocator.allocated_pages(), "host allocator and index disagree"
            assert all(e.locks >= 0 for e in self._index.values()), "negative lock count"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain()
        self.engine.close()
        if self.storage is not None:
            self.storage.close()

    def __enter__(self) -> OffloadCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
