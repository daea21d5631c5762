"""Kinds of KV group, each a class that carries its own rules; the longest prefix every group can use.

A hybrid model's groups differ in kind (DESIGN.md, "Hybrid models: KV groups"). The core never
branches on a kind: it asks the group's :class:`GroupKind`, which owns

* **what a boundary reads** (:meth:`GroupKind.places`), named by *place*: the index of the page an
  object hangs on. A sliding-window group reads the pages covering a boundary's last ``W`` tokens; a
  state group reads one snapshot, the one at the boundary, which hangs on the page that ends there;
* **what blocks a boundary** (:meth:`GroupKind.next_boundary`): when an object it reads is missing,
  the largest boundary below that does not read it;
* **where an engine hands objects over** (:meth:`GroupKind.handed_places`): every page it computed,
  or the boundaries the cache keeps snapshots at;
* **how its objects rank for eviction** (:meth:`GroupKind.kept_last`): a branch's last snapshot goes
  after every other.

A prefix of ``d`` whole pages is usable when every group has the objects boundary ``d`` reads (the
full-attention group: pages ``0 .. d-1``, which the tree answers). :func:`usable_prefix` finds the
largest such ``d`` and says which group stopped it; tensorless and tree-free (presence is asked
through callables, by place), so the core, the planner and the tests' brute-force oracle share one
definition. A kind of one's own is a :class:`GroupKind` subclass passed to :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.groups import GROUP_KINDS, KVGroup, window_pages


class GroupKind:
    """The rules of one kind of KV group (see the module docstring); one instance per group of a model.
    Subclasses set ``name`` (the :attr:`KVGroup.kind` they serve) and ``keeps`` (what one object is:
    ``"attention"``, a page of the group's attention buffers, or ``"state"``, a snapshot)."""

    name: ClassVar[str] = ""
    keeps: ClassVar[str] = "attention"

    __slots__ = ("group", "page_size")

    def __init__(self, group: KVGroup, page_size: int):
        self.group = group
        self.page_size = page_size

    def places(self, pages: int) -> range:
        """The places of the objects a prefix of ``pages`` pages reads to continue from it: a run that
        ends with the prefix (empty for ``pages == 0``: the start needs nothing)."""
        raise NotImplementedError

    def next_boundary(self, d: int, missing: int) -> int:
        """The largest boundary below ``d`` that place ``missing`` (read by ``d``, absent) does not rule out.
        The default, ``missing``, holds for every kind whose run of places never starts earlier at a
        later boundary: each boundary in ``(missing, d]`` reads ``missing`` too."""
        return missing

    def handed_places(self, first: int, pages: int, state_every: int, *, at_end: bool = True) -> Sequence[int]:
        """The places of the objects an engine that computed pages ``first .. pages - 1`` hands over:
        one per page it computed (the default)."""
        return range(first, pages)

    def kept_last(self, has_children: bool) -> bool:
        """Whether an object on a node (``has_children``: the prefix goes on below it) is evicted only after
        every other object of its pool. None is, by default."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.group.name!r})"


class FullKind(GroupKind):
    """Full attention (MHA/GQA, MLA, MLA+DSA): a boundary reads every page before it (the tree's own pages)."""

    name = "full"
    __slots__ = ()

    def places(self, pages: int) -> range:
        return range(pages)


class WindowKind(GroupKind):
    """Sliding-window attention over ``group.window`` tokens: a boundary reads the pages covering its last
    ``window`` tokens; pages before them may go."""

    name = "sliding_window"
    __slots__ = ("window", "places")

    def __init__(self, group: KVGroup, page_size: int):
        super().__init__(group, page_size)
        self.window = group.window
        #: what a boundary reads: :func:`~kvtier.groups.window_pages`, bound to this group (one call per ask)
        self.places = partial(window_pages, group.window, page_size=page_size)


class StateKind(GroupKind):
    """A recurrent state (Mamba, linear attention): a boundary reads the snapshot taken there, which hangs
    on the page that ends at it (place ``d - 1``). Snapshots are kept every ``state_every`` pages and at
    a prompt's last full page; the last one a cached prefix ends on goes after every other."""

    name = "state"
    keeps = "state"
    __slots__ = ()

    def places(self, pages: int) -> range:
        return range(pages - 1, pages) if pages else range(0)

    def handed_places(self, first: int, pages: int, state_every: int, *, at_end: bool = True) -> Sequence[int]:
        return [b - 1 for b in snapshot_boundaries(first, pages, state_every, at_end=at_end)]

    def kept_last(self, has_children: bool) -> bool:
        return not has_children


def snapshot_boundaries(first: int, pages: int, every: int, *, at_end: bool = True) -> list[int]:
    """Boundaries in ``(first, pages]`` a state is kept at: every ``every`` pages, and (``at_end``) the last."""
    out = list(range((first // every + 1) * every, pages + 1, every))
    if at_end and pages > first and (not out or out[-1] != pages):
        out.append(pages)
    return out


#: kind name -> its rules (extended by :func:`register`)
KINDS: dict[str, type[GroupKind]] = {k.name: k for k in (FullKind, WindowKind, StateKind)}


def register(kind: type[GroupKind]) -> type[GroupKind]:
    """Serve groups of a kind of one's own (``KVGroup(kind=kind.name)``): its rules are the class's. Usable
    as a class decorator. A name that is taken is a :class:`ConfigError`."""
    if not (isinstance(kind, type) and issubclass(kind, GroupKind)) or not kind.name or kind.keeps not in ("attention", "state"):
        raise ConfigError(f"register: {kind!r} is not a GroupKind subclass with a name and keeps 'attention' or 'state'")
    if kind.name in KINDS and KINDS[kind.name] is not kind:
        raise ConfigError(f"register: KV group kind {kind.name!r} is served already (by {KINDS[kind.name].__name__})")
    KINDS[kind.name] = kind
    GROUP_KINDS[kind.name] = kind.keeps
    return kind


def kind_of(group: KVGroup, page_size: int) -> GroupKind:
    """The rules of ``group``, for pages of ``page_size`` tokens."""
    return KINDS[group.kind](group, page_size)


def _last_missing(places: range, present: Callable[[int], bool]) -> int | None:
    for p in reversed(places):
        if not present(p):
            return p
    return None


@dataclass(frozen=True, slots=True)
class HybridPrefix:
    """``pages``: the usable prefix. ``limited_by``: the group whose objects are missing at the
    boundary the full groups allow (``None`` when that boundary is usable: then the full
    prefix itself is the limit)."""

    pages: int
    limited_by: str | None


def usable_prefix(full: int, kinds: Sequence[GroupKind], has: dict[str, Callable[[int], bool]]) -> HybridPrefix:
    """The largest ``d <= full`` usable in every group of ``kinds`` (the groups beside full attention;
    the full groups' ``full`` pages are the caller's). ``has[name](place)``: whether that group's
    object at ``place`` is present."""
    d = full
    limited_by = None
    while d > 0:
        for kind in kinds:
            present = has[kind.group.name]
            missing = _last_missing(kind.places(d), present)
            if missing is not None:
                if limited_by is None and d == full:
                    limited_by = kind.group.name
                below = kind.next_boundary(d, missing)
                assert below < d, f"{kind!r}.next_boundary({d}, {missing}) = {below}: it must rule boundary {d} out"
                d = below
                break
        else:
            break
    return HybridPrefix(max(d, 0), limited_by)
