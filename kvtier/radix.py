"""Prefix index over page keys: a radix tree with page-granular edges.

Because page keys are chained hashes, a key names its whole prefix, so the tree
is stored as a hash map ``key -> PageNode`` plus parent pointers; a child is
found by its key alone, and no per-node children dict is needed (that keeps a
cached page's bookkeeping small and lookups O(1)).

Each node records where its page lives::

                 insert                 backup done              device evict
      (absent) ---------> DEVICE ------------------> DEVICE+HOST -------------> HOST
                            |  \\__ backup in flight: host_page set,            |
                            |      host_ready False, node locked               |  load_back
                            |                                                  v
                            |  drop (no host copy, leaf)        DEVICE+HOST <--
                            v                                        (host evict when no device
                        (removed)                                     copy and a leaf: removed)

Invariants (checked by :meth:`PrefixTree.check`):

* the node set is prefix-closed: a node's parent is in the tree (or is the root);
* device residency is prefix-closed: a node on device has its parent on device;
* every node holds a device page, a host page, or both;
* ``lock_ref`` of a node counts the locks that cover it. A lock on a node covers
  it and the pages above it up to the first one on device (its *anchor*), so it
  costs the length of the path's off-device tail, not its depth. The device pages
  above the anchor need no count: eviction takes leaves only, a locked page is
  never taken, so its ancestors never become leaves (in either tier). A locked
  path is therefore never evicted;
* every leaf of a tier has an entry with its current stamp in that tier's heap.

Why lookups and touches cost O(log n), not O(n), per request: prefix closure
makes "key ``i`` is cached" monotone along a request's keys, so the longest
cached prefix (and its device-resident part) is a binary search. Recency is
kept lazily: a use stamps only the deepest node of the path (and the deepest
device-resident one). A node's true last use is the newest stamp in its
subtree; since eviction takes leaves only, each leaving node hands its stamp to
its parent (``max``), and a parent is always exactly as recent as it must be by
the time it becomes a leaf. Per tier, a heap of ``(stamp, seq, node)`` over
leaves gives LRU victims; stale entries (node touched, no longer a leaf, or
gone) are dropped when popped and the heap is rebuilt when it outgrows the tree.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from operator import attrgetter
from collections.abc import Callable, Iterator, Sequence

from kvtier.errors import InvalidStateError
from kvtier.hashing import PageHash

#: ``PageNode.device_page`` / ``host_page`` when the page has no copy in that tier.
NO_PAGE = -1
NOT_STORED, SAVING, STORED = 0, 1, 2

_HOST_READY = 1  # flags bit 0; bits 1-2 hold the L3 state (the tree's own loops test the bit directly)


#: a node's device / host page (C-level getters for the per-page lists the core builds: plans, matches)
device_page_of = attrgetter("device_page")
host_page_of = attrgetter("host_page")


def leading_present(present, keys: Sequence, hi: int | None = None, lo: int = 0) -> int:
    """How many of ``keys[:hi]`` lead in ``present`` (anything with ``in``), by binary search;
    ``lo``: the first ``lo`` are known to be present.

    Only valid where presence is prefix-closed: key ``i`` present implies every key before it is."""
    hi = len(keys) if hi is None else hi
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if keys[mid - 1] in present:
            lo = mid
        else:
            hi = mid - 1
    return lo


#: a stamp no node reaches (an eviction walk with no ``older_than`` bound)
_NEVER = sys.maxsize


class PageNode:
    """One cached page. ``__slots__`` and few of them: hundreds of thousands exist at once."""

    __slots__ = (
        "key",
        "parent",
        "num_children",
        "device_children",
        "device_page",
        "host_page",
        "lock_ref",
        "hit_count",
        "last_access",
        "flags",
        "owner",
    )

    #: slots a subclass adds (:func:`node_type_with`), None in every node the tree makes
    object_slots: tuple[str, ...] = ()

    def __init__(self, key: PageHash, parent: PageNode | None, stamp: int, device_page: int = NO_PAGE, children: int = 0):
        for name in self.object_slots:
            setattr(self, name, None)
        self.reset(key, parent, stamp, device_page, children)

    def reset(self, key: PageHash, parent: PageNode | None, stamp: int, device_page: int = NO_PAGE, children: int = 0) -> None:
        self.key = key
        self.parent = parent
        self.num_children = children
        self.device_children = children if device_page != NO_PAGE else 0
        self.device_page = device_page
        self.host_page = NO_PAGE
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access = stamp
        self.flags = 0
        self.owner = 0

    @property
    def host_ready(self) -> bool:
        """The host copy is complete and readable (False while its backup or prefetch is in flight)."""
        return bool(self.flags & _HOST_READY)

    @host_ready.setter
    def host_ready(self, ready: bool) -> None:
        self.flags = (self.flags | _HOST_READY) if ready else (self.flags & ~_HOST_READY)

    @property
    def stored(self) -> int:
        """L3 state: NOT_STORED, SAVING or STORED (set per run: :meth:`PrefixTree.set_stored`)."""
        return self.flags >> 1

    @property
    def on_device(self) -> bool:
        return self.device_page != NO_PAGE

    @property
    def on_host(self) -> bool:
        return self.host_page != NO_PAGE

    def path_to_root(self) -> Iterator[PageNode]:
        node: PageNode | None = self
        while node is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:
        ready = "" if self.host_ready else "*"
        return f"PageNode(dev={self.device_page}, host={self.host_page}{ready}, lock={self.lock_ref}, t={self.last_access})"


_NODE_TYPES: dict[tuple[str, ...], type[PageNode]] = {}


class HybridNode(PageNode):
    """A hybrid model's node: ``window_used`` -- when its window pages were last written or read, for
    window pages sharing the full pages' pool (:mod:`kvtier.core.group_objects`); set with the node's
    page, and whenever one is attached later, so a reused node's old value is never read."""

    __slots__ = ("window_used",)

    def reset(self, key: PageHash, parent: PageNode | None, stamp: int, device_page: int = NO_PAGE, children: int = 0) -> None:
        PageNode.reset(self, key, parent, stamp, device_page, children)
        self.window_used = stamp


def node_type_with(slots: tuple[str, ...]) -> type[PageNode]:
    """A :class:`HybridNode` with ``slots`` more, each None in a node the tree makes: where a hybrid
    model's other KV groups keep their object ids (:mod:`kvtier.core.node_objects`). One class per
    set of names; a full-attention tree keeps plain nodes and pays nothing for them (no slot, no stamp)."""
    cls = _NODE_TYPES.get(slots)
    if cls is None:
        cls = _NODE_TYPES[slots] = type(f"PageNode_{len(slots)}", (HybridNode,), {"__slots__": slots, "object_slots": slots})
    return cls


def _device_leaf(n: PageNode) -> bool:
    return n.device_page != NO_PAGE and n.device_children == 0


def _host_leaf(n: PageNode) -> bool:
    return n.host_page != NO_PAGE and n.num_children == 0


def _device_evictable(n: PageNode) -> bool:
    """A device leaf eviction may take (:meth:`PrefixTree.device_victims`)."""
    return not n.lock_ref


def _host_evictable(n: PageNode) -> bool:
    """A host leaf eviction may take: unlocked, readable, no device copy, not being saved to L3."""
    return not n.lock_ref and n.device_page == NO_PAGE and n.flags & _HOST_READY and n.flags >> 1 != SAVING


class _LeafHeap:
    """Lazy min-heap of one tier's leaves by stamp (see the module docstring)."""

    __slots__ = ("entries", "is_leaf", "in_tier", "seq")

    def __init__(self, is_leaf: Callable[[PageNode], bool], in_tier: Callable[[PageNode], bool], seq: itertools.count):
        self.entries: list[tuple[int, int, PageNode]] = []
        self.is_leaf = is_leaf
        self.in_tier = in_tier
        self.seq = seq

    def push(self, node: PageNode) -> None:
        heapq.heappush(self.entries, (node.last_access, next(self.seq), node))

    def valid(self, entry: tuple[int, int, PageNode]) -> bool:
        stamp, _, node = entry
        return stamp == node.last_access and self.is_leaf(node)

    def rebuild(self, nodes) -> None:
        seq = self.seq
        self.entries = [(n.last_access, next(seq), n) for n in nodes if self.is_leaf(n)]
        heapq.heapify(self.entries)


def _all_children_taken(parent: PageNode, children: int, taken: dict[PageNode, int]) -> bool:
    """One more of ``parent``'s ``children`` (in the tier being walked) was chosen: are they all?"""
    if children == 1:  # a chain: no count to keep
        return True
    t = taken.get(parent, 0) + 1
    taken[parent] = t
    return t == children


def _next_or_queued(parent: PageNode, stamp: int, entries: list, virtual: list, seq: itertools.count) -> tuple[PageNode | None, int]:
    """A parent whose children were all chosen is a leaf if they leave, as recent as the newest of them.
    Older than every queued leaf, it is the walk's next candidate (returned: chains skip the heap);
    else it is queued. Returns (next candidate or None, its stamp)."""
    if parent.last_access > stamp:
        stamp = parent.last_access
    if (not entries or stamp < entries[0][0]) and (not virtual or stamp < virtual[0][0]):
        return parent, stamp
    heapq.heappush(virtual, (stamp, next(seq), parent))
    return None, stamp


class PrefixTree:
    """Space-free bookkeeping: which page keys exist and where their bytes are. Touches no bytes."""

    def __init__(self, reserve: int = 0, device_pages: int = 0) -> None:
        self.nodes: dict[PageHash, PageNode] = {}
        #: one byte per device page, 1 while a node holds it: lets ``insert`` refuse a caller's
        #: page that the tree owns in O(1) (sized by ``device_pages``; empty: not tracked)
        self.device_owned = bytearray(device_pages)
        #: every node holding a host page: what hangs below a device leaf is among them
        self.hosted: set[PageNode] = set()
        #: recycled and preallocated nodes (see :meth:`reserve`)
        self._spare: list[PageNode] = []
        #: the class of the nodes it makes (:meth:`use_node_type`)
        self.node_type: type[PageNode] = PageNode
        #: whether its nodes keep a window recency (:class:`HybridNode`)
        self._windows = False
        self.reserve(reserve)
        seq = itertools.count()
        #: per locked node, the anchor of each lock on it (where its walk stopped), for :meth:`unlock`
        self._anchors: dict[PageNode, list[PageNode | None]] = {}
        self.device_heap = _LeafHeap(_device_leaf, PageNode.on_device.fget, seq)
        self.host_heap = _LeafHeap(_host_leaf, PageNode.on_host.fget, seq)
        self._clock = 0
        #: whose pages the nodes made now are (a tenant's id, :mod:`kvtier.core.tenants`; 0: the namespace's own)
        self.current_owner = 0
        #: keys whose nodes are always one owner's, whoever makes them (a declared shared prefix's pages)
        self.fixed_owners: dict[PageHash, int] = {}
        #: host pages held per owner id, kept while tenants are accounted (None: not counted)
        self.host_by_owner: list[int] | None = None

    def __len__(self) -> int:
        return len(self.nodes)

    def reserve(self, n: int) -> None:
        """Preallocate nodes so that up to ``n`` cached pages need no new Python objects.

        Why: nodes are long-lived, GC-tracked objects; creating them while
        serving makes CPython's full collections scan the whole tree again and
        again (~35% of bookkeeping time on the Mooncake replay). Nodes made up
        front, and recycled when pages leave the tree, keep the collector idle
        in steady state -- the same reason vLLM builds its block objects at startup.
        """
        spare = self._spare
        missing = n - len(self.nodes) - len(spare)
        if missing > 0:
            spare.extend(self._blank_nodes(missing))

    def _blank_nodes(self, n: int) -> list[PageNode]:
        """``n`` new nodes, fields unset but the node type's object slots (None)."""
        cls = self.node_type
        new = cls.__new__
        nodes = [new(cls) for _ in range(n)]
        for name in cls.object_slots:
            setter = getattr(cls, name).__set__
            for node in nodes:
                setter(node, None)
        return nodes

    def use_node_type(self, cls: type[PageNode]) -> None:
        """Make every node of ``cls`` from now on (a hybrid model's, :func:`node_type_with`); the tree is
        empty yet, and its preallocated nodes are made again of that class."""
        assert not self.nodes and issubclass(cls, PageNode), "the node type is chosen before the first page"
        self.node_type = cls
        self._windows = issubclass(cls, HybridNode)
        n = len(self._spare)
        self._spare = []
        self._spare.extend(self._blank_nodes(n))

    def spare_nodes(self) -> list[PageNode]:
        """The recycled and preallocated nodes (integrity checks: none may hold anything)."""
        return self._spare

    def _node(self, key: PageHash, parent: PageNode | None, stamp: int, device_page: int = NO_PAGE, children: int = 0) -> PageNode:
        if self._spare:
            node = self._spare.pop()
            node.reset(key, parent, stamp, device_page, children)
        else:
            node = self.node_type(key, parent, stamp, device_page, children)
        node.owner = self.fixed_owners.get(key, self.current_owner) if self.fixed_owners else self.current_owner
        return node

    def count_host(self, nodes, sign: int = 1) -> None:
        """Host pages per owner: ``nodes`` gained (``sign`` 1) or lost (-1) their host pages (while counted)."""
        counts = self.host_by_owner
        if counts is not None:
            for node in nodes:
                counts[node.owner] += sign

    @property
    def now(self) -> int:
        """The clock's current stamp (what a page used now gets)."""
        return self._clock

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup ----------------------------------------------------------------
    def walk(self, keys: Sequence[PageHash], start: int = 0) -> list[PageNode]:
        """Nodes of the longest cached prefix of ``keys``, from ``keys[start]`` on (the first ``start``
        are known to be cached: a locked prefix).

        The deepest is found by binary search; the others are its ancestors, read up the parent
        pointers. A key lookup per page would hash each new key and compare it with the stored
        one, in a map far larger than the CPU's caches: 1.6x the tree time of ``bench cache``."""
        end = leading_present(self.nodes, keys, lo=start)
        if end <= start:
            return []
        node = self.nodes[keys[end - 1]]
        path = [node] * (end - start)
        for i in range(end - start - 2, -1, -1):
            node = node.parent
            path[i] = node
        return path

    @staticmethod
    def device_prefix(path: Sequence[PageNode]) -> int:
        """How many leading nodes of a root-anchored ``path`` are on device (binary search)."""
        lo, hi = 0, len(path)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if path[mid - 1].device_page != NO_PAGE:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def touch(self, path: Sequence[PageNode]) -> None:
        """Mark a root-anchored path as used now: O(log n), see the module docstring."""
        if not path:
            return
        now = self.tick()
        if not now & 1023:
            self._maybe_compact()
        self._stamp(path[-1], now)
        if path[-1].device_page == NO_PAGE:
            n_dev = self.device_prefix(path)
            if n_dev:
                self._stamp(path[n_dev - 1], now)

    def _stamp(self, node: PageNode, now: int) -> None:
        node.last_access = now
        if node.device_page != NO_PAGE and node.device_children == 0:
            self.device_heap.push(node)
        if node.host_page != NO_PAGE and node.num_children == 0:
            self.host_heap.push(node)

    def _child_left(self, parent: PageNode, child: PageNode) -> None:
        """``child`` left a tier (or the tree): hand its recency to ``parent`` and re-index the parent.

        Called after the parent's child counts are updated. A parent whose stamp
        changed needs a fresh heap entry in every tier it is a leaf of (its old
        entries are stale now), and one that just became a leaf needs its first."""
        if child.last_access > parent.last_access:
            parent.last_access = child.last_access
        self._stamp(parent, parent.last_access)

    # ---- structure ---------------------------------------------------------------
    def add_device_chain(self, keys: Sequence[PageHash], pages: Sequence[int], parent: PageNode | None) -> list[PageNode]:
        """New nodes for ``keys`` (none cached yet), each a child of the previous, on device ``pages``.

        The hot path of every insert: nodes come from the spare list in one slice and are
        initialised inline (the fields :meth:`PageNode.reset` sets), with no call per page."""
        assert parent is None or parent.device_page != NO_PAGE, parent
        n = len(keys)
        assert len(pages) == n, (n, len(pages))
        if not n:
            return []
        spare = self._spare
        take = min(n, len(spare))
        chain = spare[len(spare) - take :]
        del spare[len(spare) - take :]
        if take < n:
            chain += self._blank_nodes(n - take)
        stamp = self._clock
        prev = parent
        owner = self.current_owner
        for node, key, page in zip(chain, keys, pages):
            node.key = key
            node.parent = prev
            node.num_children = node.device_children = 1
            node.device_page = page
            node.host_page = NO_PAGE
            node.lock_ref = node.hit_count = node.flags = 0
            node.last_access = stamp
            node.owner = owner
            prev = node
        if self.fixed_owners:  # (a declared shared prefix's pages are its scope's, whichever request makes them)
            fixed = self.fixed_owners
            for node in chain:
                node.owner = fixed.get(node.key, owner)
        if self._windows:  # (a hybrid tree: the new nodes' window pages are as recent as their pages)
            for node in chain:
                node.window_used = stamp
        prev.num_children = prev.device_children = 0
        self.nodes.update(zip(keys, chain))
        owned = self.device_owned
        if owned:
            for page in pages:
                owned[page] = 1
        if parent is not None:
            parent.num_children += 1
            parent.device_children += 1
        self.device_heap.push(prev)
        return chain

    def add_host_chain(
        self, keys: Sequence[PageHash], pages: Sequence[int], parent: PageNode | None, *, ready: bool, stored: int = NOT_STORED
    ) -> list[PageNode]:
        """New nodes for ``keys`` (none cached yet), each a child of the previous, on host ``pages``: where
        an L3 fetch or a copy out of an engine's blocks lands (``ready`` False until it has landed).
        One heap entry, for the deepest: the only leaf of the chain."""
        assert len(keys) == len(pages), (len(keys), len(pages))
        if not keys:
            return []
        flags = (_HOST_READY if ready else 0) | (stored << 1)
        stamp = self._clock
        chain = []
        prev = parent
        for key, page in zip(keys, pages):
            node = self._node(key, prev, stamp, NO_PAGE, 1)
            node.host_page = page
            node.flags = flags
            chain.append(node)
            prev = node
        prev.num_children = 0
        self.nodes.update(zip(keys, chain))
        if parent is not None:
            parent.num_children += 1
        self.hosted.update(chain)
        if self.host_by_owner is not None:
            self.count_host(chain)
        self.host_heap.push(prev)
        return chain

    def remove(self, node: PageNode) -> None:
        assert node.num_children == 0 and node.device_page == NO_PAGE and node.host_page == NO_PAGE and node.lock_ref == 0, node
        del self.nodes[node.key]
        parent = node.parent
        if parent is not None:
            parent.num_children -= 1
            self._child_left(parent, node)
        node.parent = None  # a recycled node must not keep its old ancestors alive
        self._spare.append(node)

    def remove_host_only(self, nodes: Sequence[PageNode]) -> list[int]:
        """:meth:`clear_host` and :meth:`remove` of each of ``nodes`` (host-only, unlocked, deepest first:
        each is a leaf once those before it are gone); their host pages. Host eviction's hot path:
        a parent that leaves too gets no heap entry on the way."""
        tree_nodes, spare = self.nodes, self._spare
        leaving = set(nodes) if len(nodes) > 1 else ()
        pages = []
        for node in nodes:
            assert node.num_children == 0 and node.device_page == NO_PAGE and node.host_page != NO_PAGE and node.lock_ref == 0, node
            pages.append(node.host_page)
            node.host_page = NO_PAGE
            node.flags &= ~_HOST_READY
            del tree_nodes[node.key]
            parent = node.parent
            if parent is not None:
                parent.num_children -= 1
                if parent not in leaving:
                    self._child_left(parent, node)
                elif node.last_access > parent.last_access:
                    parent.last_access = node.last_access
            node.parent = None  # a recycled node must not keep its old ancestors alive
        self.hosted.difference_update(nodes)
        if self.host_by_owner is not None:
            self.count_host(nodes, -1)
        spare.extend(nodes)
        return pages

    def host_only_below(self, node: PageNode) -> list[PageNode]:
        """Every node below ``node``, a node with no child on device, deepest first.

        Such a node's descendants are all off device, so all hold a host page: they are found
        among the host-resident nodes, each walking up its off-device tail (the tree keeps no
        child lists; this serves the rare case where a page must leave before what hangs from it)."""
        assert node.device_children == 0, node
        below: list[tuple[int, PageNode]] = []
        for n in self.hosted:
            depth, p = 1, n.parent
            while p is not None and p is not node and p.device_page == NO_PAGE:
                p, depth = p.parent, depth + 1
            if p is node:
                below.append((depth, n))
        below.sort(key=lambda e: -e[0])
        return [n for _, n in below]

    # ---- residency -------------------------------------------------------------
    def set_device(self, node: PageNode, page: int) -> None:
        parent = node.parent
        assert node.device_page == NO_PAGE and (parent is None or parent.device_page != NO_PAGE), node
        node.device_page = page
        if self.device_owned:
            self.device_owned[page] = 1
        if node.device_children == 0:
            self.device_heap.push(node)
        if parent is not None:
            parent.device_children += 1

    def set_device_run(self, nodes: Sequence[PageNode], pages: Sequence[int]) -> None:
        """:meth:`set_device` of a chain (each node the parent of the next, the first's parent on
        device): one heap entry, for the deepest, instead of one per node that stops being a leaf
        at the next step (a load back or an insert over host copies)."""
        if not nodes:
            return
        first = nodes[0].parent
        assert first is None or first.device_page != NO_PAGE, first
        owned = self.device_owned
        prev = first
        for node, page in zip(nodes, pages):
            assert node.device_page == NO_PAGE and node.parent is prev, node
            node.device_page = page
            if owned:
                owned[page] = 1
            if prev is not None:
                prev.device_children += 1
            prev = node
        if prev.device_children == 0:  # no child on device yet: prefix closure says so
            self.device_heap.push(prev)

    def clear_device(self, node: PageNode) -> int:
        return self.clear_devices((node,))[0]

    def clear_devices(self, nodes: Sequence[PageNode]) -> list[int]:
        """:meth:`clear_device` of each of ``nodes`` in order (descendants first); their pages.
        The eviction hot path: one call, the per-page steps inline."""
        owned = self.device_owned
        push = self.device_heap.push
        pages = []
        leaving = set(nodes) if len(nodes) > 1 else ()
        for node in nodes:
            assert node.device_children == 0 and node.device_page != NO_PAGE, node
            page = node.device_page
            node.device_page = NO_PAGE
            pages.append(page)
            if owned:
                owned[page] = 0
            parent = node.parent
            if parent is not None:
                parent.device_children -= 1
                if node.last_access > parent.last_access:
                    parent.last_access = node.last_access
                if parent.device_children == 0 and parent not in leaving:  # on device (prefix-closed), a device
                    push(parent)  # leaf now (unless it leaves next); never a host leaf: ``node`` is still its child
        return pages

    def device_subtree(self, tops: Sequence[PageNode]) -> list[PageNode]:
        """Device-resident nodes at or below any of ``tops``, deepest first (so :meth:`clear_devices`
        can take them in order). A scan of the whole tree: for rare paths only (a failed load)."""
        tops_set = set(tops)
        found: list[tuple[int, PageNode]] = []
        for node in self.nodes.values():
            if node.device_page == NO_PAGE:
                continue
            depth, n = 0, node
            while n is not None and n not in tops_set:
                n, depth = n.parent, depth + 1
            if n is not None:
                found.append((depth + sum(1 for _ in n.path_to_root()), node))
        found.sort(key=lambda e: -e[0])
        return [n for _, n in found]

    def set_hosts(self, nodes: Sequence[PageNode], pages: Sequence[int], ready: bool) -> None:
        """:meth:`set_host` of each of ``nodes`` (one heap entry per node that is a leaf)."""
        push = self.host_heap.push
        bit = _HOST_READY if ready else 0
        for node, page in zip(nodes, pages):
            assert node.host_page == NO_PAGE, node
            node.host_page = page
            node.flags = (node.flags & ~_HOST_READY) | bit
            if node.num_children == 0:
                push(node)
        self.hosted.update(nodes)
        if self.host_by_owner is not None:
            self.count_host(nodes)

    def set_host(self, node: PageNode, page: int, ready: bool) -> None:
        self.set_hosts((node,), (page,), ready)

    @staticmethod
    def mark_host_ready(nodes: Sequence[PageNode]) -> None:
        """The host copies of ``nodes`` are complete (a backup or fetch landed)."""
        for node in nodes:
            node.flags |= _HOST_READY

    @staticmethod
    def set_stored(nodes: Sequence[PageNode], state: int) -> None:
        """The L3 state of each of ``nodes`` (NOT_STORED, SAVING or STORED)."""
        bits = state << 1
        for node in nodes:
            node.flags = (node.flags & _HOST_READY) | bits

    @staticmethod
    def not_stored(nodes: Sequence[PageNode]) -> list[PageNode]:
        """Those of ``nodes`` that L3 neither holds nor is saving."""
        return [node for node in nodes if node.flags >> 1 == NOT_STORED]

    @staticmethod
    def readable_host_run(nodes: Sequence[PageNode]) -> int:
        """How many leading ``nodes`` have a readable host copy."""
        n = 0
        for node in nodes:
            if node.host_page == NO_PAGE or not node.flags & _HOST_READY:
                break
            n += 1
        return n

    @staticmethod
    def loadable_run(nodes: Sequence[PageNode]) -> int:
        """How many leading ``nodes`` can be loaded back to device as one run now: each host-only with
        a readable copy and the parent of the next, the first's parent on device (or the root)."""
        prev = nodes[0].parent if nodes else None
        if prev is not None and prev.device_page == NO_PAGE:
            return 0
        n = 0
        for node in nodes:
            if node.device_page != NO_PAGE or node.host_page == NO_PAGE or not node.flags & _HOST_READY or node.parent is not prev:
                break
            prev = node
            n += 1
        return n

    def clear_host(self, node: PageNode) -> int:
        page, node.host_page = node.host_page, NO_PAGE
        node.host_ready = False
        self.hosted.discard(node)
        if self.host_by_owner is not None and page != NO_PAGE:
            self.host_by_owner[node.owner] -= 1
        return page

    def _maybe_compact(self) -> None:
        limit = 2 * len(self.nodes) + 4096
        for heap in (self.device_heap, self.host_heap):
            if len(heap.entries) > limit:
                heap.rebuild(self.nodes.values())

    # ---- locks -----------------------------------------------------------------
    def lock(self, node: PageNode | None) -> None:
        """Protect ``node`` and its ancestors from eviction until :meth:`unlock` (see the module docstring)."""
        if node is None:
            return
        n = node
        while n is not None:
            n.lock_ref += 1
            if n.device_page != NO_PAGE:
                break
            n = n.parent
        held = self._anchors.get(node)
        if held is None:
            self._anchors[node] = [n]
        else:
            held.append(n)

    def unlock(self, node: PageNode | None) -> None:
        """Release one lock on ``node``: the walk its lock made, whatever lives where now."""
        if node is None:
            return
        held = self._anchors.get(node)
        if not held:
            raise InvalidStateError(f"unlock of an unlocked node {node!r}: every unlock needs a matching lock")
        anchor = held.pop()
        if not held:
            del self._anchors[node]
        n = node
        while n is not None:
            n.lock_ref -= 1
            if n is anchor:
                break
            n = n.parent

    @staticmethod
    def pin(nodes: Sequence[PageNode]) -> None:
        """Lock each of ``nodes`` alone: no walk and no anchor to record. A device node is its own
        anchor; a host-only one keeps its ancestors too, since eviction takes leaves only and a pinned
        node never leaves. Release with :meth:`unpin`."""
        for node in nodes:
            node.lock_ref += 1

    @staticmethod
    def unpin(nodes: Sequence[PageNode]) -> None:
        for node in nodes:
            assert node.lock_ref > 0, node
            node.lock_ref -= 1

    # ---- eviction candidates ---------------------------------------------------
    def device_victims(self, limit: int, *, require_host_copy: bool = False, older_than: int | None = None) -> list[PageNode]:
        """Up to ``limit`` unlocked device-resident nodes, LRU leaves first, that can all leave together.

        A node qualifies once all its device-resident children are chosen, so
        descendants always precede their ancestors in the result.
        ``require_host_copy`` keeps to pages whose ready host copy makes dropping free
        (:meth:`drop_backed_up` is that walk with the clearing done as it goes: the hot path).
        ``older_than``: only leaves last used before that stamp (a shared tier's window objects of
        that age go first, :mod:`kvtier.core.group_residency`).
        """
        if require_host_copy:
            eligible = lambda n: not n.lock_ref and n.host_page != NO_PAGE and n.flags & _HOST_READY  # noqa: E731
        else:
            eligible = _device_evictable
        return self._victims(self.device_heap, limit, eligible, lambda n: n.device_children, older_than)

    def drop_backed_up(self, limit: int) -> list[int]:
        """Drop up to ``limit`` device copies whose host copy is ready (free to drop), LRU device
        leaves first, and return their device pages: :meth:`device_victims` with
        ``require_host_copy`` and :meth:`clear_devices` in one walk, the eviction hot path. A
        leaf is cleared as it is taken, so its parent is a real leaf at once: taken next when
        it is older than every queued leaf (a chain), else queued with its inherited stamp.
        (:meth:`drop_backed_up_bounded` is the same walk with a bound and the nodes collected, for a
        hybrid model: two loops, so that a full-attention model's walk tests nothing it never needs.)"""
        self._maybe_compact()
        heap = self.device_heap
        entries, seq = heap.entries, heap.seq
        pop, push = heapq.heappop, heapq.heappush
        owned = self.device_owned
        pages: list[int] = []
        keep: list[tuple[int, int, PageNode]] = []  # valid leaves passed over (locked, no ready host copy)
        left = limit
        node = None
        while left > 0:
            if node is None:
                if not entries:
                    break
                entry = pop(entries)
                stamp, _, node = entry
                if stamp != node.last_access or node.device_page == NO_PAGE or node.device_children:  # stale
                    node = None
                    continue
                if node.lock_ref or node.host_page == NO_PAGE or not node.flags & _HOST_READY:
                    keep.append(entry)
                    node = None
                    continue
            page = node.device_page
            node.device_page = NO_PAGE
            pages.append(page)
            if owned:
                owned[page] = 0
            left -= 1
            parent, stamp, node = node.parent, node.last_access, None
            if parent is not None:
                parent.device_children -= 1
                if stamp > parent.last_access:
                    parent.last_access = stamp
                if parent.device_children == 0:  # a device leaf now (never a host leaf: its child stays)
                    if (
                        (not entries or parent.last_access < entries[0][0])
                        and not parent.lock_ref
                        and parent.host_page != NO_PAGE
                        and parent.flags & _HOST_READY
                    ):
                        node = parent
                    else:
                        push(entries, (parent.last_access, next(seq), parent))
        if node is not None:  # the chain's next leaf, not taken: it needs its heap entry
            push(entries, (node.last_access, next(seq), node))
        for entry in keep:
            push(entries, entry)
        return pages

    def drop_backed_up_bounded(self, limit: int, dropped: list[PageNode], older_than: int | None = None) -> list[int]:
        """:meth:`drop_backed_up` for a hybrid model: ``dropped`` collects the nodes cleared (their
        other groups' objects leave with them); ``older_than``: as :meth:`device_victims`."""
        self._maybe_compact()
        bound = _NEVER if older_than is None else older_than  # (one compare per leaf, not two)
        heap = self.device_heap
        entries, seq = heap.entries, heap.seq
        pop, push = heapq.heappop, heapq.heappush
        owned = self.device_owned
        pages: list[int] = []
        keep: list[tuple[int, int, PageNode]] = []  # valid leaves passed over (locked, no ready host copy)
        left = limit
        node = None
        while left > 0:
            if node is None:
                if not entries:
                    break
                entry = pop(entries)
                stamp, _, node = entry
                if stamp != node.last_access or node.device_page == NO_PAGE or node.device_children:  # stale
                    node = None
                    continue
                if node.lock_ref or node.host_page == NO_PAGE or not node.flags & _HOST_READY:
                    keep.append(entry)
                    node = None
                    continue
                if stamp >= bound:
                    keep.append(entry)
                    node = None
                    break
            page = node.device_page
            node.device_page = NO_PAGE
            pages.append(page)
            dropped.append(node)
            if owned:
                owned[page] = 0
            left -= 1
            parent, stamp, node = node.parent, node.last_access, None
            if parent is not None:
                parent.device_children -= 1
                if stamp > parent.last_access:
                    parent.last_access = stamp
                if parent.device_children == 0:  # a device leaf now (never a host leaf: its child stays)
                    if (
                        (not entries or parent.last_access < entries[0][0])
                        and parent.last_access < bound
                        and not parent.lock_ref
                        and parent.host_page != NO_PAGE
                        and parent.flags & _HOST_READY
                    ):
                        node = parent
                    else:
                        push(entries, (parent.last_access, next(seq), parent))
        if node is not None:  # the chain's next leaf, not taken: it needs its heap entry
            push(entries, (node.last_access, next(seq), node))
        for entry in keep:
            push(entries, entry)
        return pages

    def host_victims(self, limit: int, older_than: int | None = None, allowed: Callable[[PageNode], bool] | None = None) -> list[PageNode]:
        """Up to ``limit`` unlocked, ready host copies with no device copy whose children all leave too,
        LRU leaves first (descendants before their ancestors). ``allowed``: asked of each one that could
        go, in the order taken (a tenant's quota, :mod:`kvtier.core.tenants`); False keeps it.

        Pages being saved to L3 (``SAVING``) are skipped: the storage worker is reading them."""
        eligible = _host_evictable if allowed is None else (lambda n: _host_evictable(n) and allowed(n))
        return self._victims(
            self.host_heap,
            limit,
            eligible,
            lambda n: n.num_children,
            older_than,
        )

    def oldest_device_leaf(self) -> int | None:
        """The stamp of the least recently used device leaf :meth:`device_victims` could take (None: none)."""
        return self._oldest(self.device_heap, _device_evictable)

    def oldest_host_leaf(self) -> int | None:
        """The stamp of the least recently used host leaf :meth:`host_victims` could take (None: none)."""
        return self._oldest(self.host_heap, _host_evictable)

    def _oldest(self, heap: _LeafHeap, eligible) -> int | None:
        entries, valid = heap.entries, heap.valid
        keep, found = [], None
        while entries:
            entry = heapq.heappop(entries)
            if not valid(entry):
                continue
            keep.append(entry)
            if eligible(entry[2]):
                found = entry[0]
                break
        for entry in keep:
            heapq.heappush(entries, entry)
        return found

    def _victims(self, heap: _LeafHeap, limit: int, eligible, children, older_than: int | None = None) -> list[PageNode]:
        """Pop a tier's leaves oldest first; a parent joins once all its ``children`` in the tier are
        chosen, as recent as the newest of them: next at once when older than every queued leaf
        (a chain), else queued. Popped entries that are still valid go back on the heap: the
        caller may not evict them all. ``older_than``: the walk stops at the first leaf used since."""
        self._maybe_compact()
        bound = _NEVER if older_than is None else older_than
        entries, seq, is_leaf, in_tier = heap.entries, heap.seq, heap.is_leaf, heap.in_tier
        pop, push = heapq.heappop, heapq.heappush
        chosen: list[PageNode] = []
        picked: set[PageNode] = set()
        taken: dict[PageNode, int] = {}
        virtual: list[tuple[int, int, PageNode]] = []  # parents that become leaves if the chosen ones leave
        keep: list[tuple[int, int, PageNode]] = []
        node = None  # set: the next candidate is known without a heap (a chain's parent)
        while len(chosen) < limit and (node is not None or entries or virtual):
            if node is None:
                if virtual and (not entries or virtual[0] < entries[0]):
                    stamp, _, node = pop(virtual)
                else:
                    entry = pop(entries)
                    stamp, _, node = entry
                    if stamp != node.last_access or not is_leaf(node):  # stale
                        node = None
                        continue
                    keep.append(entry)
            if stamp >= bound:
                break
            if node in picked or not eligible(node):
                node = None
                continue
            chosen.append(node)
            picked.add(node)
            parent, node = node.parent, None
            if parent is not None and in_tier(parent) and _all_children_taken(parent, children(parent), taken):
                node, stamp = _next_or_queued(parent, stamp, entries, virtual, seq)
        for entry in keep:
            push(entries, entry)
        return chosen

    # ---- integrity -------------------------------------------------------------
    def check(self) -> None:
        children: dict[int, int] = {}
        dchildren: dict[int, int] = {}
        for key, node in self.nodes.items():
            assert node.key == key
            assert node.on_device or node.on_host, f"node holds no copy: {node!r}"
            if node.parent is not None:
                assert self.nodes.get(node.parent.key) is node.parent, f"parent missing: {node!r}"
                children[id(node.parent)] = children.get(id(node.parent), 0) + 1
                if node.on_device:
                    assert node.parent.on_device, f"device residency not prefix-closed at {node!r}"
                    dchildren[id(node.parent)] = dchildren.get(id(node.parent), 0) + 1
            assert node.lock_ref >= 0
        assert self.hosted == {n for n in self.nodes.values() if n.on_host}, "host-resident index drift"
        if self.host_by_owner is not None:
            counted = [0] * len(self.host_by_owner)
            for n in self.hosted:
                counted[n.owner] += 1
            assert counted == self.host_by_owner, f"host pages per owner drift: {self.host_by_owner} counted, {counted} held"
        for node in self.nodes.values():
            assert node.num_children == children.get(id(node), 0), f"child count drift at {node!r}"
            assert node.device_children == dchildren.get(id(node), 0), f"device child count drift at {node!r}"
        for heap in (self.device_heap, self.host_heap):
            indexed = {id(e[2]) for e in heap.entries if heap.valid(e)}
            for node in self.nodes.values():
                if heap.is_leaf(node):
                    assert id(node) in indexed, f"leaf missing from its tier's LRU heap: {node!r}"
