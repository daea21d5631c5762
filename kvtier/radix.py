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
* ``lock_ref`` of a node is >= the sum over locks taken on it and its descendants
  (locks walk to the root), so a locked path is never evicted.

LRU order is one ``OrderedDict`` per tier. Matches touch nodes leaf-to-root, so
within a path descendants are always older than ancestors and the LRU end of a
list is where evictable leaves are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvtier.hashing import PageHash

#: ``PageNode.device_page`` / ``host_page`` when the page has no copy in that tier.
NO_PAGE = -1
NOT_STORED, SAVING, STORED = 0, 1, 2


class PageNode:
    """One cached page. ``__slots__``: hundreds of thousands exist at once, no per-node dict."""

    __slots__ = ("key", "parent", "depth", "num_children", "device_children", "device_page", "host_page", "host_ready", "lock_ref", "hit_count", "last_access", "loading", "stored")

    def __init__(self, key: PageHash, parent: PageNode | None, depth: int):
        self.key = key
        self.parent = parent
        self.depth = depth
        self.num_children = 0
        self.device_children = 0
        self.device_page = NO_PAGE
        self.host_page = NO_PAGE
        #: host copy is complete and readable (False while its backup is in flight)
        self.host_ready = False
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access = 0
        #: the in-flight load filling this node's device page, if any
        self.loading = None
        #: L3 state: NOT_STORED, SAVING or STORED
        self.stored = NOT_STORED

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
        return f"PageNode(depth={self.depth}, dev={self.device_page}, host={self.host_page}{'' if self.host_ready else '*'}, lock={self.lock_ref})"


class PrefixTree:
    """Space-free bookkeeping: which page keys exist and where their bytes are. Touches no bytes."""

    def __init__(self) -> None:
        self.nodes: dict[PageHash, PageNode] = {}
        self.device_lru: OrderedDict[PageNode, None] = OrderedDict()
        self.host_lru: OrderedDict[PageNode, None] = OrderedDict()
        self._clock = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup ----------------------------------------------------------------
    def walk(self, keys: Sequence[PageHash]) -> list[PageNode]:
        """Nodes of the longest cached prefix of ``keys``."""
        nodes = self.nodes
        path: list[PageNode] = []
        for k in keys:
            node = nodes.get(k)
            if node is None:
                break
            path.append(node)
        return path

    def touch(self, path: Sequence[PageNode]) -> None:
        """Mark a matched path as used now: leaf first, so ancestors end up more recent."""
        now = self.tick()
        dev, host = self.device_lru, self.host_lru
        for node in reversed(path):
            node.last_access = now
            if node.device_page != NO_PAGE:
                dev.move_to_end(node)
            if node.host_page != NO_PAGE:
                host.move_to_end(node)

    # ---- structure ---------------------------------------------------------------
    def add(self, key: PageHash, parent: PageNode | None) -> PageNode:
        node = PageNode(key, parent, 0 if parent is None else parent.depth + 1)
        node.last_access = self._clock
        self.nodes[key] = node
        if parent is not None:
            parent.num_children += 1
        return node

    def remove(self, node: PageNode) -> None:
        assert node.num_children == 0 and node.device_page == NO_PAGE and node.host_page == NO_PAGE and node.lock_ref == 0, node
        del self.nodes[node.key]
        if node.parent is not None:
            node.parent.num_children -= 1

    # ---- residency -------------------------------------------------------------
    def set_device(self, node: PageNode, page: int) -> None:
        assert node.device_page == NO_PAGE and (node.parent is None or node.parent.device_page != NO_PAGE), node
        node.device_page = page
        self.device_lru[node] = None
        if node.parent is not None:
            node.parent.device_children += 1

    def clear_device(self, node: PageNode) -> int:
        assert node.device_children == 0 and node.device_page != NO_PAGE, node
        page, node.device_page = node.device_page, NO_PAGE
        del self.device_lru[node]
        if node.parent is not None:
            node.parent.device_children -= 1
        return page

    def set_host(self, node: PageNode, page: int, ready: bool) -> None:
        assert node.host_page == NO_PAGE, node
        node.host_page = page
        node.host_ready = ready
        self.host_lru[node] = None

    def clear_host(self, node: PageNode) -> int:
        page, node.host_page = node.host_page, NO_PAGE
        node.host_ready = False
        del self.host_lru[node]
        return page

    # ---- locks -----------------------------------------------------------------
    def lock(self, node: PageNode | None) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: PageNode | None) -> None:
        from kvtier.errors import InvalidStateError

        if node is not None and node.lock_ref <= 0:
            raise InvalidStateError(f"unlock of an unlocked node {node!r}: every unlock needs a matching lock")
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    # ---- eviction candidates ---------------------------------------------------
    def device_victims(self, limit: int) -> list[PageNode]:
        """Up to ``limit`` unlocked device-resident nodes, LRU first, that can all leave together.

        A node qualifies once all its device-resident children are chosen. LRU
        order usually puts descendants before ancestors, so the first pass takes
        whole cold subtrees; further passes pick up ancestors whose younger
        branches were chosen later in the scan. Descendants always precede
        their ancestors in the result.
        """
        return self._victims(self.device_lru, limit, lambda n: n.lock_ref == 0, lambda n: n.device_children)

    def host_victims(self, limit: int) -> list[PageNode]:
        """Up to ``limit`` unlocked, ready host copies with no device copy whose children all leave too.

        Pages being saved to L3 (``SAVING``) are skipped: the storage worker is reading them."""
        return self._victims(
            self.host_lru, limit,
            lambda n: n.lock_ref == 0 and n.device_page == NO_PAGE and n.host_ready and n.stored != SAVING,
            lambda n: n.num_children,
        )

    @staticmethod
    def _victims(lru, limit: int, eligible, children) -> list[PageNode]:
        chosen: list[PageNode] = []
        picked: set[int] = set()
        taken: dict[int, int] = {}
        progress = True
        while progress and len(chosen) < limit:
            progress = False
            for node in lru:
                if len(chosen) >= limit:
                    break
                if id(node) in picked or not eligible(node) or children(node) != taken.get(id(node), 0):
                    continue
                chosen.append(node)
                picked.add(id(node))
                progress = True
                if node.parent is not None:
                    taken[id(node.parent)] = taken.get(id(node.parent), 0) + 1
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
            assert (node in self.device_lru) == node.on_device
            assert (node in self.host_lru) == node.on_host
        for node in self.nodes.values():
            assert node.num_children == children.get(id(node), 0), f"child count drift at {node!r}"
            assert node.device_children == dchildren.get(id(node), 0), f"device child count drift at {node!r}"
        assert len(self.device_lru) == sum(n.on_device for n in self.nodes.values())
        assert len(self.host_lru) == sum(n.on_host for n in self.nodes.values())
