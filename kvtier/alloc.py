"""Page allocator: hands out whole pages of one pool and nothing else.

Free pages sit on a stack ordered so that a fresh pool allocates ascending runs
(0, 1, 2, ...): kvtier allocates the destination of its own transfers, and a
consecutive destination turns a per-page scatter into one gather per buffer.
Ownership is a bytearray (one byte per page, no per-page objects) so a double
free or a foreign page is caught in O(1) without garbage-collector load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import DoubleFreeError


@dataclass(slots=True)
class Allocation:
    """Result of :meth:`PageAllocator.alloc`: all ``requested`` pages, or none (``ok`` False).
    Read-only by convention (not ``frozen``: one is built per allocation, on the hot path)."""

    pages: list[int]
    requested: int
    free_before: int

    @property
    def ok(self) -> bool:
        return len(self.pages) == self.requested

    @property
    def shortfall(self) -> int:
        return self.requested - len(self.pages)


@dataclass
class PageAllocator:
    num_pages: int
    name: str = "pool"
    #: Page 0 reserved as the padding page (engines write padded tokens there).
    reserve_padding_page: bool = False
    _free: list[int] = field(init=False, repr=False)
    _owned: bytearray = field(init=False, repr=False)
    _owned_np: np.ndarray = field(init=False, repr=False)
    #: pages a plan that timed out may still read or write (:meth:`hold`): freed, they stay allocated
    #: ("parked") until the hold is released, so nobody else gets them meanwhile
    _held: set[int] = field(init=False, repr=False, default_factory=set)
    parked: set[int] = field(init=False, repr=False, default_factory=set)

    def __post_init__(self) -> None:
        if self.num_pages <= int(self.reserve_padding_page):
            raise ValueError(f"{self.name}: needs at least {int(self.reserve_padding_page) + 1} pages, got {self.num_pages}")
        first = 1 if self.reserve_padding_page else 0
        self._free = list(range(self.num_pages - 1, first - 1, -1))
        self._owned = bytearray(self.num_pages)
        self._owned_np = np.frombuffer(self._owned, dtype=np.uint8)
        if self.reserve_padding_page:
            self._owned[0] = 1

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_owned_np"]  # a view: made again over the unpickled bytes, never a stale copy
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._owned_np = np.frombuffer(self._owned, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        """Allocatable pages (the padding page excluded)."""
        return self.num_pages - int(self.reserve_padding_page)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> Allocation:
        """``n`` pages, or none at all when fewer than ``n`` are free (an expected outcome)."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        free_before = len(self._free)
        if n > free_before:
            return Allocation([], n, free_before)
        pages = self._free[free_before - n :][::-1]
        del self._free[free_before - n :]
        owned = self._owned
        for p in pages:  # (a plain loop beats numpy's scatter at every size a request allocates: 33 pages 7.7 us vs 10.4)
            owned[p] = 1
        return Allocation(pages, n, free_before)

    def free(self, pages: list[int]) -> None:
        """Return pages; raises DoubleFreeError (freeing nothing) if any is not allocated."""
        owned, first, n = self._owned, int(self.reserve_padding_page), self.num_pages
        for i, p in enumerate(pages):  # one pass: checks each page and clears it (a repeat finds it cleared)
            if not (first <= p < n and owned[p]):
                for q in pages[:i]:  # undo: nothing is freed
                    owned[q] = 1
                if p in pages[:i]:
                    raise DoubleFreeError(f"{self.name}: the same page appears twice in one free call; nothing was freed")
                raise DoubleFreeError(
                    f"{self.name}: page {p} is not allocated (freed twice, never allocated, or the padding page); nothing was freed"
                )
            owned[p] = 0
        if self._held:
            parked = [p for p in pages if p in self._held]
            if parked:
                for p in parked:
                    owned[p] = 1
                self.parked.update(parked)
                pages = [p for p in pages if p not in self._held]
        self._free.extend(reversed(pages))

    def take(self, pages: list[int]) -> None:
        """Allocate these particular pages, each free now (a region adopted as a killed service left it);
        raises DoubleFreeError (taking nothing) if one is not free or appears twice."""
        want, first = set(pages), int(self.reserve_padding_page)
        if len(want) != len(pages) or any(not (first <= p < self.num_pages) or self._owned[p] for p in want):
            raise DoubleFreeError(f"{self.name}: cannot take pages that are not free (or are listed twice); nothing was taken")
        self._free = [p for p in self._free if p not in want]
        for p in want:
            self._owned[p] = 1

    def hold(self, pages) -> None:
        """Keep ``pages`` (allocated now) from being handed out again after they are freed, until
        :meth:`release_hold`: a plan that timed out may still touch them."""
        self._held.update(pages)

    def release_hold(self, pages) -> None:
        """End the hold on ``pages``; those freed meanwhile go back to the free list now."""
        back = []
        for p in pages:
            self._held.discard(p)
            if p in self.parked:
                self.parked.discard(p)
                self._owned[p] = 0
                back.append(p)
        self._free.extend(reversed(back))

    def is_allocated(self, page: int) -> bool:
        return bool(self._owned[page])

    def allocated_view(self):
        """A live numpy ``uint8`` view of the ownership bytes (1 = allocated), for vectorized checks."""
        return self._owned_np

    def allocated_pages(self) -> set[int]:
        first = 1 if self.reserve_padding_page else 0
        return {p for p in range(first, self.num_pages) if self._owned[p]}
