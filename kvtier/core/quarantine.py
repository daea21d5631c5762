"""A host->device load that failed: its device copies are garbage, and nobody may read them again.

When a load back completes as anything but :class:`~kvtier.core.plans.Done`,
the device pages it was filling hold whatever was there before. The core takes
them off the tree at once (with every device page below them: residency is
prefix-closed, and a page computed over garbage is garbage too), so no later
match offers them. The page ids cannot be freed yet: requests that began before
the failure may still name them among their cached pages, and a page handed out
again would be written under their feet. So they wait here::

    load fails --> cleared from the tree, held in quarantine (allocated, owned by nobody)
               --> freed once every request begun before the failure has committed or aborted,
                   and every plan submitted before it has finished

A :class:`~kvtier.core.request.CacheRequest` learns of the failure on ``wait()`` and
``commit()`` (the :attr:`Quarantine.generation` moved): its cached prefix shrinks
to the last good page, the caller recomputes the rest into pages it allocates, and
a commit that still names a quarantined page is a :class:`~kvtier.errors.PageOwnershipError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from kvtier.alloc import PageAllocator


class Quarantine:
    """Failed loads' device pages (and other groups' objects: ``free_objects(ids per group)`` frees
    those), with the open requests that may still name them; ``oldest_op()``: the oldest plan the
    core has in flight (None: none). Part of :class:`~kvtier.core.cache_core.CacheCore` alone."""

    __slots__ = ("device", "free_objects", "oldest_op", "generation", "marks", "_open", "_serials", "entries")

    def __init__(self, device: PageAllocator, free_objects: Callable[[dict[str, list[int]]], None],
                 oldest_op: Callable[[], int | None]):
        self.device = device
        self.free_objects = free_objects
        self.oldest_op = oldest_op
        #: bumped on every failed load: a request re-checks its prefix only when this moved
        self.generation = 0
        #: device page -> 1 while quarantined (insert's ownership check reads it, vectorized)
        self.marks = np.zeros(device.num_pages, dtype=np.uint8)
        #: requests open now, by serial, in the order they began (the first is the oldest)
        self._open: dict[int, None] = {}
        self._serials = itertools.count(1)
        #: (pages, a serial drawn at the failure -- every request begun before it has a smaller one --,
        #: the last plan submitted before it -- one of those may still read or write the pages --,
        #: objects per group); changed in place only (the core reads it by reference)
        self.entries: list[tuple[list[int], int, int, dict[str, list[int]]]] = []

    def request_opened(self) -> int:
        serial = next(self._serials)
        self._open[serial] = None
        return serial

    def request_finished(self, serial: int) -> None:
        self._open.pop(serial, None)
        if self.entries:
            self.release()

    def add(self, pages: list[int], objects: dict[str, list[int]], last_op: int) -> None:
        """A failed load's device ``pages`` and other groups' object ids: nobody is offered them again
        (requests learn of it by the generation), freed once nobody can name them."""
        self.generation += 1
        self.entries.append((pages, next(self._serials), last_op, objects))
        self.marks[pages] = 1
        self.release()

    def release(self) -> None:
        """Free what nobody can name any more: every request begun before its failure has finished, and
        so has every plan submitted before it."""
        oldest_request = next(iter(self._open), None)
        oldest_op = self.oldest_op()
        keep = []
        for entry in self.entries:
            pages, fence, last_op, objects = entry
            if (oldest_request is None or oldest_request > fence) and (oldest_op is None or oldest_op > last_op):
                self.marks[pages] = 0
                self.device.free(pages)
                if objects:
                    self.free_objects(objects)
            else:
                keep.append(entry)
        self.entries[:] = keep

    def pages(self) -> set[int]:
        return {p for pages, _, _, _ in self.entries for p in pages}

    def objects(self) -> dict[str, set[int]]:
        """Device ids of other KV groups' objects a failed load left, per group (freed with its pages)."""
        out: dict[str, set[int]] = {}
        for _, _, _, objects in self.entries:
            for name, ids in objects.items():
                out.setdefault(name, set()).update(ids)
        return out
