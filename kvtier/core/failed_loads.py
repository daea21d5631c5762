"""A host->device load that failed: its device copies are garbage, and nobody may read them again.

When a load back completes as anything but :class:`~kvtier.core.plans.Done`,
the device pages it was filling hold whatever was there before. They leave the
tree at once (with every device page below them: residency is prefix-closed,
and a page computed over garbage is garbage too), so no later match offers them.
The page ids cannot be freed yet: requests that began before the failure may
still name them among their cached pages, and a page handed out again would
be written under their feet. So they wait in a quarantine::

    load fails --> cleared from the tree, held in quarantine (allocated, owned by nobody)
               --> freed once every request begun before the failure has committed or aborted

A :class:`~kvtier.core.request.CacheRequest` learns of the failure on ``wait()`` and
``commit()``: its cached prefix shrinks to the last good page (``failed`` says how
many it lost), the caller recomputes the rest into pages it allocates, and a
commit that still names a quarantined page is a :class:`~kvtier.errors.PageOwnershipError`.
"""

from __future__ import annotations

import numpy as np

from kvtier.core.plans import Tier
from kvtier.radix import NO_PAGE, PageNode


class FailedLoads:
    """Quarantine of failed loads' device pages, part of :class:`~kvtier.core.cache_core.CacheCore`."""

    def _init_failed_loads(self) -> None:
        #: bumped on every failed load: a request re-checks its prefix only when this moved
        self.load_failure_gen = 0
        #: requests open now, by serial, in the order they began (the first is the oldest)
        self._open_requests: dict[int, None] = {}
        self._request_serial = 0
        #: quarantined device pages: (pages, serial of the last request begun before the failure,
        #: the last plan submitted before it: one of those may still read or write the pages)
        self._quarantine: list[tuple[list[int], int, int]] = []
        #: device page -> 1 while quarantined (insert's ownership check reads it, vectorized)
        self._quarantined = np.zeros(self.dev_alloc.num_pages, dtype=np.uint8)

    def _request_opened(self) -> int:
        self._request_serial += 1
        self._open_requests[self._request_serial] = None
        return self._request_serial

    def _completions_applied(self) -> None:
        if self._quarantine:
            self._release_quarantine()

    def request_finished(self, serial: int) -> None:
        self._open_requests.pop(serial, None)
        if self._quarantine:
            self._release_quarantine()

    def _drop_failed_load(self, nodes: list[PageNode]) -> int:
        """Take the failed load's device copies (and every device page below them) off the tree
        into quarantine. Returns how many pages were quarantined."""
        tree = self.tree
        bad = [n for n in nodes if n.device_page != NO_PAGE]
        if not bad:
            return 0
        below_outside = bad[-1].device_children or any(n.device_children > 1 for n in bad[:-1])
        victims = tree.device_subtree(bad[:1]) if below_outside else bad[::-1]
        for n in victims:
            self._loading.pop(n, None)  # a load of a page below is moot: its page is quarantined too
        groups = self._groups_quarantined(victims) if self.components else {}
        pages = tree.clear_devices(victims)
        self._quarantine_failed(pages, groups)
        return len(pages)

    def _drop_failed_objects(self, nodes: list[PageNode]) -> None:
        """A failed load brought other groups' objects beside device pages it did not load (fills): the
        objects leave the tree into quarantine, the pages stay (their bytes were never touched)."""
        groups = self._groups_quarantined(nodes)
        if groups:
            self._quarantine_failed([], groups)

    def _quarantine_failed(self, pages: list[int], groups: dict[str, list[int]]) -> None:
        """A failed load's device ``pages`` and other groups' object ids: nobody is offered them again
        (requests learn of the failure by its generation), freed once nobody can name them."""
        self.load_failure_gen += 1
        self._quarantine.append((pages, self._request_serial, self._last_op, groups))
        self._quarantined[pages] = 1
        self._release_quarantine()

    def _release_quarantine(self) -> None:
        """Free the quarantined pages nobody can name any more: every request begun before their
        failure has finished, and so has every plan submitted before it."""
        oldest_request = next(iter(self._open_requests), None)
        oldest_op = next(iter(self._inflight), None)
        keep = []
        for entry in self._quarantine:
            pages, last_request, last_op, groups = entry
            if (oldest_request is None or oldest_request > last_request) and (oldest_op is None or oldest_op > last_op):
                self._quarantined[pages] = 0
                self.dev_alloc.free(pages)
                if groups:
                    self._free_group_ids(Tier.DEVICE, groups)
            else:
                keep.append(entry)
        self._quarantine = keep

    def quarantined_pages(self) -> set[int]:
        return {p for pages, _, _, _ in self._quarantine for p in pages}

    def quarantined_group_pages(self) -> dict[str, set[int]]:
        """Device ids of other KV groups' objects a failed load left, per group (freed with its pages)."""
        out: dict[str, set[int]] = {}
        for _, _, _, groups in self._quarantine:
            for name, ids in groups.items():
                out.setdefault(name, set()).update(ids)
        return out
