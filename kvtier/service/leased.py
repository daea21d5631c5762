"""An engine's host tier on the node service: the region's pages this engine holds, as its core's host allocator.

:class:`LeasedPages` is a :class:`~kvtier.alloc.PageAllocator` of the region's page ids whose pages come
from the service: ``alloc`` reserves pages to write (one round trip), ``free`` releases them (a note),
and, as the core's shared host index (:class:`~kvtier.core.shared_host.SharedHost`), ``lookup`` asks
for the pages other engines published after this engine's own prefix (``lookup_many``: for many
requests in one round trip), ``adopt`` books them, ``let_go`` gives back those it takes no place for, and
``publish`` makes a finished backup visible to everyone. The bookkeeping (ownership bytes, holds for
plans that timed out) is the base class's, so the core's accounting checks hold unchanged.

``share``: how many of the region's pages this engine may hold at once (its host tier's size); the
service evicts among the pages no engine holds.

**The service lost.** Any :class:`~kvtier.errors.ServiceError` (the service died, dropped this engine,
or missed a deadline -- a lookup's, a reservation's or a note's is the client's short ``lookup_deadline_s``,
so a stalled service holds the engine's thread that long, once) makes the tier ``lost``: it gives no
pages, finds none, tells the service nothing, and takes the core's pages back into its own books only;
the core forgets every region page it holds at its next match
(:meth:`~kvtier.core.cache_core.CacheCore._forget_shared_host`). No exception reaches the engine. An
answer out of protocol is one such error (:class:`~kvtier.errors.ServiceProtocolError`: the client
checks every answer's types, ranges and counts, and this class that no page it is given is one it
holds already), counted in :attr:`LeasedPages.protocol_errors` besides :attr:`LeasedPages.losses`. Once
the core holds none of the old session's pages (so no copy touches them), a lookup or an allocation
attaches again -- at most one attempt per backoff step (:class:`~kvtier.service.backoff.AttachBackoff`),
each bounded by the client's lookup deadline -- naming the old session as
quiesced, so a service that kept it (this process lives) frees it; the host pool then maps the
service's region anew (a restarted service's region is another file, and the old one's page ids are in
no tree any more), resized if the new region holds another number of pages.

**Any start order; attached between requests.** Built with no client (the service was not there when
the engine started: :func:`~kvtier.service.attach.attach_pages`), the tier starts lost, with no pages,
and attaches like a lost one. A :class:`~kvtier.service.heartbeat.Heartbeat` does what the engine's
calls would, between them: it notices a hang-up (the service died, or dropped this engine) and attaches
when it is time. While the core still holds pages of the old region, the beat attaches a *standby*
client beside them (the new service sees this engine within seconds; it holds nothing), which becomes
the client once the core's next match has forgotten those pages -- unless it is of the same region
(the service lives and may keep the old session as an orphan), when the old session is named quiesced
by a fresh attach instead. Every entry point takes one lock, so the beat and the engine's thread never
interleave.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvtier.alloc import Allocation, PageAllocator
from kvtier.errors import ConfigError, ServiceError, ServiceProtocolError
from kvtier.pools.host import HostPool
from kvtier.service.backoff import AttachBackoff
from kvtier.service.client import ServiceClient
from kvtier.service.heartbeat import Heartbeat
from kvtier.service.region import Region
from kvtier.service.tenants import owner_id

log = logging.getLogger(__name__)

#: attach a client naming a quiesced session of this process (or None), within the lookup deadline
Connect = Callable[[str | None], ServiceClient]


class _PoolLease(PageAllocator):
    """One pool of the node service's region leased to this engine -- its pages (:class:`LeasedPages`, pool 0) or one
    of its object pools (:class:`ObjectLease`) -- over an attachment (``_attachment``: the :class:`LeasedPages` whose
    client, lock and lost state every pool of the region shares). Ids are the pool's own, ``0`` to ``num_pages - 1``;
    on the wire they are region-wide, ``pool * num_pages`` on. The books (ownership bytes, holds for plans that timed
    out) are :class:`PageAllocator`'s; ``alloc`` reserves ids to write, ``free`` releases them; ``find`` asks for what
    other engines published under keys, ``adopt`` books it, ``let_go`` gives back what the core takes no place for,
    and ``publish`` makes finished copies visible. A failure loses the attachment; no exception reaches the engine."""

    #: which of the region's pools (0: its pages)
    pool_id = 0
    _attachment: LeasedPages

    def _base(self) -> int:
        return self.pool_id * self.num_pages

    @property
    def capacity(self) -> int:
        return self._attachment.share

    @property
    def num_used(self) -> int:
        return self._used

    @property
    def num_free(self) -> int:
        at = self._attachment
        if at.lost:
            return 0
        free = at.share - self._used
        return free if self._room is None else min(free, self._room)

    def alloc(self, n: int) -> Allocation:
        """``n`` ids reserved for writing, or none: this engine's share is used up, or the service has
        fewer to give (its pages are all held), or it is lost; then :attr:`num_free` says how many it had."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        at = self._attachment
        with at._lock:
            if at.lost:
                at._try_reattach()
            free_before = self.num_free
            if n > free_before:
                return Allocation([], n, free_before)
            if n == 0:
                return Allocation([], 0, free_before)
            base = self._base()
            try:
                pages = self._not_held([p - base for p in at.client.reserve(n, self.pool_id)], "reservation")
            except ServiceError as e:
                at._lose(e)
                return Allocation([], n, 0)
            if len(pages) < n:
                if pages:
                    at._tell(at.client.release, [base + p for p in pages])
                self._room = len(pages)
                return Allocation([], n, free_before)
            self._book(pages)
            return Allocation(pages, n, free_before)

    def free(self, pages: list[int]) -> None:
        with self._attachment._lock:
            super().free(pages)  # checks them (a DoubleFreeError frees nothing); parks those a timed-out plan holds
            self._give_back()

    def hold(self, pages) -> None:
        with self._attachment._lock:
            super().hold(pages)

    def release_hold(self, pages) -> None:
        with self._attachment._lock:
            super().release_hold(pages)
            self._give_back()

    def _give_back(self) -> None:
        back, self._free = self._free, []
        if back:
            self._used -= len(back)
            self._room = None  # the service may have room again
            at = self._attachment
            if not at.lost:
                base = self._base()
                at._tell(at.client.release, [base + p for p in back])

    def _not_held(self, pages: list[int], what: str) -> list[int]:
        """``pages`` (checked by the client: distinct, in the pool) are none of this engine's already; one it
        holds given again would be booked twice (a :class:`~kvtier.errors.ServiceProtocolError`: the service is lost)."""
        owned = self._owned
        again = [p for p in pages if owned[p]]
        if again:
            raise ServiceProtocolError(f"the node service's {what} gave pages this engine holds already: {again[:8]}")
        return pages

    def _book(self, pages: list[int]) -> None:
        owned = self._owned
        for p in pages:
            owned[p] = 1
        self._used += len(pages)

    def find(self, keys: list[bytes]) -> list[int | None]:
        """Each of ``keys``' page in this pool, held for this engine until :meth:`adopt` or :meth:`let_go` (None: the
        service has none, or the tier is lost): a hybrid model's objects, under their group's keys."""
        at = self._attachment
        with at._lock:
            if at.lost or not keys:
                return [None] * len(keys)
            base = self._base()
            try:
                found = at.client.find(keys, self.pool_id)
                self._not_held([p - base for p in found if p >= 0], "find")
            except ServiceError as e:
                at._lose(e)
                return [None] * len(keys)
            return [None if p < 0 else p - base for p in found]

    def let_go(self, pages: list[int]) -> None:
        """Ids a lookup or find gave that the core does not take (what it found no place for)."""
        at = self._attachment
        with at._lock:
            if pages and not at.lost:
                base = self._base()
                at._tell(at.client.release, [base + p for p in pages])

    def adopt(self, pages: list[int]) -> int:
        """Book as many of ``pages`` (a lookup's or a find's) as this engine's share has room for; the rest go back."""
        with self._attachment._lock:
            n = max(0, min(len(pages), self._attachment.share - self._used))
            self._book(pages[:n])
            self.let_go(pages[n:])
            return n

    def publish(self, keys: list[bytes], pages: list[int], owners: list[str] | None = None) -> None:
        """``pages`` hold ``keys`` now; ``owners``: each page's tenant label (:mod:`kvtier.core.tenants`), where the engine
        accounts tenants (the service bounds and counts its pages by them)."""
        at = self._attachment
        with at._lock:
            if not at.lost:
                base = self._base()
                ids = None if owners is None else [_owner_id(label) for label in owners]
                at._tell(at.client.publish, [base + p for p in pages], keys, None, ids)


class LeasedPages(_PoolLease):
    """The engine's pages of the service at ``socket_path``: ``client`` is attached already, or None (the
    service was not there at start: the tier starts lost). ``connect(previous)`` attaches anew, naming
    ``previous`` as quiesced (None: no session to name; default: the client's
    :meth:`~kvtier.service.client.ServiceClient.again`); ``heartbeat_s``: the beat's period (None: no beat)."""

    def __init__(self, client: ServiceClient | None, share: int | None, *, socket_path: str | None = None,
                 connect: Connect | None = None, heartbeat_s: float | None = None):
        if share is not None and share < 1:
            raise ConfigError(f"an engine's share of the node service's region must be at least one page; got {share}")
        if client is None and connect is None:
            raise ValueError("LeasedPages: give a client, or how to connect one")
        self.name = "node service region"
        self._attachment = self  # (the attachment every pool of the region shares: pool 0, its pages)
        self.reserve_padding_page = False
        self._held, self.parked = set(), set()
        self._free = []  # (page ids are the service's: none are free here)
        self.socket_path = client.socket_path if client is not None else socket_path
        self._connect = connect
        #: the pages this engine asked to hold at once (None: as many as the region has), and what it holds at most
        self.share_asked = share
        self.client: ServiceClient | None = None
        self._used = 0
        #: pages the service had for us when it last gave fewer than asked (None: unknown, assume enough)
        self._room: int | None = None
        #: the host pool over the region (:meth:`set_pool`): mapped anew on reattaching.
        #: None where the bytes are elsewhere: vLLM's workers map the region its scheduler names in each step's metadata
        #: (:attr:`region`), so they map the new one from the first step after reattaching
        self.pool = None
        #: times the service was lost; times attached again (a first attach after a detached start included); answers (or
        #: refusals) out of protocol among the losses and the failed attempts to attach again
        self.losses = self.reattaches = self.protocol_errors = 0
        self._backoff = AttachBackoff()
        #: attached beside the old session's pages, while the core still holds some (see the module docstring)
        self._standby: ServiceClient | None = None
        #: whether the standby's hello named the old session as quiesced (or there was none)
        self._standby_quiesces = False
        self._lock = threading.RLock()
        self._closed = False
        #: a hybrid model's object pools (:meth:`objects`), by pool; their host pools (:meth:`set_pool`'s ``objects``)
        self._objects: dict[int, ObjectLease] = {}
        self._object_pools: dict[int, tuple[Callable[[torch.Tensor, int], HostPool], HostPool]] = {}
        if client is not None:
            self._size_to(client.num_pages)
            self.client, self.lost = client, False
        else:
            self._size_to(0)
            self.lost = True
        self._heartbeat = Heartbeat(self.beat, "kvtier-service-heartbeat", heartbeat_s) if heartbeat_s else None

    def _in_use(self) -> int:
        """Pages and objects of the region this engine holds or writes now (none: the old session may be let go)."""
        return self._used + sum(o.num_used for o in self._objects.values())

    def objects(self, pool: int, name: str) -> ObjectLease:
        """The host allocator of object pool ``pool`` (a hybrid model's group ``name``: :meth:`RegionFormat.with_objects
        <kvtier.service.region.RegionFormat.with_objects>`), which leases that pool's ids through this attachment."""
        with self._lock:
            if pool not in self._objects:
                self._objects[pool] = ObjectLease(self, pool, name)
            return self._objects[pool]

    def _size_to(self, num_pages: int) -> None:
        """The books of a region of ``num_pages`` pages (only while this engine holds none of the old one's)."""
        for lease in getattr(self, "_objects", {}).values():
            lease.size_to(num_pages)
        self.num_pages = num_pages
        self._owned = bytearray(num_pages)
        self._owned_np = np.frombuffer(self._owned, dtype=np.uint8)
        share = self.share_asked
        self.share = num_pages if share is None else min(share, num_pages)
        if share is not None and 0 < num_pages < share:
            log.warning("the node service at %s holds %d pages in its region, fewer than this engine's host share of %d: it keeps at most "
                        "%d pages of prompts on host; give kvtier serve a larger --host-gb, or this engine a smaller host_gb / host_pages",
                        self.socket_path, num_pages, share, num_pages)

    # ---- the shared host index (kvtier.core.shared_host.SharedHost) ---------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        with self._lock:
            if self.lost and not self._try_reattach() or not keys:
                return []
            try:
                return self._not_held(self.client.lookup(keys), "lookup")
            except ServiceError as e:
                self._lose(e)
                return []

    def lookup_many(self, runs: list[list[bytes]]) -> list[list[int]]:
        """:meth:`lookup` of each of ``runs`` in one round trip (a scheduler step's requests,
        :meth:`ServiceClient.lookup_many`); no pages for any when the tier is lost."""
        with self._lock:
            if self.lost and not self._try_reattach() or not any(runs):
                return [[] for _ in runs]
            try:
                found = self.client.lookup_many(runs)
                self._not_held([p for pages in found for p in pages], "lookup")
                return found
            except ServiceError as e:
                self._lose(e)
                return [[] for _ in runs]

    def set_pool(self, build: Callable[[torch.Tensor, int], HostPool],
                 objects: dict[int, Callable[[torch.Tensor, int], HostPool]] | None = None) -> HostPool:
        """The host pool over the region this engine holds pages of: ``build(memory, num_pages)`` over the region
        mapped now (no memory, no pages, before the first attach); remapped (and resized) at every attach from now on.
        ``objects``: each object pool's builder, over that pool's part of the region (:meth:`object_pool` gives it)."""
        with self._lock:
            memory = self.client.map_region() if self.client is not None else torch.empty(0, dtype=torch.uint8)
            self.pool = build(self._part(memory, 0), self.num_pages)
            for pool, make in (objects or {}).items():
                self._object_pools[pool] = (make, make(self._part(memory, pool), self.num_pages))
            return self.pool

    def object_pool(self, pool: int) -> HostPool:
        """The host pool of object pool ``pool`` over the region (made by :meth:`set_pool`)."""
        return self._object_pools[pool][1]

    def _part(self, memory: torch.Tensor, pool: int) -> torch.Tensor:
        """Pool ``pool``'s bytes of the region mapped as ``memory`` (all of it for a region of one pool)."""
        if self.client is None or self.client.fmt.pools == 1 or not memory.numel():
            return memory
        start, size = self.client.fmt.part(pool, self.num_pages)
        return memory[start : start + size]

    @property
    def region(self) -> Region | None:
        """The region this engine's page ids are of (a restarted service's is another file); None before the first attach."""
        c = self.client
        return None if c is None else Region(c.region, c.fmt, c.num_pages, c.region_size)

    def attachment(self) -> tuple[Region | None, str | None]:
        """The region this engine's page ids are of and its session there (None while lost), read together."""
        with self._lock:
            return self.region, None if self.lost else self.client.session

    def close(self, *, quiesced: bool) -> None:
        """Detach (``quiesced``: no copy in flight touches this engine's pages, and none will); the heartbeat stops first."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        with self._lock:
            self._closed = True
            if self._standby is not None:
                self._standby.close()
                self._standby = None
            if self.client is not None:
                self.client.close(quiesced=quiesced)

    # ---- the service lost, and back -----------------------------------------------------------------
    def beat(self) -> None:
        """What the engine's calls would do, between them (the :class:`~kvtier.service.heartbeat.Heartbeat`'s
        beat): notice a hang-up, and attach when it is time -- the connect and hello outside the lock, so the
        engine's thread never waits on them here."""
        with self._lock:
            if self._closed:
                return
            if not self.lost:
                if self.client.hung_up():
                    self._lose(ServiceError("the node service closed the connection"))
                # (the room the service last had is a beat old: asked again, as pages other engines held may be free now --
                # an engine that holds none would otherwise never give one back, and never ask again)
                self._room = None
                for lease in self._objects.values():
                    lease.room_unknown()
                return
            if self._standby is not None and self._standby.hung_up():
                self._standby.close()
                self._standby = None
            if self._standby is not None:
                if self._in_use() == 0:
                    self._attach_again()
                return
            if not self._backoff.due():
                return
            # (while lost, the core's pages only leave: a session quiesced now stays so)
            previous = self.client.session if self.client is not None and self._in_use() == 0 else None
        client, error = self._connect_anew(previous)
        with self._lock:
            if client is None:
                self._attempt_failed(error)
            elif self._closed or not self.lost or self._standby is not None:
                client.close()  # (the engine's thread attached meanwhile)
            else:
                self._standby, self._standby_quiesces = client, previous is not None or self.client is None
                if self._in_use() == 0:
                    self._attach_again()

    def _tell(self, note, *args) -> None:
        """A note to the service (no answer); a failure loses it."""
        try:
            note(*args)
        except ServiceError as e:
            self._lose(e)

    def _lose(self, error: ServiceError) -> None:
        self.client.close(quiesced=False)  # (what this engine holds stays out of circulation while it lives)
        self.lost = True
        self.losses += 1
        self.protocol_errors += isinstance(error, ServiceProtocolError)
        self._backoff.lost()
        log.warning("the node service at %s is lost (%s): this engine goes on without it (host misses) and attaches again when it "
                    "is back", self.socket_path, error)

    def _try_reattach(self) -> bool:
        """Attach again if it is time to try and nothing of the old session is in use; True if attached."""
        if self._in_use() or self._closed or not self._backoff.due() and self._standby is None:
            return False
        return self._attach_again()

    def _connect_anew(self, previous: str | None) -> tuple[ServiceClient | None, ServiceError | None]:
        """A client attached anew (naming ``previous`` as quiesced), or the error of the attempt."""
        try:
            if self._connect is not None:
                return self._connect(previous), None
            return self.client.again(quiesced=previous is not None), None  # (``previous`` is None or the client's session)
        except ServiceError as e:
            return None, e

    def _attempt_failed(self, error: ServiceError) -> None:
        self._backoff.failed()
        self.protocol_errors += isinstance(error, ServiceProtocolError)
        log.log(logging.WARNING if isinstance(error, ServiceProtocolError) else logging.DEBUG, "the node service at %s is not back "
                "yet: %s", self.socket_path, error)

    def _attach_again(self) -> bool:
        """Attach anew (only once the core holds none of the old session's pages): the standby, if it is usable
        as it is, or a fresh client naming the old session as quiesced."""
        old, standby, self._standby = self.client, self._standby, None
        if standby is not None and (self._standby_quiesces or standby.region != old.region) and not standby.hung_up():
            client = standby  # it named the old session, or its service never knew it: nothing of it left to free
        else:
            if standby is not None:
                standby.close()  # (it holds nothing)
            client, error = self._connect_anew(None if old is None else old.session)
            if client is None:
                self._attempt_failed(error)
                return False
        try:
            if self.pool is not None:
                memory = client.map_region(pin_in_background=True)  # (on a request's path)
                fmt = client.fmt
                part = (lambda k: memory) if fmt.pools == 1 else (lambda k: memory[slice(*_span(fmt.part(k, client.num_pages)))])
                self.pool.remap(part(0), client.num_pages)
                for pool, (_make, host) in self._object_pools.items():
                    host.remap(part(pool), client.num_pages)
        except ServiceError as e:
            client.close()
            self._backoff.failed(longest=True)
            log.warning("the node service at %s is back but cannot be attached to: %s", self.socket_path, e)
            return False
        if client.num_pages != self.num_pages:
            self._size_to(client.num_pages)
        self.client, self.lost, self._room = client, False, None
        self._backoff.attached()
        self.reattaches += 1
        log.warning("attached to the node service at %s%s (region %s, %d pages)", self.socket_path, "" if old is None else " again",
                    client.region, client.num_pages)
        return True


def _span(part: tuple[int, int]) -> tuple[int, int]:
    start, size = part
    return start, start + size


class ObjectLease(_PoolLease):
    """A hybrid model's group objects on the node service: object pool ``pool`` of the region (one object per region page,
    :meth:`RegionFormat.with_objects <kvtier.service.region.RegionFormat.with_objects>`) as that group's host allocator,
    over the attachment of ``parent`` (its client, lock, and lost state: the pages and their objects are lost together).

    Its ids are the pool's own, ``0`` to ``num_pages - 1`` (the group's host pool over that part of the region); on the wire
    they are region-wide, ``pool * num_pages`` on. Its calls are :class:`_PoolLease`'s, as the pages' are. No exception
    reaches the engine: a failure loses the whole attachment (:meth:`LeasedPages._lose`)."""

    def __init__(self, parent: LeasedPages, pool: int, name: str):
        self.parent, self.pool_id = parent, pool
        self._attachment = parent
        self.name = f"node service region, KV group {name!r}"
        self.reserve_padding_page = False
        self._held, self.parked = set(), set()
        self._free = []
        self.size_to(parent.num_pages)

    def size_to(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._owned = bytearray(num_pages)
        self._owned_np = np.frombuffer(self._owned, dtype=np.uint8)
        self._used = 0
        self._room: int | None = None

    @property
    def lost(self) -> bool:
        return self.parent.lost

    def room_unknown(self) -> None:
        """Forget how much room the service last said its pool had (asked again at the next allocation)."""
        self._room = None


@functools.lru_cache(maxsize=4096)
def _owner_id(label: str) -> int:
    return owner_id(label)
