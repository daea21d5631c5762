"""An engine's host tier on the node service: the region's pages this engine holds, as its core's host allocator.

:class:`LeasedPages` is a :class:`~kvtier.alloc.PageAllocator` of the region's page ids whose pages come
from the service: ``alloc`` reserves pages to write (one round trip), ``free`` releases them (a note),
and, as the core's shared host index (:class:`~kvtier.core.shared_host.SharedHost`), ``lookup`` asks
for the pages other engines published after this engine's own prefix, ``adopt`` books them, and
``publish`` makes a finished backup visible to everyone. The bookkeeping (ownership bytes, holds for
plans that timed out) is the base class's, so the core's accounting checks hold unchanged.

``share``: how many of the region's pages this engine may hold at once (its host tier's size); the
service evicts among the pages no engine holds.
"""

from __future__ import annotations

from kvtier.alloc import Allocation, PageAllocator
from kvtier.errors import ConfigError
from kvtier.service.client import ServiceClient


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

    @property
    def capacity(self) -> int:
        return self.share

    @property
    def num_used(self) -> int:
        return self._used

    @property
    def num_free(self) -> int:
        free = self.share - self._used
        return free if self._room is None else min(free, self._room)

    def alloc(self, n: int) -> Allocation:
        """``n`` pages reserved for writing, or none: this engine's share is used up, or the service has
        fewer to give (its pages are all held); then :attr:`num_free` says how many it had."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        free_before = self.num_free
        if n > free_before:
            return Allocation([], n, free_before)
        if n == 0:
            return Allocation([], 0, free_before)
        pages = self.client.reserve(n)
        if len(pages) < n:
            if pages:
                self.client.release(pages)
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
            self.client.release(back)

    def _book(self, pages: list[int]) -> None:
        owned = self._owned
        for p in pages:
            assert not owned[p], f"the node service gave page {p} twice"
            owned[p] = 1
        self._used += len(pages)

    # ---- the shared host index (kvtier.core.shared_host.SharedHost) ---------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        return self.client.lookup(keys) if keys else []

    def adopt(self, pages: list[int]) -> int:
        n = min(len(pages), self.share - self._used)
        self._book(pages[:n])
        if n < len(pages):
            self.client.release(pages[n:])
        return n

    def publish(self, keys: list[bytes], pages: list[int]) -> None:
        self.client.publish(pages, keys)
