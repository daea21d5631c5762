"""The hybrid rules spelled out once for the tests, independently of kvtier's kinds (the oracle a
test checks the core against):

* a sliding-window group of ``W`` tokens: a prefix of ``d`` pages reads the pages covering tokens
  ``[d*P - W, d*P)``;
* a state group: a prefix of ``d`` pages reads the snapshot at boundary ``d``, which hangs on page
  ``d - 1`` (none for ``d == 0``); the engine keeps one every ``every`` pages and at the last page."""

from __future__ import annotations


def window_pages(window: int, pages: int, page_size: int) -> range:
    return range(max(0, pages * page_size - window) // page_size, pages)


def read_places(group, pages: int, page_size: int) -> list[int]:
    """The places (pages) of ``group``'s objects a prefix of ``pages`` pages reads."""
    if group.kind == "state":
        return [pages - 1] if pages else []
    return list(window_pages(group.window, pages, page_size))


def snapshot_places(first: int, pages: int, every: int) -> list[int]:
    """Where a request computing pages ``first .. pages - 1`` keeps its snapshots: the pages ending at each
    ``every``-th boundary and at its last page."""
    bounds = [b for b in range(first + 1, pages + 1) if b % every == 0 or b == pages]
    return [b - 1 for b in bounds]
