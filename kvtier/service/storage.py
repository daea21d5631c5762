"""The node service's L3 tier (``kvtier serve --storage-url``): a store below the region, written
through and read back into it.

The objects are the ones an engine's own L3 writes (:class:`~kvtier.l3.tier.StorageTier` over a
:class:`~kvtier.pools.host.HostPool` that is the service's own mapping of the region, two tiers on one
store, every job naming its namespace): same keys (``namespace/page-hash``), same header and checksum, so
a service and an engine of the same namespace read each other's objects. A page of several shards (vLLM's
tensor-parallel ranks of an MHA/GQA model: :meth:`~kvtier.service.region.RegionFormat.of_shards`) is one
object per shard, each under the namespace that rank's own L3 uses (the shard's fingerprint with the split, the rank),
written and read through a pool over that rank's slice of the region: a page is saved when every shard is,
and comes back only with every shard. A page of an engine's own pools (SGLang's KV pool and its DSA indexer:
:meth:`~kvtier.service.region.RegionFormat.of_rows`) is one object per row, as that engine's own L3 writes
it: under the pool's namespace, named by the engine (its page hash, which the ops that name the page give
beside its key), framed by the pool's fingerprint and page size -- saved and loaded only where the op gave
the names.

* **Write-through**: a page an engine publishes (the first page of its key) is saved. The service
  holds it in the index under a client of its own (one per namespace, negative ids) while the save
  reads its bytes, so it is neither evicted nor handed out to be rewritten.
* **A hybrid model's objects** (a region with object pools, :meth:`~kvtier.service.region.RegionFormat.with_objects`)
  are saved as its engine's own L3 saves them: under the engine's namespace, named by their group keys, framed by
  the group's object spec. A find that misses in the region starts a load of the objects it asked for, each key on
  its own (a boundary reads some of a prefix's objects, not a run): the ones the store holds are read into the
  pool, checked, and published.
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
from dataclasses import dataclass, field

from kvtier.errors import KVTierError, ServiceError
from kvtier.hashing import Namespace, name_key
from kvtier.l3.base import KeyStatus, redact_url
from kvtier.l3.registry import open_backend
from kvtier.l3.page import PageCodec
from kvtier.l3.tier import RowBytes, StorageJob, StorageTier
from kvtier.pools.host import HostPool, region_offsets
from kvtier.service.index import HostIndex
from kvtier.service.metrics import namespace_label
from kvtier.service.region import Region, RegionFormat, map_region

log = logging.getLogger(__name__)

#: save jobs queued at most (one per publish that indexed pages, every engine's together: past it a save is skipped, counted)
SAVE_QUEUE_DEPTH = 1024
#: a find's objects one load reads in from the store at most (each key is asked of the store on its own)
MAX_OBJECT_LOAD = 64


@dataclass(eq=False)
class Load:
    """Pages of ``namespace``'s ``keys`` (the keys after a lookup's run) coming from the store. ``done``
    once whatever of them arrived is published (or nothing was found). ``jobs``: one per shard (or row).
    ``names``: the keys' object names, where the engine names them."""

    namespace: str
    keys: list[bytes]
    names: list[str] | None = None
    #: the region's pool it loads into (0: pages, a lookup's; k: object pool k's objects, a find's -- each key on its own)
    pool: int = 0
    #: an object load's keys (the index's) whose objects are read in, in its jobs' order
    fetched: list[bytes] = field(default_factory=list)
    jobs: list[StorageJob] = field(default_factory=list)
    #: the region pages (ids region-wide) its jobs read into
    pages: list[int] = field(default_factory=list)
    #: a shard's job could not be queued: nothing of it is published (the other shards' jobs are cancelled)
    short: bool = False
    #: its jobs not back yet
    left: int = 0
    done: bool = False


@dataclass(eq=False)
class Save:
    """The save of ``pages`` (published under ``namespace``): one job per shard; saved where every shard is."""

    namespace: str
    pages: list[int]
    left: int
    ok: list[bool]


@dataclass(frozen=True)
class Tiers:
    """The service's tiers on the store, shared by every namespace (each job names its own): the
    write-through's saves, and the loads on a worker (and I/O threads) of their own -- for each shard (or
    row) of a page, a pair over its slice of the region."""

    saves: list[StorageTier]
    loads: list[StorageTier]
    #: per object pool (1, 2, ...): its (saves, loads) tiers per shard, over each shard's slice of that pool's part
    objects: dict[int, tuple[list[StorageTier], list[StorageTier]]] = field(default_factory=dict)

    def __iter__(self):
        return iter(self.saves + self.loads + [t for saves, loads in self.objects.values() for t in saves + loads])

    def object_saves(self) -> list[StorageTier]:
        return [t for saves, _loads in self.objects.values() for t in saves]

    def object_loads(self) -> list[StorageTier]:
        return [t for _saves, loads in self.objects.values() for t in loads]


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


def shard_prefixes(namespace: str, fmt: RegionFormat) -> list[str]:
    """Each shard's (or row's) L3 object prefix for an engine of ``namespace`` and page format ``fmt``: the namespace
    itself for a page of one shard; else the namespace each tensor-parallel rank's own L3 uses (the model, the salt
    and the fingerprint with the split of ``namespace``, the rank), or each row's pool's (the model, the rank and
    the salt of ``namespace``, the pool's fingerprint); a :class:`ServiceError` when ``namespace`` is not one of ``fmt``
    (at rank 0, for shards)."""
    if fmt.shards == 1 and fmt.rows is None:
        return [namespace]
    try:
        ns = Namespace.parse(namespace)
    except KVTierError:
        ns = None
    if ns is None or ns.spec_fingerprint != fmt.fingerprint or (fmt.rows is None and ns.tp_rank != 0):  # (a label: never the salt)
        part = "row" if fmt.rows else "rank"
        raise ServiceError(f"hello's namespace {namespace_label(namespace)!r} is not a kvtier namespace of its format {fmt.fingerprint}"
                           f"{'' if fmt.rows else ' at rank 0'}: the service's L3 names each {part}'s objects from it")
    if fmt.rows is not None:  # (the rows' fingerprints are bound by the format's, which the namespace names)
        return [str(Namespace(ns.model, row.fingerprint, ns.tp_rank, ns.salt)) for row in fmt.rows]
    # (the split is in the fingerprint: each rank's objects are that split's, as the rank's own L3 names them)
    return [str(Namespace(ns.model, ns.spec_fingerprint, r, ns.salt)) for r in range(fmt.shards)]


def _part_pages(region: Region, memory) -> list:
    """What each part of a page is stored from: a host pool over each shard's slice of the region, or each row's bytes."""
    fmt = region.format
    if fmt.rows is not None:
        offsets, _ = region_offsets(fmt.buffer_page_bytes, 1, region.num_pages)
        buffer = memoryview(memory.numpy()).cast("B")
        return [RowBytes(buffer[at : at + n * region.num_pages], n, PageCodec(row.fingerprint, n, row.page_size))
                for at, n, row in zip(offsets, fmt.buffer_page_bytes, fmt.rows)]
    pools = []
    for r in range(fmt.shards):
        start, size = fmt.shard(region.num_pages, r, fmt.shards)
        pools.append(HostPool(fmt.spec, region.num_pages, fmt.layout, memory=memory[start : start + size],
                              name=f"node service region (L3{f', shard {r}' if fmt.shards > 1 else ''})"))
    return pools


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
        self._saving: dict[StorageJob, Save] = {}
        self._prefixes: dict[str, list[str]] = {}  # namespace -> each shard's
        self.index: HostIndex | None = None
        self._region: Region | None = None
        self.max_load_pages = 0

    def fileno(self) -> int:
        """Readable when a worker finished something: then call :meth:`poll`."""
        return self._wake

    def bind(self, region: Region, index: HostIndex) -> None:
        """Map ``region`` (its format names the spec of each shard, or its rows' objects) as a host pool per shard, or
        a row's bytes per row; ``index`` is the service's."""
        memory = map_region(region.path, region.size, pin=False)
        pools = _part_pages(region, memory)
        parts = len(pools) > 1
        self._region = region
        self.index = index
        self.max_load_pages = max(1, region.num_pages // 2)

        def tier(pool: HostPool, what: str, depth: int, r: int) -> StorageTier:
            name = f"kvtier-serve-{what}" + (f"{r}" if parts else "")
            return StorageTier(self.backend, pool, name, owns_backend=False, on_finished=self._notify, queue_depth=depth)

        fmt = region.format
        objects = {}
        for k, pool in enumerate(fmt.objects, start=1):
            hosts = []
            if pool.spec is None:  # (a row of an engine's own pool: SGLang's SWA or Mamba host pool)
                start, size = fmt.part(k, region.num_pages)
                hosts.append(RowBytes(memoryview(memory[start : start + size].numpy()).cast("B"), pool.row_bytes,
                                      PageCodec(pool.row.fingerprint, pool.row_bytes, pool.row.page_size)))
            for r in range(pool.shards if pool.spec is not None else 0):  # (each rank's slice: a host pool of the group's spec)
                start, size = fmt.object_shard(k, region.num_pages, r)
                hosts.append(HostPool(pool.spec, region.num_pages, fmt.layout, memory=memory[start : start + size],
                                      name=f"node service region (L3, KV group {pool.name!r}{f', shard {r}' if pool.shards > 1 else ''})"))

            objects[k] = tuple([StorageTier(self.backend, h, f"kvtier-serve-{what}-{pool.name}" + (f"{r}" if len(hosts) > 1 else ""),
                                            owns_backend=False, on_finished=self._notify, queue_depth=depth) for r, h in enumerate(hosts)]
                               for what, depth in (("saves", SAVE_QUEUE_DEPTH), ("loads", 64)))
        self._tiers = Tiers([tier(p, "saves", SAVE_QUEUE_DEPTH, r) for r, p in enumerate(pools)],
                            [tier(p, "loads", 64, r) for r, p in enumerate(pools)], objects)

    def prefixes(self, namespace: str) -> list[str]:
        """Each shard's object prefix for ``namespace`` (:func:`shard_prefixes`, of the bound region's format)."""
        got = self._prefixes.get(namespace)
        if got is None:
            got = self._prefixes[namespace] = shard_prefixes(namespace, self._region.format)
        return got

    def _object_prefixes(self, namespace: str, pool: int) -> list[str]:
        """Object pool ``pool``'s L3 prefix per shard: each shard's page prefix for a group of a spec (:meth:`prefixes`: its
        objects are named by their group keys under each rank's namespace, as each rank's own L3 names them), or the
        namespace of the row's pool (as :func:`shard_prefixes` names a row's) for an engine's own pool."""
        row = self._region.format.objects[pool - 1].row
        if row is None:
            return self.prefixes(namespace)
        ns = Namespace.parse(namespace)  # (checked at hello: shard_prefixes)
        return [str(Namespace(ns.model, row.fingerprint, ns.tp_rank, ns.salt))]

    def _names_object(self, pool: int) -> bool:
        """Whether object pool ``pool``'s objects are named by the engine (its rows': saved and loaded only with names)."""
        return self._region.format.objects[pool - 1].row is not None

    # ---- what the selector thread asks ---------------------------------------------------------
    def published(self, namespace: str, pages: list[int], keys: list[bytes], names: list[str] | None = None,
                  owners: list[int] | None = None) -> None:
        """``pages`` (``keys[i]``'s, whose objects are ``names[i]`` where the engine names them, with owner tags
        ``owners[i]``) were just published and indexed: save them, held until saved. Pages of an engine that names its
        objects are saved only with the names."""
        if not pages or (names is None and self._region.format.rows is not None):
            return
        n = self._region.num_pages
        if max(pages) >= n:  # (objects: an engine publishes a pool's apart, but a publish may mix them)
            by_pool: dict[int, list[int]] = {}
            for i, page in enumerate(pages):
                by_pool.setdefault(page // n, []).append(i)
            for pool, at in sorted(by_pool.items()):
                mine, mine_keys = [pages[i] for i in at], [keys[i] for i in at]
                mine_names = None if names is None else [names[i] for i in at]
                mine_owners = None if owners is None else [owners[i] for i in at]
                if pool == 0:
                    self.published(namespace, mine, mine_keys, mine_names, mine_owners)
                else:
                    self._save_objects(namespace, pool, mine, mine_keys, mine_names, mine_owners)
            return
        self._queue_save(namespace, pages, zip(self._tiers.saves, self.prefixes(namespace)), keys, pages, names, owners)

    def _queue_save(self, namespace: str, pages: list[int], shards, keys: list[bytes], host_pages: list[int],
                    names: list[str] | None, owners: list[int] | None = None) -> None:
        """Save ``pages`` (region-wide ids, held until saved) under ``namespace``: a job on each shard's (tier, prefix) of
        ``shards``, reading the tier's ``host_pages``; saved where every shard's job saved it."""
        self.index.hold(self._client(namespace), pages)
        save = Save(namespace, pages, 0, [True] * len(pages))
        for tier, prefix in shards:
            job = tier.submit("save", keys, host_pages, prefix=prefix, names=names, owners=owners)
            if job is None:  # the tier's queue is full: not saved (counted by the tier too)
                save.ok = [False] * len(pages)
                continue
            save.left += 1
            self._saving[job] = save
        if not save.left:
            self._saved(save)

    def _save_objects(self, namespace: str, pool: int, pages: list[int], keys: list[bytes], names: list[str] | None = None,
                      owners: list[int] | None = None) -> None:
        """Object pool ``pool``'s ``pages`` (region-wide ids) saved as the engine's own L3 saves them: under ``namespace``
        by their keys, or (an engine's own pool's rows) under that pool's namespace by their ``names``, whose digests
        head the objects -- only where the names are given."""
        if self._names_object(pool):
            if names is None:
                return
            keys = [name_key(name) for name in names]  # (the index's keys are the pool's: group_object_key of these)
        base = pool * self._region.num_pages
        shards = zip(self._tiers.objects[pool][0], self._object_prefixes(namespace, pool))  # (every shard's object)
        self._queue_save(namespace, pages, shards, keys, [p - base for p in pages], names, owners)

    def load_objects(self, namespace: str, pool: int, keys: list[bytes], names: list[str] | None = None) -> Load | None:
        """The load of object pool ``pool``'s ``keys`` (a find's misses in the region; ``names``: their objects', where the
        engine names them), each on its own: started now, or None when there is nothing to fetch (every key in the region
        or on its way, the store down, the engine names its objects and gave no names)."""
        if self._names_object(pool) and names is None:
            return None
        named = dict(zip(keys, names)) if names is not None else {}
        keys = [k for k in dict.fromkeys(keys) if not self.index.has(namespace, k) and (namespace, k) not in self._fetching]
        if not keys:
            return None
        first = (namespace, keys[0])
        going = self._loads.get(first)
        if going is not None:
            return going
        load_tiers = self._tiers.objects[pool][1]
        if not all(t.available for t in load_tiers):
            return None
        keys = keys[:MAX_OBJECT_LOAD]
        load = Load(namespace, keys, [named[k] for k in keys] if named else None, pool=pool)
        self._loads[first] = load
        self._finder.submit(self._find_each, list(zip(load_tiers, self._object_prefixes(namespace, pool))), load)
        return load

    def load(self, namespace: str, keys: list[bytes], names: list[str] | None = None) -> Load | None:
        """The load of ``keys`` (those after a lookup's run in the region; ``names``: their objects', where the
        engine names them), started now or already under way; None when there is nothing to fetch (the first key
        is in the region, the store is down, the engine names its objects and gave no names)."""
        if not keys or self.index.has(namespace, keys[0]) or (names is None and self._region.format.rows is not None):
            return None
        first = (namespace, keys[0])
        going = self._loads.get(first) or self._fetching.get(first)
        if going is not None:
            return going
        if not all(t.available for t in self._tiers.loads):
            return None
        n = self.max_load_pages
        load = Load(namespace, keys[:n], None if names is None else names[:n])
        self._loads[first] = load
        self._finder.submit(self._find, list(zip(self._tiers.loads, self.prefixes(namespace))), load)
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
            if not (self._fetch_objects(load, found) if load.pool else self._fetch(load, found)):
                done.append(self._end(load))
        for tier in self._every_tier():
            for job in tier.take_finished():
                if job.kind == "save":
                    save = self._saving.pop(job)
                    save.ok = [ok and status is KeyStatus.OK for ok, status in zip(save.ok, job.statuses)]
                    save.left -= 1
                    if not save.left:
                        self._saved(save)
                else:
                    load = job.tag
                    load.left -= 1
                    if not load.left:  # (every shard's job is back)
                        done.append(self._fetched(load))
        self.counters.corrupt_pages = sum(t.discarded_corrupt for t in self._every_tier())
        return done

    def status(self) -> dict:
        # (None until the first hello made the tiers: nothing is known yet)
        available = all(t.available for t in self._every_tier()) if self._tiers is not None else None
        return {"url": redact_url(self.url), "available": available,
                "saving_pages": sum(len(s.pages) for s in set(self._saving.values())), "fetching_pages": len(self._fetching),
                **self.counters.as_dict(), **self._store_deletions()}

    #: what a store that evicts by itself (the file store) counts it deleted, by bound (:mod:`kvtier.l3.tenant_bounds`)
    STORE_COUNTERS = ("evicted_objects", "expired_objects", "capped_objects", "refused_full")

    def _backends(self) -> list:
        """The stores behind the tiers, each once (shards and object pools may share one)."""
        return list({id(t.backend): t.backend for t in self._every_tier()}.values())

    def tag_bytes(self) -> dict[int, int] | None:
        """Bytes per owner tag in the store, over its backends, where it keeps them (a file store with tenant bounds)."""
        backends = [b for b in self._backends() if getattr(b, "tenants", None)]
        if not backends:
            return None
        out: dict[int, int] = {}
        for b in backends:
            for tag, n in dict(b.tag_bytes).items():  # (a copy: I/O threads count into it)
                out[tag] = out.get(tag, 0) + n
        return out

    def _store_deletions(self) -> dict[str, int]:
        """The store's own counts, over its backends (one per shard), where it keeps them; nothing for Redis or Mooncake."""
        backends = self._backends()
        return {name: sum(getattr(b, name) for b in backends if hasattr(b, name)) for name in self.STORE_COUNTERS
                if any(hasattr(b, name) for b in backends)}

    def close(self, drain_timeout_s: float) -> bool:
        """Wait up to ``drain_timeout_s`` for the saves queued and under way, stop the loads, and close
        the store. True when every save finished."""
        for load in self._loads.values():
            for job in load.jobs:
                job.cancel()  # (after the batch in flight: nobody waits for it any more)
        deadline = time.monotonic() + drain_timeout_s
        drained = True
        if self._tiers is not None:  # (the pages' saves and every object pool's)
            for tier in self._tiers.saves + self._tiers.object_saves():
                drained = tier.drain(max(0.0, deadline - time.monotonic())) and drained
            for tier in self._tiers.loads + self._tiers.object_loads():
                tier.drain(max(0.0, deadline - time.monotonic()))  # (cancelled: at most the batch in flight, in what time is left)
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

    def _find_each(self, shards: list[tuple[StorageTier, str]], load: Load) -> None:
        """(the exists thread) Which of an object load's keys the store has, every shard's object (their indices), each asked
        on its own (none if that failed)."""
        present: list[int] = []
        try:
            for i in range(len(load.keys)):
                store_keys, names = self._store_names(load, [i])
                if all(tier.stored_prefix(store_keys, prefix, names) for tier, prefix in shards):
                    present.append(i)
        except Exception as e:
            log.warning("L3 lookup of %d objects failed: %s", len(load.keys), e)
            present = []
        finally:
            self._found.put((load, present))
            self._notify()

    def _find(self, shards: list[tuple[StorageTier, str]], load: Load) -> None:
        """(the exists thread) How many of the load's leading keys the store has, every shard's object (0 if that failed)."""
        found = 0
        try:
            found = len(load.keys)
            for tier, prefix in shards:
                found = tier.stored_prefix(load.keys[:found], prefix, None if load.names is None else load.names[:found]) if found else 0
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
        keys: list[bytes] = []
        seen: set[bytes] = set()
        for key in load.keys[:found]:
            if self.index.has(load.namespace, key) or (load.namespace, key) in self._fetching or key in seen:
                break  # (a key asked twice -- a client's repeat, never a chain's -- ends the run: each page is read once)
            keys.append(key)
            seen.add(key)
        if not keys:
            return False
        cid = self._client(load.namespace)
        pages = self.index.reserve(cid, len(keys))
        if not pages:
            return False
        load.pages = pages
        keys = keys[: len(pages)]
        names = None if load.names is None else load.names[: len(keys)]
        if not self._queue_fetch(load, zip(self._tiers.loads, self.prefixes(load.namespace)), keys, pages, names, cid):
            return False
        for key in keys:
            self._fetching[(load.namespace, key)] = load
        return True

    def _queue_fetch(self, load: Load, shards, keys: list[bytes], host_pages: list[int], names: list[str] | None, cid: int) -> bool:
        """Read ``load``'s reserved pages in: a job on each shard's (tier, prefix) of ``shards``, into the tier's
        ``host_pages``. False (its pages released) when no shard's job could queue; a load some shard's job could not
        join is short (nothing of it is published, the others' jobs cancelled)."""
        for tier, prefix in shards:
            job = tier.submit("prefetch", keys, host_pages, tag=load, prefix=prefix, names=names)
            if job is None:
                for j in load.jobs:  # (the shards' jobs already queued read into pages nobody is offered, then stop)
                    j.cancel()
                if not load.jobs:
                    self.index.release(cid, load.pages)
                    return False
                load.short = True
                break
            load.jobs.append(job)
            load.left += 1
        return True

    @staticmethod
    def _store_names(load: Load, at: list[int]) -> tuple[list[bytes], list[str] | None]:
        """An object load's keys ``at`` as its store tiers name them: the keys (the engine's group keys), or the digests of
        the names the engine gives them (an engine's own pool's rows) and those names."""
        if load.names is None:
            return [load.keys[i] for i in at], None
        names = [load.names[i] for i in at]
        return [name_key(name) for name in names], names

    def _fetch_objects(self, load: Load, present: list[int]) -> bool:
        """Reserve object pool pages for the keys the store holds (not in the region, nor on their way) and read them in."""
        ns = load.namespace
        at = [i for i in present if not self.index.has(ns, load.keys[i]) and (ns, load.keys[i]) not in self._fetching]
        self.counters.found_pages += len(at)
        if not at:
            return False
        cid = self._client(load.namespace)
        pages = self.index.reserve(cid, len(at), load.pool)
        if not pages:
            return False
        at = at[: len(pages)]
        store_keys, names = self._store_names(load, at)
        base = load.pool * self._region.num_pages
        load.pages = pages
        shards = zip(self._tiers.objects[load.pool][1], self._object_prefixes(load.namespace, load.pool))
        if not self._queue_fetch(load, shards, store_keys, [p - base for p in pages], names, cid):
            return False
        keys = load.fetched = [load.keys[i] for i in at]
        for key in keys:
            self._fetching[(load.namespace, key)] = load
        return True

    def _fetched(self, load: Load) -> Load:
        """Publish the pages that arrived verified in every shard (then let them go: READY, offered to lookups); free the rest."""
        cid = self._client(load.namespace)
        job = load.jobs[0]
        n = 0 if load.short else min(j.arrived for j in load.jobs)
        keys = load.fetched if load.pool else job.keys  # (the index's keys: an object pool's store keys may be its names')
        pages = load.pages[: len(keys)]
        self.index.publish(cid, pages[:n], keys[:n])
        self.index.release(cid, pages)
        for key in keys:
            self._fetching.pop((load.namespace, key), None)
        self.counters.fetched_pages += n
        self.counters.fetch_failed_pages += len(job.keys) - n
        return self._end(load)

    def _end(self, load: Load) -> Load:
        del self._loads[(load.namespace, load.keys[0])]
        load.done = True
        return load

    def _saved(self, save: Save) -> None:
        self.index.release(self._client(save.namespace), save.pages)
        ok = save.ok.count(True)
        self.counters.saved_pages += ok
        self.counters.save_failed_pages += len(save.pages) - ok
