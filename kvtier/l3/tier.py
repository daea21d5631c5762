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

Backends that read and write scattered buffers (file, Redis, Mooncake) move
pages straight between the store and page_first host pages on ``io_threads``
threads (unset: the backend's ``capabilities.io_threads``), up to twice that many
batches in flight: each I/O thread reads a batch and checks it (or hashes a
batch and writes it) while the data is fresh in its cache, and results are
applied in batch order. For the file backend on 2 cores this is what lets a
checked read keep up with a plain one: a single thread reading and checksumming
in turn pays for both, and a separate checker thread re-reads each page from
memory. Other backends go through a staging buffer on the worker, one batch at
a time.

Nothing here raises into the cache for a storage fault: statuses are per page,
faults are counted, and the cache turns them into misses. A page that fails its
check is deleted from the store, so the next save of its key repairs it (saves
skip keys the store already has, and a corrupt object would otherwise stay
forever). The job queue is bounded and the submitting (engine) thread never
waits on it: a full queue skips the save or misses the prefetch, counted
(``backpressure_s`` > 0 lets a save wait that long first). Every backend call
has a whole-call deadline, so ``drain`` and ``close`` return within a bound.

Circuit breaker (:mod:`kvtier.l3.breaker`): after a backend fault the tier treats
the store as down (lookups answer "absent", jobs fail at once) for a back-off that
doubles while the fault persists, and a probe on a helper thread finds the store
back, so a dead or stalled server costs the engine's thread one deadline, not one
per request or per back-off.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kvtier.config import DEFAULT_COOLDOWN_S, DEFAULT_MAX_COOLDOWN_S
from kvtier.hashing import Namespace, PageHash
from kvtier.l3.base import KeyStatus, StorageBackend, map_storage_errors
from kvtier.l3.breaker import CircuitBreaker, probe_store
from kvtier.l3.page import HEADER_BYTES, PageCodec

log = logging.getLogger(__name__)

#: the (writable, empty) value of a planning page: keys are accounted, no bytes move
_EMPTY = memoryview(bytearray())


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


class StorageTier:
    def __init__(
        self,
        backend: StorageBackend,
        host_pool,
        namespace: Namespace,
        *,
        batch_pages: int = 8,
        io_threads: int | None = None,
        queue_depth: int = 64,
        backpressure_s: float = 0.0,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S,
        owns_backend: bool = True,
    ):
        self.backend = backend
        #: False for a tier sharing another's backend (a hybrid model's group objects): it leaves closing it to that one
        self.owns_backend = owns_backend
        self._settings = dict(batch_pages=batch_pages, io_threads=io_threads, queue_depth=queue_depth, backpressure_s=backpressure_s,
                              cooldown_s=cooldown_s, max_cooldown_s=max_cooldown_s)
        self.host = host_pool
        self.spec = host_pool.spec
        self.namespace = namespace
        self.prefix = str(namespace)
        self.codec = PageCodec.for_spec(self.spec)
        self.batch_pages = batch_pages
        self.backpressure_s = backpressure_s
        self.materialized = host_pool.materialized
        #: (byte view of a whole pool buffer, bytes per page of it), for page_first pools
        self._pool_bytes = (
            [(memoryview(host_pool.buffers[b.name].numpy()).cast("B"), b.page_bytes * self.spec.num_layers) for b in self.spec.buffers]
            if self.materialized and host_pool.layout.page_is_contiguous()
            else []
        )
        self._staging = np.zeros((batch_pages, self.codec.object_bytes), dtype=np.uint8) if self.materialized else None
        self._queue: queue.Queue[StorageJob | None] = queue.Queue(maxsize=queue_depth)
        self._finished: queue.SimpleQueue[StorageJob] = queue.SimpleQueue()
        self.skipped_saves = 0
        #: prefetches not started because the queue was full (each a miss for its request)
        self.skipped_prefetches = 0
        #: objects that failed their check on read and were deleted from the store
        self.discarded_corrupt = 0
        self._closed = False
        self.breaker = CircuitBreaker(backend.stats, cooldown_s, max_cooldown_s, probe=lambda: probe_store(backend, f"{self.prefix}/probe"))
        #: seconds the worker spent per job kind ("save" / "prefetch")
        self.busy_s: dict[str, float] = {}
        #: without bytes (capacity planning) jobs run inline, deterministically, in the caller's thread
        self._worker = threading.Thread(target=self._run, name="kvtier-storage", daemon=True) if self.materialized else None
        caps = backend.capabilities
        #: None: the backend's choice (file 2; one Redis node or Mooncake 1: see their modules)
        if io_threads is None:
            io_threads = caps.io_threads
        self.io_threads = io_threads
        #: page objects move straight between the store and host pages (no staging copy)
        self._scattered = caps.scattered and host_pool.layout.page_is_contiguous()
        #: batches submitted ahead: twice the threads, so a thread that finishes finds its next
        #: batch queued instead of waiting for the worker to wake up and submit one
        self._in_flight = 2 * io_threads
        #: scattered batches in flight: each thread reads + checks (or hashes + writes) one batch
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-l3-io") if self.materialized else None
        #: page headers of the scattered batches in flight: one slab of ``[batch, HEADER_BYTES]`` each
        self._heads = np.zeros((self._in_flight, self._scattered_batch(), HEADER_BYTES), dtype=np.uint8) if self.materialized else None
        self._free_heads: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slab in range(self._in_flight):
            self._free_heads.put(slab)
        if caps.registers_buffers and self.materialized:  # zero-copy I/O where the backend needs memory registered
            register = backend.register_buffer
            for buf in (self._staging, self._heads):
                register(memoryview(buf).cast("B"))
            for pool_bytes, _n in self._pool_bytes:
                register(pool_bytes)
        if self._worker is not None:
            self._worker.start()

    def sharing(self, host_pool) -> StorageTier:
        """A tier over ``host_pool`` (a hybrid model's group objects) on this tier's store, namespace and
        settings; closing it leaves the store open (this tier closes it)."""
        return StorageTier(self.backend, host_pool, self.namespace, owns_backend=False, **self._settings)

    def key(self, page: PageHash) -> str:
        return f"{self.prefix}/{page.hex()}"

    # ---- health ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.breaker.available

    def _call(self, fn, *args):
        return self.breaker.call(fn, *args)

    # ---- synchronous queries (owner thread) ----------------------------------------
    def stored_prefix(self, keys: list[PageHash]) -> int:
        """Leading ``keys`` present in the store (a fault, or a store marked down, counts as absent)."""
        if not keys or not self.available:
            return 0
        found = [0]

        def failed(_e: BaseException) -> None:
            found[0] = 0

        with map_storage_errors(self.backend.stats, "exists", failed):
            found[0] = self._call(self.backend.exists, [self.key(k) for k in keys])
        return found[0]

    # ---- submission ------------------------------------------------------------------
    def submit(
        self, kind: Literal["save", "prefetch"], keys: list[PageHash], host_pages: list[int], tag: object = None
    ) -> StorageJob | None:
        if self._worker is None:
            from kvtier.transfer.engine import DONE

            job = StorageJob(kind, list(keys), list(host_pages), tag, finished=DONE)
            self._process(job)
            return job
        job = StorageJob(kind, list(keys), list(host_pages), tag)
        if self._closed:
            return None
        try:
            if kind == "save" and self.backpressure_s > 0:
                self._queue.put(job, timeout=self.backpressure_s)
            else:
                self._queue.put_nowait(job)
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
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._process(job)
            finally:
                self._queue.task_done()

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
        if self._worker is not None:
            job.finished.set()

    def _payload_views(self, slot: int) -> list[torch.Tensor]:
        """Byte views into staging slot ``slot``: one ``[layers, page_bytes]`` per buffer."""
        buf = torch.from_numpy(self._staging[slot])
        views, off = [], HEADER_BYTES
        for b in self.spec.buffers:
            n = b.page_bytes * self.spec.num_layers
            views.append(buf[off : off + n].view(self.spec.num_layers, b.page_bytes))
            off += n
        return views

    def _host_page_bytes(self, page: int) -> list[memoryview]:
        """Writable byte views of one host page, buffer by buffer (page_first only: each is contiguous).

        Slices of one view per pool buffer: building views through torch costs ~20 us a page."""
        return [mv[page * n : (page + 1) * n] for mv, n in self._pool_bytes]

    def _host_page_layers(self, page: int) -> list[torch.Tensor]:
        return [self.host.layout.page_layers(self.host.buffers[b.name], page) for b in self.spec.buffers]

    def _save(self, job: StorageJob) -> None:
        have = self.stored_prefix(job.keys)
        job.skipped_existing = have
        job.statuses = [KeyStatus.OK] * have
        scattered = self.backend.set_scattered if self._scattered else None
        if self.materialized and scattered is not None:
            self._save_scattered(job, have, scattered)
        else:
            for start in range(have, len(job.keys), self.batch_pages):
                keys = job.keys[start : start + self.batch_pages]
                names = [self.key(k) for k in keys]
                if self.materialized:
                    values = self._staged_objects(keys, job.host_pages[start : start + self.batch_pages])
                else:  # planning: account the keys, move no bytes
                    values = [_EMPTY] * len(keys)
                if not self._record_saved(job, self._call(self.backend.set, names, values)):
                    break
        job.statuses += [KeyStatus.ERROR] * (len(job.keys) - len(job.statuses))

    def _save_scattered(self, job: StorageJob, have: int, scattered) -> None:
        """No staging copy: each I/O thread hashes a batch's header over the host pages' own
        buffers and stores header + buffers as they are."""

        def hash_and_write(start: int) -> list[KeyStatus]:
            keys = job.keys[start : start + step]
            with self._header_slab() as heads:
                parts = []
                for j, (k, p) in enumerate(zip(keys, job.host_pages[start : start + step])):
                    payload = self._host_page_bytes(p)
                    heads[j] = np.frombuffer(self.codec.header_for_parts(k, payload), dtype=np.uint8)
                    parts.append([memoryview(heads[j]), *payload])
                return self._call(scattered, [self.key(k) for k in keys], parts)

        step = self._scattered_batch()
        self._in_order(job, range(have, len(job.keys), step), hash_and_write, lambda statuses: self._record_saved(job, statuses))

    @staticmethod
    def _record_saved(job: StorageJob, statuses: list[KeyStatus]) -> bool:
        """Append a batch's statuses; False after a failure (the rest of the job is not attempted)."""
        job.statuses += statuses
        return KeyStatus.ERROR not in statuses

    @contextmanager
    def _header_slab(self):
        """Header buffers for one scattered batch (never waits: one slab per batch in flight)."""
        slab = self._free_heads.get()
        try:
            yield self._heads[slab]
        finally:
            self._free_heads.put(slab)

    def _scattered_batch(self) -> int:
        """Pages per scattered call: about the backend's ``capabilities.batch_bytes`` (file: a few MB,
        so each I/O thread checks what it just read while it is still in cache), else ``batch_pages``."""
        per_call = self.backend.capabilities.batch_bytes
        return max(1, per_call // self.codec.object_bytes) if per_call else self.batch_pages

    def _in_order(self, job: StorageJob, starts: Iterable[int], work: Callable[[int], object], apply: Callable[[object], bool]) -> None:
        """Run ``work(start)`` for each batch on the I/O threads, at most ``2 * io_threads`` in flight,
        and ``apply`` the results in batch order until one returns False.

        Nothing is submitted after a failure or a cancel, and every batch in flight is waited
        for before this returns, also on an exception: the caller may release its host pages."""
        pending: deque[Future] = deque()
        starts = iter(starts)
        going = True
        try:
            while True:
                while going and not job.cancelled and len(pending) < self._in_flight:
                    start = next(starts, None)
                    if start is None:
                        break
                    pending.append(self._io.submit(work, start))
                if not pending:
                    return
                result = pending.popleft().result()
                going = going and apply(result)
        finally:
            for f in pending:
                f.exception()  # wait for it; its result no longer counts

    def _staged_objects(self, keys: list[PageHash], pages: list[int]) -> list[memoryview]:
        """Whole page objects in staging (for backends that take one contiguous value per key)."""
        values = []
        for slot, (k, p) in enumerate(zip(keys, pages)):
            for dst, src in zip(self._payload_views(slot), self._host_page_layers(p)):
                dst.copy_(src)
            mv = memoryview(self._staging[slot]).cast("B")
            self.codec.encode_into(mv, k)
            values.append(mv)
        return values

    def _prefetch(self, job: StorageJob) -> None:
        scattered = self.backend.get_scattered if self._scattered else None
        if not self.materialized:
            self._prefetch_accounted(job)
        elif scattered is None:
            self._prefetch_staged(job)
        else:
            self._prefetch_scattered(job, scattered)

    def _prefetch_accounted(self, job: StorageJob) -> None:
        """Planning: a key present counts as arrived; no bytes."""
        for start in range(0, len(job.keys), self.batch_pages):
            if job.cancelled:
                return
            keys = job.keys[start : start + self.batch_pages]
            for st in self._call(self.backend.get, [self.key(k) for k in keys], [_EMPTY] * len(keys)):
                job.statuses.append(st)
                if st is not KeyStatus.OK:
                    return
                job.arrived += 1

    def _prefetch_scattered(self, job: StorageJob, scattered) -> None:
        """One copy: each I/O thread reads a batch straight into its (not yet ready) host pages
        and checks it; ``arrived`` counts verified pages, in order."""

        def read_and_check(start: int) -> list[tuple[KeyStatus, str]]:
            keys = job.keys[start : start + step]
            with self._header_slab() as heads:
                parts = [[memoryview(heads[j]), *self._host_page_bytes(p)] for j, p in enumerate(job.host_pages[start : start + step])]
                statuses = self._call(scattered, [self.key(k) for k in keys], parts)
                return self._verify(keys, statuses, lambda i, k: self.codec.check_parts(parts[i][0], parts[i][1:], k))

        step = self._scattered_batch()
        # a failed page ends the chained prefix there; later batches stay unready
        self._in_order(job, range(0, len(job.keys), step), read_and_check, lambda verdicts: self._apply_checked(job, verdicts))

    def _prefetch_staged(self, job: StorageJob) -> None:
        """Through staging (backends without scattered reads, or host pages that are not contiguous)."""
        for start in range(0, len(job.keys), self.batch_pages):
            if job.cancelled:
                return
            keys = job.keys[start : start + self.batch_pages]
            pages = job.host_pages[start : start + self.batch_pages]
            outs = [memoryview(self._staging[slot]).cast("B") for slot in range(len(keys))]
            statuses = self._call(self.backend.get, [self.key(k) for k in keys], outs)
            verdicts = self._verify(keys, statuses, lambda i, k, outs=outs: self.codec.check(outs[i], k))
            for slot, (p, (st, _why)) in enumerate(zip(pages, verdicts)):
                if st is KeyStatus.OK:
                    for dst, src in zip(self._host_page_layers(p), self._payload_views(slot)):
                        dst.copy_(src)
            if not self._apply_checked(job, verdicts):
                return

    def _verify(self, keys: list[PageHash], statuses: list[KeyStatus], check) -> list[tuple[KeyStatus, str]]:
        """Check each read page (``check(i, key)`` -> the codec's verdict) up to the first that fails."""
        out: list[tuple[KeyStatus, str]] = []
        for i, (k, st) in enumerate(zip(keys, statuses)):
            why = ""
            if st is KeyStatus.OK:
                verdict = check(i, k)
                if verdict != "ok":
                    st, why = KeyStatus.ERROR, f"{self.key(k)} rejected ({verdict})"
                    self._discard(k)
            out.append((st, why))
            if st is not KeyStatus.OK:
                break
        return out

    def _discard(self, key: PageHash) -> None:
        """Delete an object that failed its check, so the next save of its key writes it again."""
        with map_storage_errors(self.backend.stats, "delete corrupt", lambda _e: None):
            self.backend.delete([self.key(key)])
            self.discarded_corrupt += 1

    def _apply_checked(self, job: StorageJob, verdicts: list[tuple[KeyStatus, str]]) -> bool:
        """Record verified pages on the job in order; False once one failed (its host page never becomes ready)."""
        for st, why in verdicts:
            job.statuses.append(st)
            if why:
                job.corrupt += 1
                log.warning("L3 page %s: treated as a miss", why)
            if st is not KeyStatus.OK:
                return False
            job.arrived += 1
        return True

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job finished (at most ``timeout_s``); True when idle."""
        if self._worker is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued jobs for up to ``timeout_s``, then fail what is left and stop the worker.

        Returns within about ``timeout_s`` plus one backend call's deadline, whatever the store does."""
        if self._worker is not None and not self._closed:
            self._closed = True
            if not self.drain(timeout_s):
                log.warning("L3 tier closing with jobs unfinished after %.1f s; the rest are dropped", timeout_s)
                while True:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job.cancel()
                        job.statuses += [KeyStatus.ERROR] * (len(job.keys) - len(job.statuses))
                        self._finished.put(job)
                        job.finished.set()
                    self._queue.task_done()
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
            self._worker.join(timeout_s)
            self._io.shutdown(wait=False, cancel_futures=True)
        if self.owns_backend:
            self.backend.close()
