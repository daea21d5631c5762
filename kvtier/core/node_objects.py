"""A hybrid model's objects in one tier, kept on the tree's nodes themselves.

Each non-full KV group holds, per tier, one object id per node at most (a window
page, a state snapshot). A hash table from node to id costs an entry per object:
gpt-oss-120b's window pages are one per cached page, and the table's inserts
were the largest part of its extra bookkeeping (``kvtier bench cache --model``).
So the ids live in slots of the nodes (a :class:`~kvtier.radix.PageNode`
subclass the tree makes for the model, :func:`~kvtier.radix.node_type_with`),
and :class:`NodeObjects` reads them through the mapping API the core uses:
``node in objs``, ``objs[node]``, ``pop``, ``update``, ``len``. Hot paths use
:attr:`NodeObjects.id_of` (``None``: no object) and :meth:`NodeObjects.attach_new`.

Iterating (eviction's heap rebuild, integrity checks) walks the tree's nodes: an
object hangs only on a node of the tree (its page is in that tier), and the
integrity check counts both ways (:meth:`NodeObjects.check`).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Iterator

from kvtier.radix import PageNode


class NodeObjects:
    """Node -> object id of one group in one tier, stored in the node's ``slot``."""

    __slots__ = ("slot", "id_of", "_set", "_nodes", "count")

    def __init__(self, slot: str, node_type: type[PageNode], nodes: dict):
        self.slot = slot
        #: the node's object id, None when it holds none (C-speed: an attrgetter)
        self.id_of = operator.attrgetter(slot)
        self._set = getattr(node_type, slot).__set__
        #: the tree's key -> node map (every node that can hold an object)
        self._nodes = nodes
        self.count = 0

    # ---- the mapping API ----------------------------------------------------------------
    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __contains__(self, node: PageNode | None) -> bool:
        return getattr(node, self.slot, None) is not None  # (None, a tree's miss, holds nothing)

    def __getitem__(self, node: PageNode) -> int:
        gid = self.id_of(node)
        if gid is None:
            raise KeyError(node)
        return gid

    def get(self, node: PageNode, default: int | None = None) -> int | None:
        gid = self.id_of(node)
        return default if gid is None else gid

    def __setitem__(self, node: PageNode, gid: int) -> None:
        if self.id_of(node) is None:
            self.count += 1
        self._set(node, gid)

    def update(self, pairs: Iterable[tuple[PageNode, int]]) -> None:
        for node, gid in pairs:
            self[node] = gid

    def pop(self, node: PageNode) -> int:
        gid = self.id_of(node)
        if gid is None:
            raise KeyError(node)
        self._set(node, None)
        self.count -= 1
        return gid

    def attach_new(self, nodes: list[PageNode], ids: list[int]) -> None:
        """Hang ``ids`` on ``nodes``, which hold none in this tier (just made by an insert): in C."""
        deque(map(self._set, nodes, ids), maxlen=0)
        self.count += len(nodes)

    def __iter__(self) -> Iterator[PageNode]:
        id_of = self.id_of
        return iter([node for node in self._nodes.values() if id_of(node) is not None])

    def values(self) -> list[int]:
        return [gid for gid in map(self.id_of, self._nodes.values()) if gid is not None]

    def items(self) -> list[tuple[PageNode, int]]:
        id_of = self.id_of
        return [(node, id_of(node)) for node in self._nodes.values() if id_of(node) is not None]

    def check(self, spare: Iterable[PageNode]) -> None:
        """Integrity: the count is what the tree's nodes hold, and no recycled node holds an object (a
        node that left the tree with one would hand it to the next page made from it)."""
        held = len(self.values())
        assert held == self.count, f"{self.slot}: {held} objects on the tree's nodes, {self.count} counted"
        assert all(gid is None for gid in map(self.id_of, spare)), f"{self.slot}: a recycled node still holds an object"
