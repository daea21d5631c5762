"""What each plan in flight is for. A completion is dispatched on the type of its plan's tag."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.radix import PageNode


@dataclass(eq=False)
class PrefetchHandle:
    """An L3 -> host prefetch in flight (plan ``op``); resolve it with :meth:`CacheCore.resolve_prefetch`."""

    nodes: list[PageNode]
    op: int = 0
    applied: int = 0
    #: a planned copy out of these host pages that runs after the fetch (an engine-device core's load):
    #: when the fetch completes, the pages that arrived stay locked for it (``HostTier._fetched_for``)
    then: object = None

    @property
    def requested(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """What a load brings of one of a hybrid model's other groups, counted when it completes
    (:meth:`~kvtier.core.group_objects.Groups.count_loads`): ``loaded`` objects
    beside the pages it loads, ``filled`` beside device pages it does not (fills)."""

    group: str
    loaded: int
    filled: int = 0


# ---- what each plan is for: its tag, typed (completions dispatch on the type) ----
class JobTag:
    """The nodes a plan moves; the subclass says what for. Plain slotted classes, read-only by
    convention: one is made per plan, on the scheduler's hot path (a frozen dataclass's ``__init__``
    costs twice as much)."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: list[PageNode]):
        self.nodes = nodes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.nodes)} nodes)"


class Backup(JobTag):
    """device -> host copies of one path's nodes (write policies); applied by :meth:`CacheCore.poll`."""

    __slots__ = ()


class LoadBack(JobTag):
    """host -> device copies of a request's host run; applied by :meth:`CacheCore.poll`. ``fills``:
    nodes above that run whose pages are on device already, whose other groups' objects it brings;
    ``groups``: how many objects of each group it brings."""

    __slots__ = ("fills", "groups")

    def __init__(self, nodes: list[PageNode], fills: tuple[PageNode, ...] = (), groups: tuple[GroupLoad, ...] = ()):
        self.nodes = nodes
        self.fills = fills
        self.groups = groups


class EvictionBackup(JobTag):
    """device -> host copies of eviction victims, waited for where they are made (poll ignores them)."""

    __slots__ = ()


class GroupBackup(JobTag):
    """device -> host copies of a hybrid model's group objects alone, for nodes whose pages are on host
    already (pinned until it completes); applied by :meth:`CacheCore.poll`. ``moved``: per group, the
    nodes whose objects it copies (its completion decides those, and no other group's of the same nodes)."""

    __slots__ = ("moved",)

    def __init__(self, nodes: list[PageNode], moved: dict[str, list[PageNode]]):
        self.nodes = nodes
        self.moved = moved


class Save(JobTag):
    """host -> L3 writes of one path's ready host pages; applied by :meth:`CacheCore.poll`."""

    __slots__ = ()


class EvictionSave(JobTag):
    """host -> L3 writes of host eviction victims (write_back), waited for where they are made."""

    __slots__ = ()
