"""The longest prefix a hybrid model can continue from: usable in every KV group at once.

A prefix of ``d`` whole pages is usable when (DESIGN.md, "Hybrid models: KV groups"):

* every full group has pages ``0 .. d-1`` (the caller passes ``full``: how many
  leading pages the full groups have, the tree's ordinary match);
* every sliding-window group of ``W`` tokens has the pages covering tokens
  ``[d*P - W, d*P)``: pages ``max(0, d*P - W) // P .. d-1``;
* every state group has a snapshot at boundary ``d`` (after page ``d - 1``);
  ``d = 0`` needs none (the initial state).

:func:`usable_prefix` finds the largest such ``d <= full`` and says which group
stopped it. Tensorless and tree-free: presence is asked through callables, so
the core, the planner and the tests' brute-force oracle share one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.groups import KVGroup


@dataclass(frozen=True, slots=True)
class HybridPrefix:
    """``pages``: the usable prefix. ``limited_by``: the group whose objects are missing at the
    boundary the full groups allow (``None`` when that boundary is usable: then the full
    prefix itself is the limit)."""

    pages: int
    limited_by: str | None


def window_pages(group: KVGroup, pages: int, page_size: int) -> range:
    """The pages of a ``pages``-page prefix a sliding-window group reads to continue from it."""
    return range(max(0, pages * page_size - group.window) // page_size, pages)


def _blocker(groups: Sequence[KVGroup], d: int, page_size: int, has: dict[str, Callable[[int], bool]]) -> tuple[str | None, int]:
    """Why boundary ``d`` is unusable: (the first group, in the spec's order, whose objects are
    missing there; the largest boundary below ``d`` that group does not rule out), or (None, d)."""
    for g in groups:
        present = has[g.name]
        if g.kind == "state":
            if not present(d):
                return g.name, d - 1
        else:
            for i in reversed(window_pages(g, d, page_size)):
                if not present(i):
                    # every boundary in (i, d] reads page i (window starts never move back): try i next
                    return g.name, i
    return None, d


def usable_prefix(full: int, groups: Sequence[KVGroup], page_size: int, has: dict[str, Callable[[int], bool]]) -> HybridPrefix:
    """The largest ``d <= full`` usable in every group (see the module docstring).

    ``has[name](i)``: for a sliding-window group, whether page ``i``'s object is present; for a
    state group, whether the snapshot at boundary ``i`` is. Full groups are not asked."""
    others = [g for g in groups if g.kind != "full"]
    d = full
    limited_by = None
    first = True
    while d > 0:
        blocker, below = _blocker(others, d, page_size, has)
        if blocker is None:
            break
        if first:
            limited_by = blocker
        first = False
        d = below
    return HybridPrefix(max(d, 0), limited_by)
