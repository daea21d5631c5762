"""An engine's host tier on the node service: the region's pages this engine holds, as its core's host allocator.

:class:`LeasedPages` is a :class:`~kvtier.alloc.PageAllocator` of the region's page ids whose pages come
from the service: ``alloc`` reserves pages to write (one round trip), ``free`` releases them (a note),
and, as the core's shared host index (:class:`~kvtier.core.shared_host.SharedHost`), ``lookup`` asks
for the pages other engines published after this engine's own prefix, ``adopt`` books them, and
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
no tree any more).
"""

from __future__ import annotations

import logging

from kvtier.alloc import Allocation, PageAllocator
from kvtier.errors import ConfigError, ServiceError, ServiceProtocolError
from kvtier.service.backoff import AttachBackoff
from kvtier.service.client import ServiceClient
from kvtier.service.region import Region

log = logging.getLogger(__name__)


class LeasedPages(PageAllocator):
    def __init__(self, client: ServiceClient, share: int):
        super().__init__(client.num_pages, "node service region")
        if share < 1:
            raise ConfigError(f"an engine's share of the node service's region must be at least one page; got {share}")
        self.client = client
        self.share = min(share, client.num_pages)
        self._free = []  # (page ids are the service's: none are free here)
        self._used = 0
        #: pages the service had for us when it last gave fewer than asked (None: unknown, assume enough)
        self._room: int | None = None
        #: the host pool over the region (set by :func:`~kvtier.service.attach.attach_host_pool`): mapped anew on reattaching.
        #: None where the bytes are elsewhere: vLLM's workers map the region its scheduler names in each step's metadata
        #: (:attr:`region`), so they map the new one from the first step after reattaching
        self.pool = None
        self.lost = False
        #: times the service was lost; times attached again; answers (or refusals) out of protocol among the losses and
        #: the failed attempts to attach again
        self.losses = self.reattaches = self.protocol_errors = 0
        self._backoff = AttachBackoff()

    @property
    def capacity(self) -> int:
        return self.share

    @property
    def num_used(self) -> int:
        return self._used

    @property
    def num_free(self) -> int:
        if self.lost:
            return 0
        free = self.share - self._used
        return free if self._room is None else min(free, self._room)

    def alloc(self, n: int) -> Allocation:
        """``n`` pages reserved for writing, or none: this engine's share is used up, or the service has
        fewer to give (its pages are all held), or it is lost; then :attr:`num_free` says how many it had."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if self.lost:
            self._try_reattach()
        free_before = self.num_free
        if n > free_before:
            return Allocation([], n, free_before)
        if n == 0:
            return Allocation([], 0, free_before)
        try:
            pages = self._not_held(self.client.reserve(n), "reservation")
        except ServiceError as e:
            self._lose(e)
            return Allocation([], n, 0)
        if len(pages) < n:
            if pages:
                self._tell(self.client.release, pages)
            self._room = len(pages)
            return Allocation([], n, free_before)
        self._book(pages)
        return Allocation(pages, n, free_before)

    def free(self, pages: list[int]) -> None:
        super().free(pages)  # checks them (a DoubleFreeError frees nothing); parks those a timed-out plan holds
        self._give_back()

    def release_hold(self, pages) -> None:
        super().release_hold(pages)
        self._give_back()

    def _give_back(self) -> None:
        back, self._free = self._free, []
        if back:
            self._used -= len(back)
            self._room = None  # the service may have room again
            if not self.lost:
                self._tell(self.client.release, back)

    def _not_held(self, pages: list[int], what: str) -> list[int]:
        """``pages`` (checked by the client: distinct, in the region) are none of this engine's already; a page it
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

    # ---- the shared host index (kvtier.core.shared_host.SharedHost) ---------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        if self.lost and not self._try_reattach() or not keys:
            return []
        try:
            return self._not_held(self.client.lookup(keys), "lookup")
        except ServiceError as e:
            self._lose(e)
            return []

    def adopt(self, pages: list[int]) -> int:
        n = min(len(pages), self.share - self._used)
        self._book(pages[:n])
        if n < len(pages) and not self.lost:
            self._tell(self.client.release, pages[n:])
        return n

    def publish(self, keys: list[bytes], pages: list[int]) -> None:
        if not self.lost:
            self._tell(self.client.publish, pages, keys)

    @property
    def region(self) -> Region:
        """The region this engine's page ids are of (a restarted service's is another file)."""
        c = self.client
        return Region(c.region, c.fmt, c.num_pages, c.region_size)

    def close(self, *, quiesced: bool) -> None:
        """Detach (``quiesced``: no copy in flight touches this engine's pages, and none will)."""
        self.client.close(quiesced=quiesced)

    # ---- the service lost, and back -----------------------------------------------------------------
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
                    "is back", self.client.socket_path, error)

    def _try_reattach(self) -> bool:
        """Attach again if it is time to try and nothing of the old session is in use; True if attached."""
        if self._used or not self._backoff.due():
            return False
        return self._attach_again()

    def _attach_again(self) -> bool:
        old = self.client
        try:
            client = old.again()
        except ServiceError as e:
            self._backoff.failed()
            self.protocol_errors += isinstance(e, ServiceProtocolError)
            log.log(logging.WARNING if isinstance(e, ServiceProtocolError) else logging.DEBUG, "the node service at %s is not back "
                    "yet: %s", old.socket_path, e)
            return False
        try:
            if client.num_pages != self.num_pages:
                raise ServiceError(f"its region holds {client.num_pages} pages, this engine's host pool {self.num_pages}: "
                                   "restart the engine to use it")
            if self.pool is not None:
                self.pool.remap(client.map_region(pin_in_background=True))  # (on a request's path)
        except ServiceError as e:
            client.close()
            self._backoff.failed(longest=True)
            log.warning("the node service at %s is back but cannot be attached to: %s", old.socket_path, e)
            return False
        self.client, self.lost, self._room = client, False, None
        self._backoff.attached()
        self.reattaches += 1
        log.warning("attached to the node service at %s again (region %s)", client.socket_path, client.region)
        return True
