"""SGLang's host pool pages in the node service's shared region (``kvtier serve``): the page store of
:class:`~kvtier.integrations.sglang.backend.KvtierStorage` when its extra config names a ``service``.

**The region's page.** One region page holds one SGLang page of every pool in the *group*: the KV
pool and the pools that ride on its page ids (the DSA indexer), one buffer row each
(:func:`~kvtier.pools.host.region_offsets` with one layer per row), each row the pool's page as
SGLang's ``get_data_page`` flattens it -- the payload kvtier's L3 page object holds. So a page is a
hit only with its indexer: both are in the one region page, published together. Pages are copied
between SGLang's host pool and the region whole, page by page (:class:`PoolPages` views); a write
copies every group pool's page before it is published, a read copies the one pool's row it is asked
for.

**Pools with page ids of their own** (SGLang's SWA window pool, its Mamba state pool) are the region's
object pools (:meth:`~kvtier.service.region.RegionFormat.with_objects` with a row object each): a page
of such a pool is one object, published under its page hash's key in that pool
(:meth:`~kvtier.service.region.RegionFormat.key_of`), and found key by key (``find``), since SGLang's
trailing-pages policy asks for some pages of a prefix (a window, one state), not a run.

**The service's L3.** A row is the payload of its pool's L3 page object, and the format says how
(:meth:`~kvtier.service.region.RegionFormat.of_rows`: each pool's fingerprint and page size). The
pages' keys are the digests of SGLang's page hashes; the hashes themselves go beside them (the ops'
``names``) where the service may need to name an object -- a lookup that asks what exists or reads
(the service fetches the rest of the run from L3), a publish (it saves what was published) -- so a
service with ``--storage-url`` stores and finds the very objects this backend's own L3 would
(``namespace/<page hash>``, same header and bytes).

**Connections.** SGLang calls the backend from several threads at once (its prefetch query, its
prefetch I/O and its backup thread). Each thread gets a connection of its own: a lookup's holds are a
connection's (the service ends a lookup's run at a page the connection holds already), and one thread's
call is then never behind another's on one socket. Every call is synchronous: a lookup's pages are
released once copied (at once for an existence query), a reserved page is published (and released)
once its bytes are copied, so when a call returns no page of its connection is held or leased.

**Faults are misses.** Any :class:`~kvtier.errors.ServiceError` (the service is down, stalled past
the lookup deadline, dropped the connection, or answered out of protocol: the client checks every
answer's types, ranges and counts before a page is copied, counted in ``protocol_errors``) ends the
thread's connection, and the call reports
what it finished (misses after it); no exception leaves. The thread attaches again at a later call --
one attempt per backoff step (:class:`~kvtier.service.backoff.AttachBackoff`, an engine's host tier's
schedule), each within the lookup deadline; at once when its call finds that the service hung up --
naming its lost session as quiesced (nothing touches its pages once its call returned), so a service
that kept it as an orphan frees it; the region it names then (a restarted service's is a new file) is
mapped anew.

**Any start order, and a heartbeat.** A service that is not there when SGLang starts is one warning line,
then misses (``service_required`` makes it SGLang's failed start instead). SGLang's threads call only
for requests, so an idle server would attach to a service that appeared (or came back after a crash)
only with its next prompt. A :class:`~kvtier.service.heartbeat.Heartbeat` thread keeps a session of its
own: every beat it loses it when the service hung up and attaches when the backoff says, so the service
lists this server within seconds of (re)appearing and its region is mapped for SGLang's threads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ServiceError, ServiceProtocolError
from kvtier.hashing import name_key
from kvtier.integrations.sglang.pool_pages import PoolPages
from kvtier.pages import check_pages_in_range
from kvtier.pools.host import region_offsets
from kvtier.service.client import ServiceClient, lookup_deadline
from kvtier.service.messages import MAX_OBJECT_NAME
from kvtier.service.backoff import AttachBackoff
from kvtier.service.heartbeat import HEARTBEAT_S, Heartbeat
from kvtier.service.region import ObjectPool, RegionFormat, RowObject

log = logging.getLogger(__name__)


def region_format(group: Sequence[PoolPages], *, objects: bool = True, pools: Sequence[PoolPages] = ()) -> RegionFormat:
    """The region page of ``group`` (the KV pool first, then the pools on its page ids): one row per pool, each
    the payload of that pool's L3 page object. ``objects``: the format says how each row is an object (its pool's
    fingerprint and page size), so a service with L3 can store the objects this engine's own L3 would. ``pools``:
    the pools with page ids of their own (SGLang's SWA and Mamba host pools), an object pool of the region each
    (:meth:`~kvtier.service.region.RegionFormat.with_objects`), one of their pages per region page."""
    rows = [RowObject(p.fingerprint, p.page_size) for p in group]
    fmt = RegionFormat.of_rows(rows, [p.payload_bytes for p in group])
    fmt = fmt.with_objects([ObjectPool.of_row(p.name, RowObject(p.fingerprint, p.page_size), p.payload_bytes) for p in pools])
    return fmt if objects else dataclasses.replace(fmt, rows=None)


@dataclass(frozen=True)
class WriteResult:
    """A write's pages: ``stored`` were in the service already (its leading run), ``written`` were copied
    and published after them; the rest did not fit (every region page held) or the service was lost."""

    stored: int
    written: int


@dataclass(frozen=True)
class ObjectsWritten:
    """A write of an object pool's pages: ``done`` per page (the service had it, or it was written now), ``stored`` were
    there already, ``written`` were copied and published; the rest did not fit or the service was lost."""

    done: list[bool]
    stored: int
    written: int


class _Session:
    """One thread's attachment: its client and the mapped region (with each row's offset in it)."""

    def __init__(self, client: ServiceClient, memory: torch.Tensor, fmt: RegionFormat):
        self.client = client
        self.memory = memory  # keeps the mapping alive while this session may copy
        self.bytes = memoryview(memory.numpy()).cast("B")
        self.row_offsets = region_offsets(fmt.buffer_page_bytes, fmt.num_layers, client.num_pages)[0]
        self.row_bytes = fmt.buffer_page_bytes
        #: each object pool's (offset of its object 0 minus its first id's, its object's bytes): ids are region-wide
        self.pool_rows = [(fmt.part(k, client.num_pages)[0] - k * client.num_pages * o.row_bytes, o.row_bytes)
                          for k, o in enumerate(fmt.objects, start=1)]

    def row(self, row: int, page: int) -> memoryview:
        start = self.row_offsets[row] + page * self.row_bytes[row]
        return self.bytes[start : start + self.row_bytes[row]]

    def object(self, pool: int, page: int) -> memoryview:
        """Object pool ``pool``'s page ``page`` (its id region-wide)."""
        base, size = self.pool_rows[pool - 1]
        return self.bytes[base + page * size : base + (page + 1) * size]


class _ThreadState(threading.local):
    session: _Session | None = None
    #: the session this thread lost (named as quiesced when it attaches again)
    lost: str | None = None

    def __init__(self):
        self.backoff = AttachBackoff()


class ServicePages:
    """The group's pages in the service at ``socket_path``, in ``namespace`` (a
    :class:`~kvtier.hashing.Namespace`'s string). ``on_fault()`` is called once per lost connection.
    ``service_uid``: the uid the service runs as where it is not this process's (:class:`ServiceClient`'s)."""

    def __init__(self, socket_path: str, namespace: str, group: Sequence[PoolPages], *, deadline_s: float,
                 lookup_deadline_s: float | None, on_fault: Callable[[], None] = lambda: None, service_uid: int | None = None,
                 objects: bool = True, pools: Sequence[PoolPages] = ()):
        self.socket_path = socket_path
        self.service_uid = service_uid
        self.namespace = namespace
        self.group = list(group)
        #: the pools with page ids of their own (SGLang's SWA and Mamba host pools): the region's object pools 1, 2, ...
        self.pools = list(pools)
        self.format = region_format(self.group, objects=objects, pools=self.pools)
        self.deadline_s = deadline_s
        #: the deadline of every call from SGLang's threads, attaching again included
        self.lookup_deadline_s = lookup_deadline(deadline_s, lookup_deadline_s)
        self.on_fault = on_fault
        self._state = _ThreadState()
        self._lock = threading.Lock()
        self._sessions: list[_Session] = []  # every thread's, for close()
        self._mapped: tuple[str, torch.Tensor] | None = None  # the region mapped last, shared by the sessions on it
        #: connections lost; attached again; losses (and failed attempts to attach again) to an answer out of protocol
        self.losses = self.reattaches = self.skipped_pages = self.protocol_errors = 0
        self._absent_at_start = False  # (attach_now found no service: the first attach after says so)
        self._closed = False
        self.heartbeat = Heartbeat(self._beat, "kvtier-hicache-heartbeat", period_s=HEARTBEAT_S)  # (held weakly: see Heartbeat)

    def row_of(self, pool: PoolPages) -> int:
        return next(i for i, p in enumerate(self.group) if p is pool)

    def object_pool_of(self, pool: PoolPages) -> int | None:
        """The region's object pool (1, 2, ...) that holds ``pool``'s pages; None for a pool on the KV pool's page ids."""
        return next((k for k, p in enumerate(self.pools, start=1) if p is pool), None)

    # ---- attaching ---------------------------------------------------------------------------------
    def attach_now(self, *, required: bool = False) -> bool:
        """Attach this thread within the whole call deadline (at start: the first hello makes the region).
        A service that is not there is one warning line, then misses until the heartbeat attaches it;
        ``required``: the :class:`~kvtier.errors.ServiceError` (its own type) naming the socket and the fix,
        and these pages are closed (SGLang's start fails)."""
        try:
            self._attach_thread(self.deadline_s)
        except ServiceError as e:
            if required:
                self.close()
                raise type(e)(f"kvtier HiCache storage: service_required, and the node service at {self.socket_path} cannot be "
                              f"attached: {e}; start it first, or drop service_required to start without it") from e
            log.warning("kvtier HiCache storage: the node service at %s is not attached at start (%s); pages miss until it "
                        "appears (a background heartbeat attaches it within seconds); set service_required to fail the start instead",
                        self.socket_path, e)
            with self._lock:
                self._absent_at_start = not self._sessions  # (unless another thread attached meanwhile)
            return False
        return True

    def _beat(self) -> None:
        """The heartbeat thread's own session: lost when the service hung up, attached (again) when the backoff
        says -- so a (re)started service lists this engine, and its region is mapped, while SGLang is idle. Nothing
        waits on it: it attaches within the whole call deadline (a restarted service's first hello makes its region)."""
        self._session(self.deadline_s)

    def _session(self, attach_s: float | None = None) -> _Session | None:
        """This thread's session, attached when the backoff says; None while not attached. One the service hung up
        on is lost first and attached again at once (a restarted service serves this very call, not a failed one)."""
        state = self._state
        hung_up = state.session is not None and state.session.client.hung_up()
        if hung_up:
            self._lose(state.session, ServiceError("the node service hung up"))
        if state.session is not None:
            return state.session
        if not hung_up and not state.backoff.due():
            return None
        try:
            return self._attach_thread(self.lookup_deadline_s if attach_s is None else attach_s)
        except ServiceError as e:
            log.debug("kvtier HiCache storage: the node service at %s is not attached (%s); pages miss until it is",
                      self.socket_path, e)
            return None

    def _attach_thread(self, attach_s: float) -> _Session:
        """Attach this thread (naming the session it lost), or raise the :class:`ServiceError` after booking the failure."""
        state = self._state
        try:
            state.session = self._attach(state.lost, attach_s)
        except ServiceError as e:
            state.backoff.failed()
            if isinstance(e, ServiceProtocolError):
                with self._lock:
                    self.protocol_errors += 1
            raise
        with self._lock:
            appeared, self._absent_at_start = self._absent_at_start, False
            self.reattaches += state.lost is not None
        if state.lost is not None:
            log.warning("kvtier HiCache storage: attached to the node service at %s again", self.socket_path)
        elif appeared:
            log.warning("kvtier HiCache storage: the node service at %s appeared; attached", self.socket_path)
        state.lost = None
        state.backoff.attached()
        return state.session

    def _attach(self, previous: str | None, attach_s: float) -> _Session:
        client = ServiceClient(self.socket_path, self.namespace, self.format, deadline_s=self.deadline_s,
                               lookup_deadline_s=self.lookup_deadline_s, previous=previous, attach_deadline_s=attach_s,
                               service_uid=self.service_uid)
        try:
            session = _Session(client, self._map(client), self.format)
        except BaseException:
            client.close()
            raise
        with self._lock:
            if not self._closed:
                self._sessions.append(session)
                return session
        client.close(quiesced=True)  # (the heartbeat attached while close() ran)
        raise ServiceError("these pages are closed")

    def _map(self, client: ServiceClient) -> torch.Tensor:
        with self._lock:
            if self._mapped is None or self._mapped[0] != client.region:
                self._mapped = (client.region, client.map_region(pin=False))  # (host<->host copies)
            return self._mapped[1]

    def _lose(self, session: _Session, error: ServiceError) -> None:
        state = self._state
        session.client.close(quiesced=False)  # (its holds, if the service lives, end when this thread attaches again)
        with self._lock:
            if session in self._sessions:  # (not when close() detached it already)
                self._sessions.remove(session)
            self.losses += 1
            self.protocol_errors += isinstance(error, ServiceProtocolError)
        state.session, state.lost = None, session.client.session
        state.backoff.lost()
        self.on_fault()
        log.warning("kvtier HiCache storage: the node service at %s is lost (%s); misses until it is back", self.socket_path, error)

    # ---- pages ---------------------------------------------------------------------------------
    def stored(self, names: list[str]) -> int:
        """How many of the leading pages SGLang names ``names`` (its page hashes; the service's keys are their
        :func:`~kvtier.hashing.name_key`) the service holds (held for the answer, released at once); a service with L3
        may bring the rest of the run from it first."""
        return self._held_run(names, lambda _session, _held: None)

    def read(self, pool: PoolPages, names: list[str], into: list[int]) -> int:
        """The leading run of the pages ``names`` the service holds, copied into ``pool``'s pages ``into``; how many."""
        row = self.row_of(pool)

        def copy_in(session: _Session, held: list[int]) -> None:
            for page, region_page in zip(into, held):
                _copy_in(pool, page, session.row(row, region_page))

        return self._held_run(names, copy_in)

    def _held_run(self, names: list[str], use: Callable[[_Session, list[int]], None]) -> int:
        """The leading run of the pages ``names`` the service holds, held while ``use(session, pages)`` runs and released
        after it; its length, or 0 when the service is not attached or was lost on the way."""
        session = self._session() if names else None
        if session is None:
            return 0
        try:
            # (checked: distinct ids of the region, no more than asked)
            held = session.client.lookup(list(map(name_key, names)), self._names(names))
            try:
                use(session, held)
            finally:
                if held:
                    session.client.release(held)
        except ServiceError as e:
            self._lose(session, e)
            return 0
        return len(held)

    def write(self, names: list[str], pages: list[int]) -> WriteResult:
        """Every group pool's ``pages`` into region pages of the pages SGLang names ``names``: the leading run the service
        has is skipped, the rest reserved, copied, then published (and released: the service's LRU may evict them once no
        engine holds them)."""
        for pool in self.group[1:]:  # the pools on the KV pool's page ids: those pages exist in each
            check_pages_in_range(torch.tensor(pages, dtype=torch.int64), pool.num_pages, pool=f"SGLang host pool {pool.name!r}",
                                 side="host")
        session = self._session() if names else None
        if session is None:
            return WriteResult(0, 0)
        written = 0
        keys = list(map(name_key, names))
        try:
            held = session.client.lookup(keys)  # (no names: nothing is fetched from L3 for pages about to be written)
            if held:
                session.client.release(held)
            todo = len(keys) - len(held)
            got = session.client.reserve(todo) if todo else []  # (checked as a lookup's)
            for region_page, page in zip(got, pages[len(held):]):
                for row, pool in enumerate(self.group):
                    _copy_out(pool, page, session.row(row, region_page))
            span = slice(len(held), len(held) + len(got))
            session.client.publish_and_release(got, keys[span], self._names(names[span]))
            written = len(got)
            with self._lock:
                self.skipped_pages += todo - written
        except ServiceError as e:
            self._lose(session, e)
            return WriteResult(0, 0)
        return WriteResult(len(held), written)

    # ---- objects: the pages of a pool with page ids of its own, each key on its own --------------------
    def present(self, pool: PoolPages, names: list[str]) -> list[bool]:
        """Which of the pages SGLang names ``names`` the service holds in ``pool``'s object pool, each on its own (held for
        the answer, released at once); a service with L3 may bring them from it first."""
        return self._found(pool, names, lambda _session, _found: None)

    def read_objects(self, pool: PoolPages, names: list[str], into: list[int]) -> list[bool]:
        """The pages ``names`` the service holds in ``pool``'s object pool, each copied into ``pool``'s page ``into[i]``."""
        k = self.object_pool_of(pool)

        def copy_in(session: _Session, found: list[int]) -> None:
            for page, region_page in zip(into, found):
                if region_page >= 0:
                    _copy_in(pool, page, session.object(k, region_page))

        return self._found(pool, names, copy_in)

    def _found(self, pool: PoolPages, names: list[str], use: Callable[[_Session, list[int]], None]) -> list[bool]:
        """Each of ``names`` the service holds in ``pool``'s object pool, held while ``use(session, found)`` runs (``found``: a
        region id or -1 per name) and released after it; all False when the service is not attached or was lost on the way."""
        session = self._session() if names else None
        if session is None:
            return [False] * len(names)
        k = self.object_pool_of(pool)
        try:
            # (checked: one entry per key, ids of the pool or -1, none twice)
            found = session.client.find([self.format.key_of(k, n) for n in names], k, self._names(names))
            try:
                use(session, found)
            finally:
                held = [p for p in found if p >= 0]
                if held:
                    session.client.release(held)
        except ServiceError as e:
            self._lose(session, e)
            return [False] * len(names)
        return [p >= 0 for p in found]

    def write_objects(self, pool: PoolPages, names: list[str], pages: list[int]) -> ObjectsWritten:
        """``pool``'s ``pages`` into its object pool as the pages SGLang names ``names``: those the service has are skipped,
        the rest reserved, copied, then published (and released)."""
        check_pages_in_range(torch.tensor(pages, dtype=torch.int64), pool.num_pages, pool=f"SGLang host pool {pool.name!r}", side="host")
        session = self._session() if names else None
        if session is None:
            return ObjectsWritten([False] * len(names), 0, 0)
        k = self.object_pool_of(pool)
        keys = [self.format.key_of(k, n) for n in names]
        try:
            found = session.client.find(keys, k)  # (no names: nothing is fetched from L3 for objects about to be written)
            held = [p for p in found if p >= 0]
            if held:
                session.client.release(held)
            todo = [i for i, p in enumerate(found) if p < 0]
            got = session.client.reserve(len(todo), k) if todo else []  # (checked: ids of the pool, none twice)
            for region_page, i in zip(got, todo):
                _copy_out(pool, pages[i], session.object(k, region_page))
            wrote = todo[: len(got)]
            session.client.publish_and_release(got, [keys[i] for i in wrote], self._names([names[i] for i in wrote]))
            with self._lock:
                self.skipped_pages += len(todo) - len(got)
        except ServiceError as e:
            self._lose(session, e)
            return ObjectsWritten([False] * len(names), 0, 0)
        done = [p >= 0 for p in found]
        for i in wrote:
            done[i] = True
        return ObjectsWritten(done, len(held), len(wrote))

    def _names(self, names: list[str]) -> list[str] | None:
        """The object names an op carries: none where the format does not say how its rows are objects, or a name
        is not one the service takes -- empty, longer than it takes, or with a "/" (that op's pages are then neither
        saved to L3 nor fetched from it)."""
        if self.format.rows is None or not all(0 < len(n) <= MAX_OBJECT_NAME and "/" not in n for n in names):
            return None
        return names

    def close(self) -> None:
        """Stop the heartbeat, then detach every thread's session, the heartbeat's included (SGLang stopped its
        threads: nothing touches their pages)."""
        self.heartbeat.stop()
        with self._lock:
            sessions, self._sessions, self._closed = self._sessions, [], True
        for session in sessions:
            session.client.close(quiesced=True)


def _copy_in(pool: PoolPages, page: int, row: memoryview) -> None:
    """A region row into ``pool``'s page ``page``, run by run."""
    views = pool.views(page)
    at = 0
    for view in views:
        view[:] = row[at : at + len(view)]
        at += len(view)
    pool.write_back(page, views)


def _copy_out(pool: PoolPages, page: int, row: memoryview) -> None:
    """``pool``'s page ``page`` into a region row, run by run."""
    at = 0
    for view in pool.views(page):
        row[at : at + len(view)] = view
        at += len(view)
