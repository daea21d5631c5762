"""The storage tier: moves whole host pages to and from an L3 backend on its own worker.

L3 I/O has its own worker (not the device<->host transfer engine's): storage
latency must never queue PCIe copies behind it. Jobs:

* ``save``: host pages -> page objects -> ``backend.set``; keys the store
  already has (longest stored prefix, one ``exists`` call) are skipped.
* ``prefetch``: ``backend.get`` -> integrity check -> host pages.
  ``job.arrived`` is the count of leading pages that are complete and
  verified, so a scheduler can use what arrived (best_effort). A page that is
  missing, corrupt or fails stops the run: later pages of a chained prefix are
  useless without it.

Pages move through the L3 page mover (:mod:`kvtier.l3.mover`, shared with
SGLang's backend): straight between the store and the host pages' own bytes
for backends that read and write scattered buffers (file, Redis, Mooncake;
a page_first page is one run per buffer, a layer_first page one run per buffer
and layer), through a checked staged object for the rest. Batches run on
``io_threads`` threads (unset: the backend's ``capabilities.io_threads``), up
to twice that many in flight: each I/O thread reads a batch and checks it (or
hashes a batch and writes it) while the data is fresh in its cache, and
results are applied in batch order. For the file backend on 2 cores this is
what lets a checked read keep up with a plain one: a single thread reading and
checksumming in turn pays for both, and a separate checker thread re-reads
each page from memory.

Nothing here raises into the cache for a storage fault: statuses are per page,
faults are counted, and the cache turns them into misses. A page that fails its
check, or whose object is of the wrong size, is deleted from the store, so the
next save of its key repairs it (saves skip keys the store already has, and a
corrupt object would otherwise stay forever). The job queue is bounded and the submitting (engine) thread never
waits on it: a full queue skips the save or misses the prefetch, counted
(``backpressure_s`` > 0 lets a save wait that long first). Every backend call
has a whole-call deadline, so ``drain`` and ``close`` return within a bound.

Circuit breaker (:mod:`kvtier.l3.breaker`): after a backend fault the tier treats
the node it came from as down (a single server, or one Redis Cluster node) for a
back-off that doubles while the fault persists: lookups answer "absent" from the
first key on that node, reads and writes fail there at once, and a probe on a
helper thread asks that node until it is back. A dead or stalled node costs the
engine's thread at most one lookup deadline, not one per request or per back-off,
and the other nodes keep serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from kvtier.jobs import JobWorker
from kvtier.config import DEFAULT_COOLDOWN_S, DEFAULT_MAX_COOLDOWN_S, StorageConfig
from kvtier.hashing import Namespace, PageHash
from kvtier.l3.base import KeyStatus, StorageBackend, map_storage_errors
from kvtier.l3.breaker import CircuitBreaker
from kvtier.l3.mover import PageMover, Verdict, in_order
from kvtier.l3.page import PageCodec

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StorageJob:
    kind: Literal["save", "prefetch"]
    keys: list[PageHash]
    host_pages: list[int]
    tag: object = None
    statuses: list[KeyStatus] = field(default_factory=list)
    arrived: int = 0
    corrupt: int = 0
    skipped_existing: int = 0
    #: read by the worker between chunks (a bool: set once, by the owner)
    cancelled: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    #: the namespace its keys are stored under (None: the tier's own; the node service's one tier serves every namespace)
    prefix: str | None = None
    #: its objects' names after the prefix, one per key (None: the keys in hex; SGLang names its objects by its page hashes)
    names: list[str] | None = None
    #: a save's owner tags, one per key (:func:`~kvtier.hashing.owner_tag`; None: every page the namespace's own)
    owners: list[int] | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    def settle(self, policy: str, budget_s: float) -> bool:
        """Wait as a prefetch policy says (wait_complete: until done; timeout: up to ``budget_s``;
        best_effort: not at all), then cancel what is left. True when the job finished."""
        if policy == "wait_complete":
            self.wait()
        elif policy == "timeout":
            self.wait(budget_s)
        if self.finished.is_set():
            return True
        self.cancel()  # stop after the chunk in flight
        return False


class PageBytes:
    """A tier's pages as bytes: their objects' ``codec``, writable views of one page in the object's payload order
    (:meth:`views`), and the ``buffers`` that hold them (a backend that reads into registered memory registers them)."""

    codec: PageCodec
    buffers: list[memoryview]

    def views(self, page: int) -> list[memoryview]:
        raise NotImplementedError


class PoolBytes(PageBytes):
    """A :class:`~kvtier.pools.host.HostPool`'s pages: each buffer's layers (page_first: one run per buffer;
    layer_first: one per buffer and layer), as the spec's page object holds them. Slices of one view per pool
    buffer: building views through torch costs ~20 us a page."""

    def __init__(self, host_pool):
        self.spec = host_pool.spec
        self.codec = PageCodec.for_spec(self.spec)
        #: per pool buffer: (its bytes, bytes between pages, bytes between layers, bytes per page per layer)
        self._geometry = [self._buffer_geometry(host_pool, b.name, b.page_bytes) for b in self.spec.buffers]
        self.buffers = [g[0] for g in self._geometry]

    @staticmethod
    def _buffer_geometry(host, name: str, page_bytes: int) -> tuple[memoryview, int, int, int]:
        buf = host.buffers[name]
        base = buf.data_ptr()
        first = host.layout.page_layers(buf, 0)
        page_step = host.layout.page_layers(buf, 1).data_ptr() - base if host.num_pages > 1 else 0
        layer_step = first.stride(0) * first.element_size()
        return memoryview(buf.numpy()).cast("B"), page_step, layer_step, page_bytes

    def views(self, page: int) -> list[memoryview]:
        views = []
        layers = self.spec.num_layers
        for mv, page_step, layer_step, n in self._geometry:
            at = page * page_step
            if layer_step == n:
                views.append(mv[at : at + layers * n])
            else:
                views += [mv[at + layer * layer_step : at + layer * layer_step + n] for layer in range(layers)]
        return views


class RowBytes(PageBytes):
    """Pages that are one run each, ``page_bytes`` apart in ``buffer`` (a row of the node service's region holding an
    engine's own pool's pages: SGLang's), framed by ``codec`` (that pool's)."""

    def __init__(self, buffer: memoryview, page_bytes: int, codec: PageCodec):
        if codec.payload_bytes != page_bytes:
            raise ValueError(f"a row of {page_bytes}-byte pages holds no {codec.payload_bytes}-byte payload")
        self.codec = codec
        self.buffers = [buffer]
        self._buffer = buffer
        self._n = page_bytes

    def views(self, page: int) -> list[memoryview]:
        return [self._buffer[page * self._n : (page + 1) * self._n]]


class StorageTier:
    def __init__(
        self,
        backend: StorageBackend,
        host_pool,
        namespace: Namespace | str,
        *,
        batch_pages: int = 8,
        io_threads: int | None = None,
        queue_depth: int = 64,
        backpressure_s: float = 0.0,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S,
        owns_backend: bool = True,
        on_finished: Callable[[], None] | None = None,
    ):
        self.backend = backend
        #: called on the worker's thread after each job finished (the node service wakes its selector with it)
        self._on_finished = on_finished
        #: False for a tier sharing another's backend (a hybrid model's group objects): it leaves closing it to that one
        self.owns_backend = owns_backend
        self._settings = dict(batch_pages=batch_pages, io_threads=io_threads, queue_depth=queue_depth, backpressure_s=backpressure_s,
                              cooldown_s=cooldown_s, max_cooldown_s=max_cooldown_s)
        self.host = host_pool
        #: the pages as bytes, and their objects' codec
        self.pages = host_pool if isinstance(host_pool, PageBytes) else PoolBytes(host_pool)
        self.namespace = namespace
        self.prefix = str(namespace)
        self.codec = self.pages.codec
        self.backpressure_s = backpressure_s
        self._finished: queue.SimpleQueue[StorageJob] = queue.SimpleQueue()
        self.skipped_saves = 0
        #: prefetches not started because the queue was full (each a miss for its request)
        self.skipped_prefetches = 0
        self._closed = False
        self.breaker = CircuitBreaker(backend, cooldown_s, max_cooldown_s, probe_key=f"{self.prefix}/probe")
        self.mover = PageMover(backend, self.breaker)
        #: seconds the worker spent per job kind ("save" / "prefetch")
        self.busy_s: dict[str, float] = {}
        #: None: the backend's choice (file 2; one Redis node or Mooncake 1: see their modules)
        if io_threads is None:
            io_threads = backend.capabilities.io_threads
        self.io_threads = io_threads
        #: batches submitted ahead: twice the threads, so a thread that finishes finds its next
        #: batch queued instead of waiting for the worker to wake up and submit one
        self._in_flight = 2 * io_threads
        #: each thread reads + checks (or hashes + writes) one batch at a time
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-l3-io")
        self._step = self.mover.batch_pages(self.codec, batch_pages)
        self.mover.reserve_slabs(self._in_flight, self._step)
        if backend.capabilities.registers_buffers:  # zero-copy I/O where the backend needs memory registered
            for buffer in self.pages.buffers:
                backend.register_buffer(buffer)
        self._worker = JobWorker(self._process, name="kvtier-storage", maxsize=queue_depth)

    @property
    def discarded_corrupt(self) -> int:
        """Objects that failed their check on read and were deleted from the store."""
        return self.mover.discarded

    def sharing(self, host_pool) -> StorageTier:
        """A tier over ``host_pool`` (a hybrid model's group objects) on this tier's store, namespace and
        settings; closing it leaves the store open (this tier closes it)."""
        return StorageTier(self.backend, host_pool, self.namespace, owns_backend=False, **self._settings)

    def key(self, page: PageHash, prefix: str | None = None, name: str | None = None) -> str:
        """The store's name of ``page``'s object: ``prefix/`` (the tier's namespace unless given) and the key in hex, or
        ``name`` where the engine names its objects itself (SGLang's page hashes)."""
        return f"{self.prefix if prefix is None else prefix}/{page.hex() if name is None else name}"

    def keys(self, pages: list[PageHash], prefix: str | None = None, names: list[str] | None = None) -> list[str]:
        if names is None:
            return [self.key(k, prefix) for k in pages]
        return [self.key(k, prefix, n) for k, n in zip(pages, names)]

    # ---- health ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.breaker.available

    # ---- synchronous queries (owner thread) ----------------------------------------
    def stored_prefix(self, keys: list[PageHash], prefix: str | None = None, names: list[str] | None = None) -> int:
        """Leading ``keys`` present in the store (a fault, or a key on a node marked down, ends the run);
        ``prefix``: the namespace they are stored under, if not the tier's; ``names``: their objects' (:meth:`key`)."""
        if not keys or not self.available:
            return 0
        found = [0]

        def failed(_e: BaseException) -> None:
            found[0] = 0

        with map_storage_errors(self.backend.stats, "exists", failed):
            found[0] = self.breaker.call(self.backend.exists, self.keys(keys, prefix, names)) or 0
        return found[0]

    # ---- submission ------------------------------------------------------------------
    def submit(
        self, kind: Literal["save", "prefetch"], keys: list[PageHash], host_pages: list[int], tag: object = None,
        prefix: str | None = None, names: list[str] | None = None, owners: list[int] | None = None,
    ) -> StorageJob | None:
        """Queue a job (``prefix``: the namespace its keys are stored under, if not the tier's; ``names``: its objects'
        names, where not the keys in hex; ``owners``: a save's owner tags, one per key); None when the queue is full."""
        job = StorageJob(kind, list(keys), list(host_pages), tag, prefix=prefix, names=None if names is None else list(names),
                         owners=list(owners) if owners else None)
        if self._closed:
            return None
        try:
            self._worker.put(job, timeout_s=self.backpressure_s if kind == "save" and self.backpressure_s > 0 else None)
        except queue.Full:
            if kind == "save":
                self.skipped_saves += len(keys)
            else:
                self.skipped_prefetches += len(keys)
            log.info("L3 queue full: %s of %d pages skipped", kind, len(keys))
            return None
        return job

    def take_finished(self) -> list[StorageJob]:
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    # ---- worker ----------------------------------------------------------------------
    def _process(self, job: StorageJob) -> None:
        t0 = time.monotonic()
        try:
            if not self.available:
                job.statuses += [KeyStatus.ERROR] * len(job.keys)
            else:
                (self._save if job.kind == "save" else self._prefetch)(job)
        except Exception as e:  # never kill the worker; the job reports failure
            log.warning("L3 %s job failed: %s", job.kind, e)
            job.statuses += [KeyStatus.ERROR] * (len(job.keys) - len(job.statuses))
        self.busy_s[job.kind] = self.busy_s.get(job.kind, 0.0) + time.monotonic() - t0
        self._finished.put(job)  # before finished.set(): a waiter that then polls must see the job
        job.finished.set()
        if self._on_finished is not None:
            self._on_finished()

    # ---- jobs ------------------------------------------------------------------------------
    def _batches(self, job: StorageJob, start: int, work, apply) -> None:
        in_order(self._io, range(start, len(job.keys), self._step), work, apply, in_flight=self._in_flight,
                 cancelled=lambda: job.cancelled)

    def _batch(self, job: StorageJob, start: int) -> tuple[list[str], list[bytes], list[list[memoryview]]]:
        """The mover's arguments for the batch of ``job`` at ``start``: store names, page keys, host page bytes."""
        stop = start + self._step
        keys = job.keys[start:stop]
        return (self.keys(keys, job.prefix, None if job.names is None else job.names[start:stop]), [bytes(k) for k in keys],
                [self.pages.views(p) for p in job.host_pages[start:stop]])

    def _write(self, job: StorageJob, start: int) -> list[KeyStatus]:
        owners = None if job.owners is None else job.owners[start : start + self._step]
        return self.mover.write(self.codec, *self._batch(job, start), owners)

    def _save(self, job: StorageJob) -> None:
        """Keys the store already has (its leading run) are skipped; each I/O thread hashes a batch's
        headers over the host pages' own bytes and stores them."""
        have = self.stored_prefix(job.keys, job.prefix, job.names)
        job.skipped_existing = have
        job.statuses = [KeyStatus.OK] * have

        self._batches(job, have, lambda start: self._write(job, start),
                      lambda statuses: self._record_saved(job, statuses))
        job.statuses += [KeyStatus.ERROR] * (len(job.keys) - len(job.statuses))

    @staticmethod
    def _record_saved(job: StorageJob, statuses: list[KeyStatus]) -> bool:
        """Append a batch's statuses; False after a failure (the rest of the job is not attempted)."""
        job.statuses += statuses
        return bool(statuses) and KeyStatus.ERROR not in statuses

    def _prefetch(self, job: StorageJob) -> None:
        """Each I/O thread reads a batch straight into its (not yet ready) host pages and checks it;
        ``arrived`` counts verified pages, in order. A failed page ends the chained prefix there; later
        batches stay unready."""
        self._batches(job, 0, lambda start: self.mover.read(self.codec, *self._batch(job, start)),
                      lambda verdicts: self._apply_checked(job, verdicts))

    @staticmethod
    def _apply_checked(job: StorageJob, verdicts: list[Verdict]) -> bool:
        """Record verified pages on the job in order; False once one failed (its host page never becomes
        ready) or the store was marked down (no verdicts)."""
        for st, why in verdicts:
            job.statuses.append(st)
            if why:
                job.corrupt += 1
            if st is not KeyStatus.OK:
                return False
            job.arrived += 1
        return bool(verdicts)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job finished (at most ``timeout_s``); True when idle."""
        return self._worker.wait_idle(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued jobs for up to ``timeout_s``, then fail what is left and stop the worker.

        Returns within about ``timeout_s`` plus one backend call's deadline, whatever the store does."""
        if not self._closed:
            self._closed = True
            if not self.drain(timeout_s):
                log.warning("L3 tier closing with jobs unfinished after %.1f s; the rest are dropped", timeout_s)
                for job in self._worker.take_queued():
                    job.cancel()
                    job.statuses += [KeyStatus.ERROR] * (len(job.keys) - len(job.statuses))
                    self._finished.put(job)
                    job.finished.set()
            self._worker.stop(timeout_s)
            self._io.shutdown(wait=False, cancel_futures=True)
        if self.owns_backend:
            self.backend.close()


def open_storage_tier(storage: StorageConfig, host, namespace: Namespace) -> StorageTier | None:
    """The L3 tier over the host pool ``host`` for ``storage.url``, with the config's settings (None when L3 is off)."""
    if not storage.url:
        return None
    from kvtier.l3.registry import open_backend

    return StorageTier(open_backend(storage.url), host, namespace, batch_pages=storage.batch_pages, io_threads=storage.io_threads,
                       queue_depth=storage.queue_depth, cooldown_s=storage.cooldown_s, max_cooldown_s=storage.max_cooldown_s)
