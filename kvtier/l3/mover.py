"""The L3 page mover: page objects between a store and the caller's own page buffers.

One place does what every L3 client needs, whoever owns the pages (kvtier's
host pool through :class:`~kvtier.l3.tier.StorageTier`, an SGLang host pool
through :class:`~kvtier.integrations.sglang.backend.KvtierStorage`):

* **write**: each page's header is hashed over its payload buffers as they
  are (into a header slab) and the object goes to the store as header +
  buffers (``set_scattered``), or joined into one value for a store that takes
  whole objects only;
* **read**: each object lands straight in its payload buffers with its header
  in a slab (``get_scattered``), or in a staged object that is checked before
  a byte is copied out; every page is checked against its header
  (:class:`~kvtier.l3.page.PageCodec`) before it counts as read;
* **repair**: an object that fails its check -- or that the store reports
  present but of the wrong size (``KeyStatus.WRONG_SIZE``: truncated,
  extended, empty) -- is a miss, deleted from the store so the next save of
  its key writes it again (saves skip keys the store has), and counted;
* **order**: :func:`in_order` runs batches on I/O threads, a bounded number in
  flight, and applies their results in batch order until one fails.

Callers give page payloads as lists of byte views (one per contiguous run of
the page, in payload order); the mover never sees a pool.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager

import numpy as np

from kvtier.l3.base import KeyStatus, StorageBackend, map_storage_errors, scatter_into
from kvtier.l3.breaker import CircuitBreaker
from kvtier.l3.page import HEADER_BYTES, PageCodec

log = logging.getLogger(__name__)

#: a read page's outcome: its status and, when its object failed the check, why (else "")
Verdict = tuple[KeyStatus, str]


class PageMover:
    """Reads and writes page objects of one store through its breaker (a store, or a node, marked
    down is never called). Thread-safe: I/O threads call it at once, each with its own header slab."""

    def __init__(self, backend: StorageBackend, breaker: CircuitBreaker, *, on_discard: Callable[[str, str], None] | None = None):
        self.backend = backend
        self.breaker = breaker
        self.scattered = backend.capabilities.scattered
        #: called with (name, verdict) for each object deleted after failing its check
        self.on_discard = on_discard
        #: objects that failed their check on read and were deleted from the store
        self.discarded = 0
        self._lock = threading.Lock()
        self._rows = 0
        self._slabs: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        #: every block registered with the store, kept while it is open (registered memory must stay alive)
        self._registered: list[np.ndarray] = []

    # ---- batches -----------------------------------------------------------------------
    def batch_pages(self, codec: PageCodec, fallback: int) -> int:
        """Pages per store call: about the backend's ``capabilities.batch_bytes`` (file: a few MB, so
        each I/O thread checks what it just read while it is in cache; Mooncake: a whole engine batch),
        else ``fallback``."""
        per_call = self.backend.capabilities.batch_bytes
        return max(1, per_call // codec.object_bytes) if per_call else fallback

    def reserve_slabs(self, count: int, rows: int) -> None:
        """Header slabs for ``count`` calls in flight of up to ``rows`` pages each (registered with a
        store that moves only registered memory). Call before I/O starts; grows, never shrinks."""
        if rows <= self._rows:
            return
        self._rows = rows
        self._slabs = queue.SimpleQueue()
        block = np.zeros((count, rows, HEADER_BYTES), dtype=np.uint8)  # one allocation, registered once
        if self.backend.capabilities.registers_buffers:
            self.backend.register_buffer(memoryview(block).cast("B"))
            self._registered.append(block)  # (freed, the next block could land on it: registered twice, refused)
        for slab in block:
            self._slabs.put(slab)

    @property
    def slabs_free(self) -> int:
        """Header slabs not held by a call (all of them once no call is in flight)."""
        return self._slabs.qsize()

    @contextmanager
    def _heads(self, n: int):
        if n > self._rows:  # (a caller batch larger than reserved: a slab of its own, unregistered)
            yield np.zeros((n, HEADER_BYTES), dtype=np.uint8)
            return
        slabs = self._slabs  # (back to the set it came from, should reserve_slabs replace it meanwhile)
        slab = slabs.get()
        try:
            yield slab
        finally:
            slabs.put(slab)

    # ---- write -------------------------------------------------------------------------
    def write(self, codec: PageCodec, names: Sequence[str], keys: Sequence[bytes],
              payloads: Sequence[Sequence[memoryview]], owners: Sequence[int] | None = None) -> list[KeyStatus]:
        """Store each page: ``names[i]`` gets a header for ``keys[i]`` hashed over ``payloads[i]`` (with owner tag
        ``owners[i]``, :func:`~kvtier.hashing.owner_tag`; none: the namespace's), then the payload as it is. A status
        per page (an empty list: the store is marked down); from the first page on a node marked down, ERROR without
        a call."""
        if not self.breaker.available:
            return []
        with self._heads(len(names)) as heads:
            parts = []
            for j, (k, payload) in enumerate(zip(keys, payloads)):
                heads[j] = np.frombuffer(codec.header_for_parts(k, payload, owner=owners[j] if owners else 0), dtype=np.uint8)
                parts.append([memoryview(heads[j]), *payload])
            if self.scattered:
                statuses = self.breaker.call(self.backend.set_scattered, list(names), parts)
            else:
                statuses = self.breaker.call(self.backend.set, list(names), [memoryview(b"".join(ps)) for ps in parts])
            return _unreached_failed(statuses, len(names))

    # ---- read --------------------------------------------------------------------------
    def read(self, codec: PageCodec, names: Sequence[str], keys: Sequence[bytes], payloads: Sequence[Sequence[memoryview]], *,
             leading: bool = True) -> list[Verdict]:
        """Read each page into ``payloads[i]``; a verdict per page, in order. A page is OK only when its
        object arrived and passed its check (a scattered read may have written a page that failed: its
        buffers hold no meaning then); an object that failed, or was of the wrong size, is deleted and
        its verdict says why. ``leading``: stop at the first page that is not OK (a chained prefix is
        useless past it). An empty list: the store is marked down; from the first page on a node
        marked down, ERROR without a call."""
        if not self.breaker.available:
            return []
        with self._heads(len(names)) as heads:
            parts = [[memoryview(heads[j]), *payload] for j, payload in enumerate(payloads)]
            if self.scattered:
                statuses = self.breaker.call(self.backend.get_scattered, list(names), parts)
                check = lambda j: codec.check_parts(parts[j][0], parts[j][1:], keys[j])  # noqa: E731
            else:  # whole objects: staged, checked, then copied out
                staged = [bytearray(codec.object_bytes) for _ in names]
                statuses = self.breaker.call(self.backend.get, list(names), [memoryview(o) for o in staged])

                def check(j: int) -> str:
                    verdict = codec.check(memoryview(staged[j]), keys[j])
                    if verdict == "ok":
                        scatter_into(memoryview(staged[j]), parts[j])  # header into its slab row, payload into place
                    return verdict
            out: list[Verdict] = []
            for j, st in enumerate(_unreached_failed(statuses, len(names))):
                why = ""
                if st is KeyStatus.OK or st is KeyStatus.WRONG_SIZE:  # an object is there: it must pass its check
                    verdict = check(j) if st is KeyStatus.OK else "size"
                    if verdict != "ok":
                        st, why = KeyStatus.ERROR, f"{names[j]} rejected ({verdict})"
                        self.discard(names[j], verdict)
                out.append((st, why))
                if leading and st is not KeyStatus.OK:
                    break
            return out

    def discard(self, name: str, verdict: str) -> None:
        """An object that failed its check: deleted, so the next save of its key writes it again."""
        log.warning("L3 page %s rejected (%s): treated as a miss and deleted", name, verdict)
        with self._lock:
            self.discarded += 1
        if self.on_discard is not None:
            self.on_discard(name, verdict)
        with map_storage_errors(self.backend.stats, "delete corrupt", lambda _e: None):
            self.backend.delete([name])


def _unreached_failed(statuses: list[KeyStatus] | None, n: int) -> list[KeyStatus]:
    """A breaker call's statuses for ``n`` names: those it did not reach (past a node marked down) failed."""
    statuses = statuses or []
    return statuses + [KeyStatus.ERROR] * (n - len(statuses))


def in_order(io: Executor, starts: Iterable[int], work: Callable[[int], object], apply: Callable[[object], bool], *,
             in_flight: int, cancelled: Callable[[], bool] = lambda: False) -> None:
    """Run ``work(start)`` for each batch on ``io``, at most ``in_flight`` at once, and ``apply`` the
    results in batch order until one returns False.

    Nothing is submitted after a failure or once ``cancelled()``, and every batch in flight is waited
    for before this returns, also on an exception: the caller may then release the pages."""
    pending: deque[Future] = deque()
    starts = iter(starts)
    going = True
    try:
        while True:
            while going and not cancelled() and len(pending) < in_flight:
                start = next(starts, None)
                if start is None:
                    break
                pending.append(io.submit(work, start))
            if not pending:
                return
            result = pending.popleft().result()
            going = going and apply(result)
    finally:
        for f in pending:
            f.exception()  # wait for it; its result no longer counts
