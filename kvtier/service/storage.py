"""The node service's L3 tier (``kvtier serve --storage-url``): a store below the region, written
through and read back into it.

The objects are the ones an engine's own L3 writes (:class:`~kvtier.l3.tier.StorageTier` over a
:class:`~kvtier.pools.host.HostPool` that is the service's own mapping of the region, two tiers on one
store, every job naming its namespace): same keys (``namespace/page-hash``), same header and checksum, so
a service and an engine of the same namespace read each other's objects.

* **Write-through**: a page an engine publishes (the first page of its key) is saved. The service
  holds it in the index under a client of its own (one per namespace, negative ids) while the save
  reads its bytes, so it is neither evicted nor handed out to be rewritten.
* **Load**: a lookup whose run in the region ends before its keys starts a :class:`Load` of the keys
  after the run: the store's leading run of them (one batched ``exists``), region pages reserved for
  as many as there is room for (leased to the service's client: offered to nobody), the objects read
  into them and checked as the engine's tier checks them, then published -- each page offered only
  once its bytes are in and verified. A page that fails its check is deleted from the store and
  counted (``corrupt_pages``); the run stops there.

Nothing here blocks the selector thread: the ``exists`` runs on a thread of its own, reads and saves
on the tiers' workers -- the loads on a tier of their own, so an engine waiting for a lookup never
queues behind the write-through of what every engine publishes -- each backend call under its deadline
and the store's circuit breaker. The threads are a fixed few whatever the namespaces (two tiers' workers
and I/O threads, the ``exists`` thread): a namespace costs the service no thread of its own; a worker that finishes writes the eventfd
(:meth:`ServiceStorage.fileno`) the selector watches, and the selector thread applies the results
(:meth:`ServiceStorage.poll`) -- it alone touches the index.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtier.l3.base import KeyStatus, redact_url
from kvtier.l3.registry import open_backend
from kvtier.l3.tier import StorageJob, StorageTier
from kvtier.pools.host import HostPool
from kvtier.service.index import HostIndex
from kvtier.service.region import Region, map_region

log = logging.getLogger(__name__)

#: save jobs queued at most (one per publish that indexed pages, every engine's together: past it a save is skipped, counted)
SAVE_QUEUE_DEPTH = 1024


@dataclass(eq=False)
class Load:
    """Pages of ``namespace``'s ``keys`` (the keys after a lookup's run) coming from the store. ``done``
    once whatever of them arrived is published (or nothing was found)."""

    namespace: str
    keys: list[bytes]
    job: StorageJob | None = None
    done: bool = False


@dataclass(frozen=True)
class Tiers:
    """The service's tiers on the store, shared by every namespace (each job names its own): the
    write-through's saves, and the loads on a worker (and I/O threads) of their own."""

    saves: StorageTier
    loads: StorageTier

    def __iter__(self):
        return iter((self.saves, self.loads))


@dataclass
class StorageCounters:
    """What ``kvtier serve --status`` reports under ``l3``."""

    saved_pages: int = 0
    save_failed_pages: int = 0
    found_pages: int = 0
    fetched_pages: int = 0
    fetch_failed_pages: int = 0
    corrupt_pages: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ServiceStorage:
    """The store at ``url`` (opened now: a bad URL or an unreachable server is a
    :class:`~kvtier.errors.StorageError` before the service listens), below the region :meth:`bind`
    names. One lookup brings in at most half the region's pages (``max_load_pages``)."""

    def __init__(self, url: str):
        self.url = url
        self.backend = open_backend(url)
        self.counters = StorageCounters()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False
        self._wake_lock = threading.Lock()
        self._finder = ThreadPoolExecutor(1, thread_name_prefix="kvtier-serve-l3-exists")
        self._found: queue.SimpleQueue[tuple[Load, int]] = queue.SimpleQueue()
        self._tiers: Tiers | None = None
        self._clients: dict[str, int] = {}  # namespace -> the service's own index client
        self._fetching: dict[tuple[str, bytes], Load] = {}  # keys whose pages are being read in
        self._loads: dict[tuple[str, bytes], Load] = {}  # loads by their first key, until done
        self._saving: dict[StorageJob, list[int]] = {}
        self.index: HostIndex | None = None
        self._pool: HostPool | None = None
        self.max_load_pages = 0

    def fileno(self) -> int:
        """Readable when a worker finished something: then call :meth:`poll`."""
        return self._wake

    def bind(self, region: Region, index: HostIndex) -> None:
        """Map ``region`` (its format names the spec) as a host pool; ``index`` is the service's."""
        self._pool = HostPool(region.format.spec, region.num_pages, region.format.layout,
                              memory=map_region(region.path, region.size, pin=False), name="node service region (L3)")
        self.index = index
        self.max_load_pages = max(1, region.num_pages // 2)
        self._tiers = Tiers(*(StorageTier(self.backend, self._pool, f"kvtier-serve-{what}", owns_backend=False, on_finished=self._notify,
                                          queue_depth=depth) for what, depth in (("saves", SAVE_QUEUE_DEPTH), ("loads", 64))))

    # ---- what the selector thread asks ---------------------------------------------------------
    def published(self, namespace: str, pages: list[int], keys: list[bytes]) -> None:
        """``pages`` (``keys[i]``'s) were just published and indexed: save them, held until saved."""
        if not pages:
            return
        self.index.hold(self._client(namespace), pages)
        job = self._tiers.saves.submit("save", keys, pages, prefix=namespace)
        if job is None:  # the tier's queue is full: not saved (counted by the tier too)
            self._saved(namespace, pages, ok=0)
            return
        self._saving[job] = pages

    def load(self, namespace: str, keys: list[bytes]) -> Load | None:
        """The load of ``keys`` (those after a lookup's run in the region), started now or already under
        way; None when there is nothing to fetch (the first key is in the region, the store is down)."""
        if not keys or self.index.has(namespace, keys[0]):
            return None
        first = (namespace, keys[0])
        going = self._loads.get(first) or self._fetching.get(first)
        if going is not None:
            return going
        tier = self._tiers.loads
        if not tier.available:
            return None
        load = Load(namespace, keys[: self.max_load_pages])
        self._loads[first] = load
        self._finder.submit(self._find, tier, load)
        return load

    def poll(self) -> list[Load]:
        """Apply what the workers finished; the loads done now."""
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        done = []
        while True:
            try:
                load, found = self._found.get_nowait()
            except queue.Empty:
                break
            if not self._fetch(load, found):
                done.append(self._end(load))
        for tier in self._every_tier():
            for job in tier.take_finished():
                if job.kind == "save":
                    self._saved(job.prefix, self._saving.pop(job), ok=job.statuses.count(KeyStatus.OK))
                else:
                    done.append(self._fetched(job))
        self.counters.corrupt_pages = sum(t.discarded_corrupt for t in self._every_tier())
        return done

    def status(self) -> dict:
        # (None until the first hello made the tiers: nothing is known yet)
        available = all(t.available for t in self._every_tier()) if self._tiers is not None else None
        return {"url": redact_url(self.url), "available": available,
                "saving_pages": sum(len(p) for p in self._saving.values()), "fetching_pages": len(self._fetching),
                **self.counters.as_dict()}

    def close(self, drain_timeout_s: float) -> bool:
        """Wait up to ``drain_timeout_s`` for the saves queued and under way, stop the loads, and close
        the store. True when every save finished."""
        for load in self._loads.values():
            if load.job is not None:
                load.job.cancel()  # (after the batch in flight: nobody waits for it any more)
        deadline = time.monotonic() + drain_timeout_s
        drained = self._tiers is None or self._tiers.saves.drain(drain_timeout_s)
        if self._tiers is not None:  # (cancelled: at most the batch in flight, in what time is left)
            self._tiers.loads.drain(max(0.0, deadline - time.monotonic()))
        self.poll()
        for tier in self._every_tier():
            tier.close(timeout_s=0.0)
        self._finder.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:  # (a worker still finishing never writes into a closed, maybe reused, fd)
            self._closed = True
            os.close(self._wake)
        self.backend.close()
        return drained

    # ---- workers' side -------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._wake_lock:
            if not self._closed:
                os.eventfd_write(self._wake, 1)

    def _find(self, tier: StorageTier, load: Load) -> None:
        """(the exists thread) How many of the load's leading keys the store has (0 if that failed)."""
        found = 0
        try:
            found = tier.stored_prefix(load.keys, load.namespace)
        except Exception as e:  # (the store's faults are mapped to 0 already; this keeps the load from hanging on anything else)
            log.warning("L3 lookup of %d keys failed: %s", len(load.keys), e)
        finally:
            self._found.put((load, found))
            self._notify()

    # ---- the selector thread's bookkeeping -----------------------------------------------------
    def _client(self, namespace: str) -> int:
        cid = self._clients.get(namespace)
        if cid is None:
            cid = self._clients[namespace] = -1 - len(self._clients)
            self.index.attach(cid, namespace)
        return cid

    def _every_tier(self) -> list[StorageTier]:
        return [] if self._tiers is None else list(self._tiers)

    def _fetch(self, load: Load, found: int) -> bool:
        """Reserve pages for the found run (up to the first key in the region or on its way) and read
        them in; False when nothing is fetched."""
        self.counters.found_pages += found
        keys = []
        for key in load.keys[:found]:
            if self.index.has(load.namespace, key) or (load.namespace, key) in self._fetching:
                break
            keys.append(key)
        if not keys:
            return False
        cid = self._client(load.namespace)
        pages = self.index.reserve(cid, len(keys))
        if not pages:
            return False
        job = self._tiers.loads.submit("prefetch", keys[: len(pages)], pages, tag=load, prefix=load.namespace)
        if job is None:
            self.index.release(cid, pages)
            return False
        load.job = job
        for key in job.keys:
            self._fetching[(load.namespace, key)] = load
        return True

    def _fetched(self, job: StorageJob) -> Load:
        """Publish the pages that arrived verified (then let them go: READY, offered to lookups); free the rest."""
        load: Load = job.tag
        cid = self._client(load.namespace)
        n = job.arrived
        self.index.publish(cid, job.host_pages[:n], job.keys[:n])
        self.index.release(cid, job.host_pages)
        for key in job.keys:
            del self._fetching[(load.namespace, key)]
        self.counters.fetched_pages += n
        self.counters.fetch_failed_pages += len(job.keys) - n
        return self._end(load)

    def _end(self, load: Load) -> Load:
        del self._loads[(load.namespace, load.keys[0])]
        load.done = True
        return load

    def _saved(self, namespace: str, pages: list[int], ok: int) -> None:
        self.index.release(self._client(namespace), pages)
        self.counters.saved_pages += ok
        self.counters.save_failed_pages += len(pages) - ok
