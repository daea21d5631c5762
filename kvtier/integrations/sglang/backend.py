"""kvtier as SGLang's HiCache storage backend: ``KvtierStorage``, a ``HiCacheStorage``.

SGLang's cache controller moves pages between its host pool and storage
through this class, on its own I/O threads; kvtier brings its L3: the store
(file, Redis/Valkey incl. cluster, Mooncake Store), checksummed page objects,
namespaces, skip-what-is-stored saves, and fault handling. Start SGLang with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang.backend", "class_name": "KvtierStorage",
        "interface_v1": 1, "storage_url": "redis://127.0.0.1:6379/0"}'

What it guarantees:

* **Whole pages only.** Host indices are token slots; they must be whole,
  page-aligned pages, one per key, or a :class:`~kvtier.errors.PageAlignmentError`
  names the count, the page size and the pool before any byte moves. kvtier
  never hands SGLang's pools a partial page.
* **Zero copy.** ``batch_get_v1`` / ``batch_set_v1`` / ``*_v2`` read and write
  the registered pools' pages in place (:mod:`.pool_pages`); the older
  ``get``/``set`` take SGLang's flat data pages. Both store the same object:
  kvtier's page header (key, fingerprint of the pool's kind, layout and
  geometry, xxh3-128 checksum) and the pool's page bytes.
* **Namespaces.** An L3 key is ``namespace/<SGLang's page hash>``; the
  namespace binds the model, the pool's fingerprint, the shard (TP rank for
  MHA; MLA KV is replicated, so every rank shares shard 0 -- or its DCP rank --
  and only ``is_storage_writer`` ranks write) and a salt.
* **The DSA indexer travels with its page.** The indexer host pool rides on
  the KV pool's slots; a page is a hit (``batch_exists``, ``batch_exists_v2``)
  only while its indexer object is stored too, so an L3 hit never comes
  without its indexer pages (SGLang #30057), and indexer pages that were never
  saved (SGLang #17085) make a miss, not a hit with stale index keys.
* **Faults are misses.** A store that is down, slow past its deadline, or
  returns a corrupt object gives ``False`` / 0 / ``None``, never an exception
  into SGLang's controller threads; a corrupt object is deleted (the next save
  repairs it), and a circuit breaker answers misses without calling a dead
  store for ``cooldown_s``. Hits resume when the store is back.

**The node service instead of a store.** With ``"service": "unix:///path/node.sock"``
(``kvtier serve``) and no ``storage_url``, the pages go to the service's shared host
region (:mod:`.service`): SGLang servers on one node attached to one service share
them -- what one backs up, another prefetches -- in the same namespaces. The service
holds the KV pool and the pools on its page ids (the DSA indexer: one region page
holds a page and its indexer), and each pool with page ids of its own (a sliding-window
layer's, Mamba state) in an object pool of the region, each page under its key there
(per key, as SGLang's trailing-pages policy asks). A service with an L3 store of its own
(``kvtier serve --storage-url``) saves and loads the very objects this backend's own L3 writes (the page
hashes travel beside their digests for it: :mod:`.service`). Faults stay misses:
a service that is down, stalled past ``service_lookup_timeout_s`` or drops the
connection gives misses, and the backend attaches again on its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.logs import log_to_stderr_unless_configured, refusing_start
from kvtier.errors import ConfigError, PageAlignmentError, PageOwnershipError
from kvtier.hashing import Namespace, name_key
from kvtier.integrations.sglang.options import SGLangStorageOptions
from kvtier.integrations.sglang.pool_pages import PoolPages
from kvtier.integrations.sglang.service import ServicePages, region_format
from kvtier.service.region import MAX_OBJECT_POOLS
from kvtier.l3.base import KeyStatus, redact_url
from kvtier.l3.breaker import CircuitBreaker
from kvtier.l3.mover import PageMover, in_order
from kvtier.l3.page import PageCodec
from kvtier.l3.registry import open_backend
from kvtier.pages import first_duplicate

log = logging.getLogger(__name__)


def _encodes(key: str) -> bool:
    try:
        key.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _leading(done: list[bool]) -> int:
    """How many of ``done`` lead before the first False."""
    return done.index(False) if False in done else len(done)


def _refusing_start():
    """A start kvtier refuses (a bad option, a pool the service cannot hold, a required service that is not
    there) is one ERROR line first -- the message names the fix -- so it stands above SGLang's traceback."""
    return refusing_start(log, "kvtier HiCache storage", ("kvtier HiCache storage: ", "kvtier SGLang storage: "))


#: pools whose pages are the KV pool's pages (replicated like KV under MLA)
_KV_SHAPED = {PoolName.KV, PoolName.INDEXER, PoolName.DRAFT, PoolName.DRAFT_INDEXER}


def _sglang_storage_metrics() -> type:
    """SGLang's own ``StorageMetrics`` dataclass when its observability module can be imported (its
    ``StorageMetricsCollector`` asserts ``isinstance`` on what ``get_stats()`` returns), else ``object``."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics as theirs
    except Exception:  # an SGLang without it, or one whose metrics module needs the GPU runtime
        return object
    return theirs if dataclasses.is_dataclass(theirs) else object


@dataclass
class StorageMetrics(_sglang_storage_metrics()):
    """What :meth:`KvtierStorage.get_stats` returns: SGLang's ``StorageMetrics`` (a subclass of it,
    where SGLang is importable) -- the lists its ``StorageMetricsCollector`` reads (pages per batch,
    GB/s per batch; drained by each call, filled only with ``enable_storage_metrics``) -- and
    kvtier's running counters."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    pages_read: int = 0
    pages_written: int = 0
    pages_already_stored: int = 0
    misses: int = 0
    corrupt: int = 0
    faults: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(frozen=True)
class _Pool:
    """One registered host pool: its page views, its page-object codec, its L3 namespace."""

    name: str
    pages: PoolPages
    codec: PageCodec
    prefix: str
    #: rides on the KV pool's slots and must be stored for every KV page (the DSA indexer)
    kv_derived: bool
    #: this rank writes the pool's shard (MLA KV: SGLang's storage writer only; per-rank state: every rank)
    writer: bool = True

    @property
    def own_ids(self) -> bool:
        """Whether the pool's pages have ids of their own (SGLang's SWA and Mamba pools), not the KV pool's page ids."""
        return self.name != PoolName.KV and not self.kv_derived

    def names(self, keys: Sequence[str]) -> list[str]:
        return [f"{self.prefix}/{k}" for k in keys]

    @staticmethod
    def key16(key: str) -> bytes:
        """The 16-byte page key in the object header (SGLang's keys are strings of any length)."""
        return name_key(key)


class KvtierStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over kvtier's L3 (or the node service's region: ``service``). Built by SGLang's backend factory as
    ``KvtierStorage(storage_config, kwargs)``; options come from ``storage_config.extra_config``
    (:class:`~kvtier.integrations.sglang.options.SGLangStorageOptions`)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        log_to_stderr_unless_configured()  # (SGLang configures its own loggers: kvtier's lines get a time and a level)
        with _refusing_start():
            self._start(storage_config)

    def _start(self, storage_config: HiCacheStorageConfig) -> None:
        self.config = storage_config
        self.options = SGLangStorageOptions.from_extra_config(storage_config.extra_config)
        self.model = self.options.model_name or storage_config.model_name or ""
        self.writer = storage_config.is_storage_writer
        self.metrics = StorageMetrics()
        #: keys that could not name an object (not UTF-8 strings): misses, never store faults
        self.invalid_keys = 0
        self._metrics_lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self.mem_pool_host = None
        #: the node service's pages (options.service), made once the pools are known; None: an L3 store
        self.service: ServicePages | None = None
        #: by shard rank, the pages of this rank's own pools whose namespace is not the KV pool's (Mamba state beside MLA
        #: above one rank)
        self.own_services: dict[int, ServicePages] = {}
        self._service_lock = threading.Lock()
        self.backend = self.breaker = self.mover = self._io = None
        self.io_threads = 1
        if self.options.service is None:
            self._open_store()
        where = f"node service {self.options.socket_path}" if self.options.service else redact_url(self.options.url)
        log.info("kvtier HiCache storage: %s, model %r, shard %s, writer %s", where, self.model, self._shard_rank(PoolName.KV),
                 self.writer)

    def _open_store(self) -> None:
        self.backend = open_backend(self.options.url)
        self.breaker = CircuitBreaker(self.backend, self.options.cooldown_s, self.options.max_cooldown_s, probe_key="kvtier-probe/0")
        #: reads, checks, writes and repairs page objects (the same mover as kvtier's own L3 tier)
        self.mover = PageMover(self.backend, self.breaker, on_discard=self._count_corrupt)
        self.io_threads = self.options.io_threads or self.backend.capabilities.io_threads
        #: one pool of I/O threads per direction: a burst of backups never queues ahead of the prefetches
        #: a request's TTFT waits on (SGLang calls each from its own thread; with one I/O thread, there)
        self._io = {kind: ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"kvtier-hicache-{kind}")
                    for kind in ("read", "write")} if self.io_threads > 1 else None

    # ---- registration ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._register(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(host_pool_name, host_pool)

    def _shard_rank(self, name: str) -> int:
        c = self.config
        if c.is_mla_model and name in _KV_SHAPED:
            return c.dcp_rank  # MLA KV is the same on every TP rank: one shard per DCP rank
        return c.tp_rank

    def _register(self, name, pool) -> None:
        with _refusing_start():
            self._register_pool(str(name), pool)

    def _register_pool(self, name: str, pool) -> None:
        if name in self._pools and self._pools[name].pages.pool is pool:
            return
        if not hasattr(pool, "get_data_page"):
            raise ConfigError(f"kvtier HiCache storage: pool {name!r} ({type(pool).__name__}) has no get_data_page; "
                              "register an SGLang host pool (MHA, MLA, DSA indexer)")
        c = self.config
        mla_shared = c.is_mla_model and name in _KV_SHAPED
        identity = {"tp_size": None if mla_shared else c.tp_size, "pp": [c.pp_rank, c.pp_size],
                    "cp": [c.attn_cp_rank, c.attn_cp_size], "dcp": [c.dcp_rank, c.dcp_size]}
        pages = PoolPages(pool, name=name, identity=identity)
        namespace = Namespace(self.model, pages.fingerprint, self._shard_rank(name), self.options.salt)
        decl = getattr(pool, "decl", None)
        kv_derived = name != PoolName.KV and decl is not None and getattr(decl, "indices_from_pool", None) == PoolName.KV \
            and getattr(decl, "hit_policy", PoolHitPolicy.ALL_PAGES) == PoolHitPolicy.ALL_PAGES
        if self.options.service is not None:
            self._check_service_pool(name, pool, kv_derived)
        self._pools[name] = _Pool(name, pages, PageCodec(pages.fingerprint, pages.payload_bytes, pages.page_size),
                                  str(namespace), kv_derived, writer=self.writer or not mla_shared)
        log.info("kvtier HiCache storage: pool %r (%s, %s layout), %d-byte pages, namespace %s", name, type(pool).__name__,
                 getattr(pool, "layout", "?"), pages.payload_bytes, namespace)
        if self.backend is None:
            return
        # header slabs: each caller thread (SGLang's prefetch and backup threads) has up to io_threads calls in flight
        self.mover.reserve_slabs(2 * self.io_threads + 2, max(self._step(p) for p in self._pools.values()))
        if self.backend.capabilities.registers_buffers and pages.buffer is not None:
            self.backend.register_buffer(pages.buffer)

    # ---- the node service -------------------------------------------------------------
    def _check_service_pool(self, name: str, pool, kv_derived: bool) -> None:
        """The service holds every pool (a pool with page ids of its own in an object pool of the region), at most
        :data:`MAX_OBJECT_POOLS` of those, registered before its region page is fixed."""
        own = name != PoolName.KV and not kv_derived
        held = sum(p.own_ids for p in self._pools.values())
        if own and held >= MAX_OBJECT_POOLS:
            raise ConfigError(f"kvtier HiCache storage: pool {name!r} ({type(pool).__name__}) would be pool {held + 1} with page ids "
                              f"of its own; the node service's region holds at most {MAX_OBJECT_POOLS} beside its pages. Use an L3 "
                              "store (storage_url, no service) for this model")
        if self.service is not None:
            raise ConfigError(f"kvtier HiCache storage: pool {name!r} registered after the node service's region page was fixed "
                              f"(pools {', '.join(p.name for p in self.service.group)}); register every pool before the first transfer")

    def on_host_pools_registered(self) -> None:
        """The pool set is known: the region page is fixed and this thread attaches (the first hello makes
        the service's region; a service that is not there yet is a warning, then misses until the heartbeat
        attaches it -- or, with ``service_required``, a :class:`~kvtier.errors.ServiceError` that fails SGLang's start)."""
        super().on_host_pools_registered()
        if self.options.service is not None:
            with _refusing_start():
                services = [self._service(), *self.own_services.values()]
                try:
                    for service in services:
                        service.attach_now(required=self.options.service_required)
                except BaseException:  # (a start that fails leaves nothing attached, nor a heartbeat that would attach)
                    for service in services:
                        service.close()
                    raise

    def _service_of(self, pool: _Pool) -> ServicePages:
        """The service's pages ``pool`` goes through: the namespace of its shard's rank where that is not the KV pool's
        (a rank's Mamba state beside MLA above one rank), else the KV pool's."""
        service = self._service()
        return self.own_services.get(self._shard_rank(pool.name), service) if pool.own_ids else service

    def _service(self) -> ServicePages:
        with self._service_lock:
            if self.service is None:
                pools = [self._kv] + [p for p in self._pools.values() if p.kv_derived]
                group = [p.pages for p in pools]
                own = [p.pages for p in self._pools.values() if p.own_ids]
                namespace = Namespace(self.model, region_format(group, pools=own).fingerprint, self._shard_rank(PoolName.KV),
                                      self.options.salt)
                # (a service with L3 names each row's objects by the engine's rank: where a pool's shard is another, its
                # objects would not be this backend's own L3's, so the format does not say how to store them)
                objects = all(self._shard_rank(p.name) == namespace.tp_rank for p in pools)
                o = self.options

                def pages(ns: Namespace) -> ServicePages:
                    return ServicePages(o.socket_path, str(ns), group, deadline_s=o.service_timeout_s,
                                        lookup_deadline_s=o.service_lookup_timeout_s, on_fault=self._count_fault,
                                        service_uid=o.service_uid, objects=objects, pools=own)

                self.service = pages(namespace)
                # (each rank's own pools beside KV every rank shares -- Mamba state beside MLA above one rank -- are published in
                # the namespace of their shard's rank: its keys are its own, and a service with L3 saves them as that rank's own
                # L3 would; a pool sharded as the KV -- a draft's -- stays in the KV pool's)
                ranks = {self._shard_rank(p.name) for p in self._pools.values() if p.own_ids}
                self.own_services = {rank: pages(Namespace(self.model, namespace.spec_fingerprint, rank, self.options.salt))
                                     for rank in sorted(ranks - {namespace.tp_rank})}
            return self.service

    def _pool(self, name) -> _Pool:
        try:
            return self._pools[str(name)]
        except KeyError:
            raise ConfigError(f"kvtier HiCache storage: no host pool {str(name)!r} registered (registered: "
                              f"{', '.join(self._pools) or 'none'}); SGLang registers them with register_mem_pool_host / "
                              "register_mem_host_pool_v2 before any transfer") from None

    @property
    def _kv(self) -> _Pool:
        return self._pool(PoolName.KV)

    # ---- batching ----------------------------------------------------------------------
    def _step(self, pool: _Pool) -> int:
        return self.options.batch_pages or self.mover.batch_pages(pool.codec, 8)

    def _chunked(self, pool: _Pool, n: int, start: int, work: Callable[[int, int], list[bool]], kind: str) -> list[bool]:
        """``work(a, b)`` over chunks of ``[start, n)``, up to ``io_threads`` at once on the ``kind``
        ("read" or "write") pool; per-page results in order. A chunk that fails a page ends the run
        (a chained prefix is useless past it): no chunk is started after it, and it and the pages
        after it are False."""
        step = self._step(pool)
        out: list[bool] = []

        def chunk(a: int) -> tuple[int, list[bool]]:
            b = min(a + step, n)
            return b - a, work(a, b)

        def apply(result: tuple[int, list[bool]]) -> bool:
            size, r = result
            out.extend(r)
            return len(r) == size and all(r)

        starts = range(start, n, step)
        if self._io is None:
            for a in starts:
                if not apply(chunk(a)):
                    break
        else:
            in_order(self._io[kind], starts, chunk, apply, in_flight=self.io_threads)
        return out + [False] * (n - start - len(out))

    # ---- reads -------------------------------------------------------------------------
    def _valid_prefix(self, keys: Sequence[str]) -> int:
        """Leading ``keys`` that can name an object (strings that encode as UTF-8). A key past them is a
        miss for this call alone, never a store fault: one bad key must not open the breaker."""
        for i, k in enumerate(keys):
            if type(k) is not str or not (k.isascii() or _encodes(k)):
                self.invalid_keys += 1
                log.warning("kvtier HiCache storage: key %d of %d is not a UTF-8 string (%s); it and the keys after it miss",
                            i, len(keys), ascii(k)[:60])
                return i
        return len(keys)

    def _read(self, pool: _Pool, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Read pages into ``pages`` of ``pool``; True for the verified leading run only."""
        asked = len(keys)
        keys = keys[: self._valid_prefix(keys)]
        if len(keys) < asked:
            return self._read(pool, keys, pages[: len(keys)]) + [False] * (asked - len(keys))
        if not keys:
            return []
        t0 = time.perf_counter()
        if self.options.service is not None and pool.own_ids:
            run = _leading(self._service_of(pool).read_objects(pool.pages, list(keys), list(pages)))
        elif self.options.service is not None:
            run = self._service().read(pool.pages, list(keys), list(pages))
        else:
            run = _leading(self._chunked(pool, len(keys), 0, lambda a, b: self._read_chunk(pool, keys[a:b], pages[a:b]), "read"))
        self._count_read(pool, run, len(keys), time.perf_counter() - t0)
        return [True] * run + [False] * (len(keys) - run)

    def _read_chunk(self, pool: _Pool, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        out: list[bool] = []
        if not self.breaker.available:
            return out
        views = [pool.pages.views(p) for p in pages]
        with self._guard("read", out):
            out += self._get_objects(pool, keys, views, leading=True)
        if not pool.pages.aliases:  # its pages were read into copies: into the pool with them
            for p, v, ok in zip(pages, views, out):
                if ok:
                    pool.pages.write_back(p, v)
        return out

    def _get_objects(self, pool: _Pool, keys: Sequence[str], payloads: list[list[memoryview]], *, leading: bool) -> list[bool]:
        """Read each key's object into ``payloads[j]``: True per page that arrived and passed its check;
        ``leading``: stop at the first that did not."""
        verdicts = self.mover.read(pool.codec, pool.names(keys), [pool.key16(k) for k in keys], payloads, leading=leading)
        return [st is KeyStatus.OK for st, _why in verdicts]

    def _count_corrupt(self, _name: str, _verdict: str) -> None:
        with self._metrics_lock:
            self.metrics.corrupt += 1

    # ---- writes ------------------------------------------------------------------------
    def _write(self, pool: _Pool, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Store pages of ``pool``; keys the store already has (its leading run) are not rewritten."""
        asked = len(keys)
        keys = keys[: self._valid_prefix(keys)]
        if len(keys) < asked:
            return self._write(pool, keys, pages[: len(keys)]) + [False] * (asked - len(keys))
        if not keys:
            return []
        t0 = time.perf_counter()
        if self.options.service is not None and pool.writer:
            return self._write_to_service(pool, keys, pages, t0)
        have = self._stored_prefix(pool, keys)
        if not pool.writer:  # another rank writes this shard (MLA): report what the store has
            return [i < have for i in range(len(keys))]
        done = [True] * have + self._chunked(pool, len(keys), have, lambda a, b: self._write_chunk(pool, keys[a:b], pages[a:b]), "write")
        self._count_write(pool, have, sum(done) - have, time.perf_counter() - t0)
        return done

    def _write_to_service(self, pool: _Pool, keys: Sequence[str], pages: Sequence[int], t0: float) -> list[bool]:
        """The region pages of ``pages`` (every pool on these page ids: a page goes with its indexer); the
        leading run the service has already is not written again."""
        service = self._service_of(pool)
        if pool.own_ids:
            objects = service.write_objects(pool.pages, list(keys), list(pages))
            self._count_write(pool, objects.stored, objects.written, time.perf_counter() - t0)
            return objects.done
        done = service.write(list(keys), list(pages))
        self._count_write(pool, done.stored, done.written, time.perf_counter() - t0, service.format.page_bytes)
        return [i < done.stored + done.written for i in range(len(keys))]

    def _write_chunk(self, pool: _Pool, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        out: list[bool] = []
        if not self.breaker.available:
            return out
        with self._guard("write", out):
            out += self._put_objects(pool, keys, [pool.pages.views(p) for p in pages])
        return out

    def _put_objects(self, pool: _Pool, keys: Sequence[str], payloads: list[list[memoryview]]) -> list[bool]:
        """Store each key's object (a header hashed over its payload, then the payload): True per page stored."""
        statuses = self.mover.write(pool.codec, pool.names(keys), [pool.key16(k) for k in keys], payloads)
        return [st is KeyStatus.OK for st in statuses]

    # ---- lookups -----------------------------------------------------------------------
    def _stored_prefix(self, pool: _Pool, keys: Sequence[str]) -> int:
        """Leading ``keys`` stored for ``pool`` (a fault, or a store marked down, counts as absent)."""
        keys = keys[: self._valid_prefix(keys)]
        if self.options.service is not None:
            return _leading(self._present(pool, keys))
        if not keys or not self.breaker.available:
            return 0
        found = [0]
        with self._guard("exists", []):
            found[0] = self.breaker.call(self.backend.exists, pool.names(keys)) or 0
        return found[0]

    def _present(self, pool: _Pool, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` is stored for ``pool``, each on its own: one call to the node service (the pages of a
        pool on its own page ids in its object pool; a KV page and its indexer in one region page: their leading run), else
        one existence query per key."""
        keys = list(keys)
        if self.options.service is None:
            return [self._stored_prefix(pool, [k]) == 1 for k in keys]
        service = self._service_of(pool)
        if pool.own_ids:
            valid = self._valid_prefix(keys)
            return service.present(pool.pages, keys[:valid]) + [False] * (len(keys) - valid)
        run = service.stored(keys[: self._valid_prefix(keys)])
        return [i < run for i in range(len(keys))]

    def _kv_hits(self, keys: Sequence[str], checked: set[str] = frozenset()) -> int:
        """Leading KV pages stored, each with every KV-derived pool's page (the DSA indexer)."""
        n = self._stored_prefix(self._kv, keys)
        if self.options.service is not None:
            return n  # the region page of a KV page holds its indexer page
        for pool in self._pools.values():
            if n and pool.kv_derived and pool.name not in checked:
                n = self._stored_prefix(pool, keys[:n])
        return n

    @contextmanager
    def _guard(self, what: str, partial: list):
        """Storage faults become failed pages (``partial`` keeps what succeeded), never an exception."""
        try:
            yield
        except (PageAlignmentError, ConfigError):
            raise
        except Exception as e:  # a client's own exception type, an OS error, a timeout
            self.backend.stats.errors += 1
            self.backend.stats.last_error = f"{what}: {type(e).__name__}: {e}"
            with self._metrics_lock:
                self.metrics.faults += 1
            log.warning("kvtier HiCache storage %s failed after %d pages: %s", what, len(partial), e)
            self.breaker.trip()

    # ---- metrics -----------------------------------------------------------------------
    def _count_read(self, pool: _Pool, hits: int, asked: int, seconds: float) -> None:
        with self._metrics_lock:
            m = self.metrics
            m.pages_read += hits
            m.misses += asked - hits
            m.bytes_read += hits * self._page_bytes(pool)
            if self.config.enable_storage_metrics and hits:
                m.prefetch_pgs.append(hits)
                m.prefetch_bandwidth.append(hits * self._page_bytes(pool) / 1e9 / max(seconds, 1e-9))

    def _count_write(self, pool: _Pool, skipped: int, written: int, seconds: float, page_bytes: int | None = None) -> None:
        page_bytes = page_bytes or self._page_bytes(pool)
        with self._metrics_lock:
            m = self.metrics
            m.pages_already_stored += skipped
            m.pages_written += written
            m.bytes_written += written * page_bytes
            if self.config.enable_storage_metrics and written:
                m.backup_pgs.append(written)
                m.backup_bandwidth.append(written * page_bytes / 1e9 / max(seconds, 1e-9))

    def _page_bytes(self, pool: _Pool) -> int:
        """Bytes a page of ``pool`` moves: its L3 object, or its row of a region page (the node service)."""
        return pool.pages.payload_bytes if self.options.service is not None else pool.codec.object_bytes

    def _count_fault(self) -> None:
        with self._metrics_lock:
            self.metrics.faults += 1

    def get_stats(self) -> StorageMetrics:
        """A snapshot: the per-batch lists since the last call (then cleared) and the running counters."""
        with self._metrics_lock:
            snap = StorageMetrics(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(self.metrics).items()})
            for lst in (self.metrics.prefetch_pgs, self.metrics.backup_pgs, self.metrics.prefetch_bandwidth,
                        self.metrics.backup_bandwidth):
                lst.clear()
        return snap

    # ---- HiCacheStorage: zero-copy v1 --------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self._kv
        return self._read(pool, keys, pool.pages.pages(host_indices, len(keys)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self._kv
        return self._write(pool, keys, pool.pages.pages(host_indices, len(keys)))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._kv_hits(keys)

    # ---- HiCacheStorage: v2 (per-pool transfers) ----------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        transfers = list(pool_transfers or [])
        kv_pages = self._kv_hits(keys, checked={str(t.name) for t in transfers})
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in transfers:
            if not restorable:
                break
            pool = self._pool(t.name)
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:  # (the node service: on the KV pool's region pages)
                boundary = kv_pages if self.options.service is not None and pool.kv_derived else self._stored_prefix(pool, keys[:kv_pages])
                mine = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                present = self._present(pool, keys[:kv_pages])
                mine = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing):n])}
                boundary = max(mine, default=0)
            else:
                raise ConfigError(f"kvtier HiCache storage: pool {str(t.name)!r} asks hit policy {t.hit_policy.value!r}; "
                                  "supported: all_pages, trailing_pages")
            if boundary:
                hits[str(t.name)] = boundary
            restorable &= mine
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _transfer_pages(self, t: PoolTransfer) -> tuple[_Pool, list[str], list[int]]:
        pool = self._pool(t.name)
        keys = list(t.keys or [])
        if t.host_indices is None:
            raise PageAlignmentError(f"pool transfer {str(t.name)!r}: no host_indices for {len(keys)} keys; "
                                     f"pass {pool.pages.page_size} host slots per key")
        return pool, keys, pool.pages.pages(t.host_indices, len(keys))

    @staticmethod
    def _one_key_per_page(checked: list[tuple[_Pool, list[str], list[int]]]) -> None:
        """A read's destinations, each named once per pool (in one transfer or across two): two keys read
        into one page (one Mamba slot) would race for it. A :class:`PageOwnershipError` before any byte moves."""
        into: dict[str, list[int]] = {}
        for pool, _keys, pages in checked:
            into.setdefault(pool.name, []).extend(pages)
        for name, pages in into.items():
            twice = first_duplicate(pages)
            if twice is not None:
                raise PageOwnershipError(f"batch_get_v2: host page {twice} of SGLang host pool {name!r} is the destination of two keys; "
                                         "read each key into a page of its own")

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        checked = [self._transfer_pages(t) for t in transfers]  # every transfer is checked before any byte moves
        self._one_key_per_page(checked)
        return {p.name: self._read(p, keys, pages) for p, keys, pages in checked}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        checked = [self._transfer_pages(t) for t in transfers]
        return {p.name: self._write(p, keys, pages) for p, keys, pages in checked}

    # ---- HiCacheStorage: flat data pages (SGLang's generic path) ------------------------
    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor] | None = None,
                  target_sizes=None) -> list[torch.Tensor | None]:
        self._store_only("batch_get")
        pool = self._kv
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else pool.pages.pool.get_dummy_flat_data_page() for t in targets]
        views = [pool.pages.check_flat(t, f"get {k!r}") for k, t in zip(keys, targets)]
        out: list[torch.Tensor | None] = [None] * len(keys)
        keys = keys[: self._valid_prefix(keys)]
        t0 = time.perf_counter()
        if not keys or not self.breaker.available:
            self._count_read(pool, 0, len(out), 0.0)
            return out
        ok: list[bool] = []
        with self._guard("get", ok):
            ok += self._get_objects(pool, keys, [[v] for v in views[: len(keys)]], leading=False)
        for j, good in enumerate(ok):
            out[j] = targets[j] if good else None
        self._count_read(pool, sum(ok), len(out), time.perf_counter() - t0)
        return out

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        """Store flat data pages; True when every key is stored (SGLang's generic backup checks all)."""
        self._store_only("batch_set")
        pool = self._kv
        values = list(values or [])
        if len(values) != len(keys):
            raise PageAlignmentError(f"batch_set: {len(keys)} keys but {len(values)} pages; pass one flat data page per key")
        views = [pool.pages.check_flat(v, f"set {k!r}") for k, v in zip(keys, values)]
        if self._valid_prefix(keys) < len(keys):
            return False  # (a key that cannot name an object is not stored; the call stores none)
        t0 = time.perf_counter()
        have = self._stored_prefix(pool, keys)
        if not pool.writer:
            return have == len(keys)
        if have == len(keys):
            self._count_write(pool, have, 0, 0.0)
            return True
        todo = keys[have:]
        ok: list[bool] = []
        with self._guard("set", ok):
            ok += self._put_objects(pool, todo, [[v] for v in views[have:]])
        self._count_write(pool, have, sum(ok), time.perf_counter() - t0)
        return len(ok) == len(todo) and all(ok)

    def _store_only(self, what: str) -> None:
        if self.options.service is not None:
            raise ConfigError(f"kvtier HiCache storage: {what} (SGLang's flat-page path) is not served by the node service; "
                              'SGLang takes the zero-copy path with "interface_v1": 1 in the extra config')

    def exists(self, key: str) -> bool:
        return self._kv_hits([key]) == 1

    # ---- lifecycle ---------------------------------------------------------------------
    def clear(self) -> bool:
        """Delete every page of this backend's namespaces (this model and shard, every registered
        pool); other models' and other shards' pages in the same store stay. The node service's pages
        are not deleted (it has no such call; they age out by its LRU): False."""
        if self.options.service is not None:
            log.warning("kvtier HiCache storage: the node service's pages are not cleared (it evicts them by LRU)")
            return False
        removed = 0
        ok = True
        for pool in self._pools.values():
            errors = self.backend.stats.errors
            removed += self.backend.delete_namespace(pool.prefix)
            ok = ok and self.backend.stats.errors == errors
        log.info("kvtier HiCache storage: cleared %d pages", removed)
        return ok

    def close(self) -> None:
        for service in (self.service, *self.own_services.values()):
            if service is not None:
                service.close()
        for io in (self._io or {}).values():
            io.shutdown(wait=True)
        if self.backend is not None:
            self.backend.close()
