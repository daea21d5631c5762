"""The prefix tree's lazy LRU against a brute-force oracle.

The tree stamps only the deepest node of a used path and hands stamps to
parents as children leave (see kvtier/radix.py). The oracle stamps every node
of every used path. Whatever the tree picks as a victim must be an eligible
leaf of that tier that is least recently used by the oracle's clock, and the
tree's index must never lose a leaf.
"""

import random

import pytest

from kvtier.radix import PrefixTree


class Oracle:
    def __init__(self):
        self.tree = PrefixTree()
        self.used: dict[int, int] = {}  # id(node) -> last tick a path through it was used
        self.next_key = 0
        self.next_page = 0

    def path(self, node):
        return list(reversed(list(node.path_to_root()))) if node is not None else []

    def use(self, path):
        self.tree.touch(path)
        for n in path:
            self.used[id(n)] = self.tree._clock

    def insert(self, parent, length):
        keys = [self.next_key + i for i in range(length)]
        pages = [self.next_page + i for i in range(length)]
        self.next_key += length
        self.next_page += length
        chain = self.tree.add_device_chain([k.to_bytes(8, "little") for k in keys], pages, parent)
        self.tree.touch((chain[-1],))  # what the core's insert does
        for n in self.path(chain[-1]):
            self.used[id(n)] = self.tree._clock

    def device_leaves(self):
        return [n for n in self.tree.nodes.values() if n.on_device and n.device_children == 0 and n.lock_ref == 0]

    def lru_victim(self, victims, cands, tier):
        """The tree's one victim, checked: there is one exactly when the tier has a candidate, and it is least recently used."""
        assert bool(victims) == bool(cands)
        if not victims:
            return None
        v = victims[0]
        assert v in cands
        assert self.used[id(v)] == min(self.used[id(n)] for n in cands), f"{tier} victim is not the LRU leaf"
        return v

    def host_leaves(self):
        return [n for n in self.tree.nodes.values()
                if n.on_host and n.num_children == 0 and not n.on_device and n.host_ready and n.lock_ref == 0]


@pytest.mark.parametrize("seed", range(12))
def test_victims_are_least_recently_used_leaves(seed):
    rng = random.Random(seed)
    o = Oracle()
    t = o.tree
    for _ in range(600):
        nodes = list(t.nodes.values())
        op = rng.random()
        if op < 0.25 or not nodes:
            dev = [n for n in nodes if n.on_device]
            o.insert(rng.choice(dev) if dev and rng.random() < 0.8 else None, rng.randint(1, 4))
        elif op < 0.45:
            o.use(o.path(rng.choice(nodes)))
        elif op < 0.6:
            for n in nodes:  # back up a random device page (descendants may stay device-only)
                if n.on_device and not n.on_host and rng.random() < 0.3:
                    t.set_host(n, 10_000 + id(n) % 10_000, ready=True)
        elif op < 0.75:
            loadable = [n for n in nodes if not n.on_device and (n.parent is None or n.parent.on_device)]
            if loadable:
                n = rng.choice(loadable)
                t.set_device(n, o.next_page)
                o.next_page += 1
                o.use(o.path(n))  # what load_back does
        elif op < 0.8:  # the fused walk drops exactly the backed-up victims the query names, in order
            k = rng.randint(1, 6)
            expected = t.device_victims(k, require_host_copy=True)
            pages = [n.device_page for n in expected]
            assert t.drop_backed_up(k) == pages
            assert all(not n.on_device and n.on_host for n in expected)
        elif op < 0.9:
            v = o.lru_victim(t.device_victims(1), o.device_leaves(), "device")
            if v is not None:
                if not v.on_host:  # give a device-only page a host copy first, as write_back would
                    t.set_host(v, 20_000 + o.next_page, ready=True)
                    o.next_page += 1
                t.clear_device(v)
        else:
            v = o.lru_victim(t.host_victims(1), o.host_leaves(), "host")
            if v is not None:
                t.clear_host(v)
                t.remove(v)
                del o.used[id(v)]
        t.check()


def test_multi_victim_batches_take_subtrees_in_lru_order():
    o = Oracle()
    t = o.tree
    o.insert(None, 3)          # a-b-c
    a = t.nodes[(0).to_bytes(8, "little")]
    o.insert(a, 2)             # a-d-e
    o.use(o.path(t.nodes[(2).to_bytes(8, "little")]))  # c newer than e
    order = t.device_victims(5)
    keys = [int.from_bytes(n.key, "little") for n in order]
    assert keys == [4, 3, 2, 1, 0]  # e, d (its branch done), then c, b, and a once both branches are chosen
    assert t.device_victims(2) == order[:2]  # a batch that stops early takes the oldest


@pytest.mark.parametrize("seed", range(6))
def test_host_only_below_finds_every_descendant_of_a_device_leaf(seed):
    """What hangs below a device leaf is found among host-resident nodes (no child lists): the same
    nodes, deepest first, as a brute-force walk of every node's ancestors."""
    rng = random.Random(seed)
    o = Oracle()
    t = o.tree
    checked = nonempty = 0
    for _ in range(300):
        nodes = list(t.nodes.values())
        dev = [n for n in nodes if n.on_device]
        op = rng.random()
        if op < 0.4 or not dev:
            o.insert(rng.choice(dev) if dev and rng.random() < 0.8 else None, rng.randint(1, 4))
        elif op < 0.7:  # back up, then evict a device leaf: host-only pages hang below device pages
            v = rng.choice(dev)
            if v.device_children == 0:
                if not v.on_host:
                    t.set_host(v, 30_000 + o.next_page, ready=True)
                    o.next_page += 1
                t.clear_device(v)
        else:
            for node in dev:
                if node.device_children == 0:
                    brute = [n for n in nodes if n is not node and node in list(n.path_to_root())]
                    got = t.host_only_below(node)
                    assert set(got) == set(brute) and len(got) == len(brute)
                    depth = {n: len(list(n.path_to_root())) for n in got}
                    assert [depth[n] for n in got] == sorted(depth.values(), reverse=True)
                    checked += 1
                    nonempty += bool(got)
        t.check()
    assert checked > 0 and nonempty > 0


def test_pinned_device_nodes_are_never_victims_until_unpinned():
    tree = PrefixTree()
    a = tree.add_device_chain([b"a1", b"a2", b"a3"], [0, 1, 2], None)
    b = tree.add_device_chain([b"b1", b"b2"], [3, 4], None)
    tree.touch((b[-1],))  # b is newer: a's chain goes first, leaf first
    assert [n.key for n in tree.device_victims(5)] == [b"a3", b"a2", b"a1", b"b2", b"b1"]
    tree.pin([a[-1], b[-1]])  # the eviction backup's pins: each covers its node alone
    assert tree.device_victims(5) == []  # both leaves pinned: nothing above them can go either
    tree.unpin([a[-1]])
    assert [n.key for n in tree.device_victims(5)] == [b"a3", b"a2", b"a1"]
    tree.unpin([b[-1]])
    assert all(n.lock_ref == 0 for n in tree.nodes.values())
    assert len(tree.device_victims(5)) == 5
