"""The storage tier: moves whole host pages to and from an L3 backend on its own worker.

L3 I/O has its own worker (not the device<->host transfer engine's): storage
latency must never queue PCIe copies behind it. Jobs:

* ``save``: host pages -> page objects -> ``backend.set``; keys the store
  already has (longest stored prefix, one ``exists`` call) are skipped.
* ``prefetch``: ``backend.get`` into staging -> integrity check -> host pages.
  Pages land in order; ``job.arrived`` is the count of leading pages that are
  complete and verified, so a scheduler can use what arrived (best_effort).
  A page that is missing, corrupt or fails stops the run: later pages of a
  chained prefix are useless without it.

Nothing here raises into the cache for a storage fault: statuses are per page,
faults are counted, and the cache turns them into misses. The save queue is
bounded; a full queue makes the submitter wait up to ``backpressure_s`` and then
skip (counted), so a slow store slows saves, never requests.

Circuit breaker: after a backend fault the tier treats the store as down for
``cooldown_s`` (lookups answer "absent", jobs fail at once), then tries again,
so a dead server costs one timeout, not one per request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kvtier.hashing import Namespace, PageHash
from kvtier.l3.base import KeyStatus, StorageBackend, map_storage_errors
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
    def __init__(self, backend: StorageBackend, host_pool, namespace: Namespace, *, batch_pages: int = 8, queue_depth: int = 64, backpressure_s: float = 1.0, cooldown_s: float = 0.5):
        self.backend = backend
        self.host = host_pool
        self.spec = host_pool.spec
        self.namespace = namespace
        self.prefix = str(namespace)
        self.codec = PageCodec(self.spec)
        self.batch_pages = batch_pages
        self.backpressure_s = backpressure_s
        self.materialized = host_pool.materialized
        #: (byte view of a whole pool buffer, bytes per page of it), for page_first pools
        self._pool_bytes = [(memoryview(host_pool.buffers[b.name].numpy()).cast("B"), b.page_bytes * self.spec.num_layers)
                            for b in self.spec.buffers] if self.materialized and host_pool.layout.page_is_contiguous() else []
        self._staging = np.zeros((batch_pages, self.codec.object_bytes), dtype=np.uint8) if self.materialized else None
        if self._staging is not None and hasattr(backend, "register_buffer"):
            backend.register_buffer(memoryview(self._staging).cast("B"))  # zero-copy I/O where the backend supports it
        self._queue: queue.Queue[StorageJob | None] = queue.Queue(maxsize=queue_depth)
        self._finished: queue.SimpleQueue[StorageJob] = queue.SimpleQueue()
        self.skipped_saves = 0
        self.cooldown_s = cooldown_s
        self._down_until = 0.0
        #: seconds the worker spent per job kind ("save" / "prefetch")
        self.busy_s: dict[str, float] = {}
        #: without bytes (capacity planning) jobs run inline, deterministically, in the caller's thread
        self._worker = threading.Thread(target=self._run, name="kvtier-storage", daemon=True) if self.materialized else None
        #: checks pages (xxh3 over ~MBs) while the worker reads the next ones
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify") if self.materialized else None
        if self._worker is not None:
            self._worker.start()

    def key(self, page: PageHash) -> str:
        return f"{self.prefix}/{page.hex()}"

    # ---- health ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, *args):
        """Run a backend call; a new fault opens the circuit breaker for ``cooldown_s``."""
        errors = self.backend.stats.errors
        result = fn(*args)
        if self.backend.stats.errors != errors:
            self._down_until = time.monotonic() + self.cooldown_s
        return result

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
    def submit(self, kind: Literal["save", "prefetch"], keys: list[PageHash], host_pages: list[int], tag: object = None) -> StorageJob | None:
        if self._worker is None:
            from kvtier.transfer.engine import DONE

            job = StorageJob(kind, list(keys), list(host_pages), tag, finished=DONE)
            self._process(job)
            return job
        job = StorageJob(kind, list(keys), list(host_pages), tag)
        try:
            self._queue.put(job, timeout=self.backpressure_s if kind == "save" else None)
        except queue.Full:
            self.skipped_saves += len(keys)
            log.info("L3 save queue full: skipped %d pages", len(keys))
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
        scattered = getattr(self.backend, "set_scattered", None) if self.host.layout.page_is_contiguous() else None
        for start in range(have, len(job.keys), self.batch_pages):
            keys = job.keys[start : start + self.batch_pages]
            pages = job.host_pages[start : start + self.batch_pages]
            names = [self.key(k) for k in keys]
            if not self.materialized:  # planning: account the keys, move no bytes
                statuses = self._call(self.backend.set, names, [_EMPTY] * len(keys))
            elif scattered is not None:  # no staging copy: header + the host page's own buffers go out as they are
                parts = []
                for k, p in zip(keys, pages):
                    payload = self._host_page_bytes(p)
                    parts.append([memoryview(self.codec.header_for_parts(k, payload)), *payload])
                statuses = self._call(scattered, names, parts)
            else:
                statuses = self._call(self.backend.set, names, self._staged_objects(keys, pages))
            job.statuses += statuses
            if KeyStatus.ERROR in statuses:
                job.statuses += [KeyStatus.ERROR] * (len(job.keys) - len(job.statuses))
                return

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
        scattered = getattr(self.backend, "get_scattered", None) if self.host.layout.page_is_contiguous() else None
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
        """One copy, pipelined: the backend reads chunk ``k+1`` straight into its (not yet ready) host
        pages while the verifier thread checks chunk ``k``; ``arrived`` counts verified pages, in order."""
        heads = np.empty((len(job.keys), HEADER_BYTES), dtype=np.uint8)
        step = getattr(self.backend, "preferred_batch", None) or self.batch_pages
        check = None
        for start in range(0, len(job.keys), step):
            if job.cancelled:
                break
            keys = job.keys[start : start + step]
            parts = [[memoryview(heads[start + j]), *self._host_page_bytes(p)] for j, p in enumerate(job.host_pages[start : start + step])]
            statuses = self._call(scattered, [self.key(k) for k in keys], parts)
            if check is not None and not self._apply_checked(job, check.result()):
                return  # an earlier page failed: the chained prefix ends there (this chunk stays unready)
            check = self._verifier.submit(self._verify, keys, statuses, lambda i, k, parts=parts: self.codec.check_parts(parts[i][0], parts[i][1:], k))
        if check is not None:
            self._apply_checked(job, check.result())

    def _prefetch_staged(self, job: StorageJob) -> None:
        """Through staging (backends without scattered reads, or host pages that are not contiguous)."""
        for start in range(0, len(job.keys), self.batch_pages):
            if job.cancelled:
                return
            keys = job.keys[start : start + self.batch_pages]
            pages = job.host_pages[start : start + self.batch_pages]
            outs = [memoryview(self._staging[slot]).cast("B") for slot in range(len(keys))]
            statuses = self._call(self.backend.get, [self.key(k) for k in keys], outs)
            verdicts = self._verify(keys, statuses, lambda i, k: self.codec.check(outs[i], k))
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
            out.append((st, why))
            if st is not KeyStatus.OK:
                break
        return out

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

    def drain(self) -> None:
        if self._worker is not None:
            self._queue.join()

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._verifier.shutdown()
        self.backend.close()
