"""A hybrid model's object ids live in slots of the tree's nodes (kvtier.core.node_objects).

What must hold: a full-attention tree keeps plain nodes (no slot, no byte more);
a recycled node never carries an object of the page it held before into the next
page made from it; the count of objects is what the nodes hold; and the mapping
API the core's colder paths use behaves as the dict it replaced.
"""

from __future__ import annotations

import pytest

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig
from kvtier.core import CacheCore, Tier
from kvtier.core.node_objects import NodeObjects
from kvtier.executors.accounting import AccountingExecutor
from kvtier.radix import PageNode, PrefixTree, node_type_with
from support.pools import tiny_specs
from support.hybrid_core import commit_all, make
from support.hybrid_models import PAGE


def test_a_full_attention_tree_keeps_plain_nodes():
    spec = tiny_specs(page_size=PAGE, num_layers=1)["mla"]
    core = CacheCore(spec, PageAllocator(8, "device"), PageAllocator(8, "host"), AccountingExecutor(None),
                     CacheConfig(preallocate_nodes=True))
    req = core.begin(list(range(4 * PAGE)))
    req.commit(req.alloc(4).pages)
    nodes = list(core.tree.nodes.values()) + core.tree.spare_nodes()
    assert nodes and all(type(n) is PageNode for n in nodes)


def test_a_hybrid_tree_hangs_each_group_object_on_its_node():
    core, _, _ = make(window=2 * PAGE, state=True)
    assert all(type(n) is not PageNode and n.object_slots for n in core.tree.spare_nodes())
    tokens = list(range(6 * PAGE))
    req = commit_all(core, tokens)
    nodes = [core.tree.nodes[k] for k in core.page_keys(tokens)]
    swa, ssm = core.component("swa"), core.component("ssm")
    assert [swa.at[Tier.DEVICE][n] for n in nodes] == sorted(swa.at[Tier.DEVICE].values())  # one per page, in order
    assert len(swa.at[Tier.DEVICE]) == 6 and len(ssm.at[Tier.DEVICE]) == 6 and not swa.at[Tier.HOST]
    assert req.state.value == "committed"
    core.check_integrity(idle=True)


def test_a_recycled_node_never_carries_the_object_of_the_page_it_held():
    # four device pages and four window objects: B's pages can only be made from A's recycled nodes
    core, _, _ = make(window=2 * PAGE, state=False, dev=4, host=4, objects=4, write_policy="write_back")
    a, b = list(range(4 * PAGE)), list(range(10_000, 10_000 + 4 * PAGE))
    commit_all(core, a)
    swa = core.component("swa")
    a_nodes = {id(core.tree.nodes[k]) for k in core.page_keys(a)}
    assert core.evict_device(4).evicted == 4 and core.evict_host(4).evicted == 4  # A leaves both tiers
    assert len(core.tree) == 0 and not swa.at[Tier.DEVICE] and not swa.at[Tier.HOST]
    req = core.begin(b)
    new = req.alloc(4)
    ids = req.alloc_group("swa", 2)  # B hands over its last two window pages only
    req.commit(new.pages, {"swa": [None, None] + ids})
    nodes = [core.tree.nodes[k] for k in core.page_keys(b)]
    assert {id(n) for n in nodes} == a_nodes  # made from A's nodes
    assert [swa.at[Tier.DEVICE].get(n) for n in nodes] == [None, None] + ids
    assert len(swa.at[Tier.DEVICE]) == 2
    core.check_integrity(idle=True)


def test_node_objects_behave_as_the_map_they_replaced():
    cls = node_type_with(("objects_0_device",))
    tree = PrefixTree()
    tree.use_node_type(cls)
    a, b = (tree._node(k, None, 0) for k in (1, 2))
    tree.nodes.update({1: a, 2: b})
    objs = NodeObjects("objects_0_device", cls, tree.nodes)
    assert not objs and a not in objs and None not in objs and objs.get(a) is None
    objs[a] = 7
    objs[a] = 8  # replaced, counted once
    objs.attach_new([b], [9])
    assert (len(objs), objs[a], objs.get(b), sorted(objs.values()), sorted(objs.items(), key=lambda kv: kv[1])) == (
        2, 8, 9, [8, 9], [(a, 8), (b, 9)])
    assert objs.pop(a) == 8 and a not in objs and len(objs) == 1
    with pytest.raises(KeyError):
        objs.pop(a)
    with pytest.raises(KeyError):
        objs[a]
    objs.check(tree.spare_nodes())
    del tree.nodes[2]  # a node that left the tree holding an object: the check says so
    with pytest.raises(AssertionError, match="counted"):
        objs.check(tree.spare_nodes())
