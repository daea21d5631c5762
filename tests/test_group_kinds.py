"""The kinds of KV group (kvtier.core.group_kinds) and the hybrid match against a brute-force oracle.

Hand-made cases where each kind of group is the one that limits the prefix -- a missing window
page, a missing snapshot, a missing full page -- then random presence patterns over windows smaller
and larger than a page run. Presence is by place: the page an object hangs on (a snapshot at
boundary ``d`` hangs on page ``d - 1``)."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.core.group_kinds import GroupKind, StateKind, WindowKind, kind_of, register, snapshot_boundaries, usable_prefix
from kvtier.groups import KVGroup, StateTensor
from kvtier.spec import KVSpec
from support.hybrid_rules import read_places, snapshot_places

P = 4  # tokens per page


def _window(name: str, window: int) -> KVGroup:
    return KVGroup(name, "sliding_window", (1,), attention=KVSpec.mha(name, 1, kv_heads=1, head_dim=8, page_size=P), window=window)


def _state(name: str) -> KVGroup:
    return KVGroup(name, "state", (2,), state=(StateTensor("s", (4,), "float32"),))


def oracle(full: int, groups, present: dict[str, set[int]]):
    """Try every boundary from ``full`` down, spelling out each group's rule; the reason is the first
    group in spec order that rules out boundary ``full``."""
    def ok(g, d):
        return all(i in present[g.name] for i in read_places(g, d, P))

    reason = next((g.name for g in groups if full > 0 and not ok(g, full)), None)
    for d in range(full, -1, -1):
        if all(ok(g, d) for g in groups):
            return d, reason
    raise AssertionError("boundary 0 is always usable")


def run(full, groups, present):
    got = usable_prefix(full, [kind_of(g, P) for g in groups], {name: s.__contains__ for name, s in present.items()})
    assert (got.pages, got.limited_by) == oracle(full, groups, present)
    return got


def test_each_kind_says_what_a_boundary_reads():
    w = kind_of(_window("w", 6), P)  # 6 tokens: 1.5 pages
    assert isinstance(w, WindowKind) and w.places(0) == range(0, 0) and w.places(1) == range(0, 1)
    assert w.places(3) == range(1, 3)  # tokens 6..11 live in pages 1 and 2
    assert kind_of(_window("w8", 8), P).places(3) == range(1, 3) and kind_of(_window("big", 400), P).places(3) == range(0, 3)
    s = kind_of(_state("ssm"), P)
    assert isinstance(s, StateKind) and s.places(0) == range(0) and s.places(5) == range(4, 5)  # the snapshot at 5 hangs on page 4
    for g in (_window("w", 6), _window("w13", 13), _state("ssm")):
        for d in range(12):
            assert list(kind_of(g, P).places(d)) == read_places(g, d, P)


def test_each_kind_says_where_an_engine_hands_objects_over_and_what_goes_last():
    w, s = kind_of(_window("w", 6), P), kind_of(_state("ssm"), P)
    assert list(w.handed_places(2, 7, 3)) == [2, 3, 4, 5, 6]  # every page it computed
    for first, pages, every in [(0, 8, 3), (2, 7, 3), (3, 3, 2), (0, 1, 4), (5, 12, 4)]:
        assert list(s.handed_places(first, pages, every)) == snapshot_places(first, pages, every)
    assert snapshot_boundaries(0, 8, 3) == [3, 6, 8] and snapshot_boundaries(0, 8, 3, at_end=False) == [3, 6]
    assert s.kept_last(has_children=False) and not s.kept_last(has_children=True)  # a branch's last snapshot goes last
    assert not w.kept_last(has_children=False)


def test_a_missing_full_page_limits_the_prefix():
    g = _window("w", 8)
    got = run(3, [g], {"w": {0, 1, 2, 3, 4}})
    assert got.pages == 3 and got.limited_by is None  # the full groups' 3 pages are the limit


def test_a_missing_window_page_limits_the_prefix():
    g = _window("w", 8)  # two pages
    got = run(6, [g], {"w": {0, 1, 2, 3, 5}})  # page 4 is gone: boundaries 5 and 6 read it
    assert got.pages == 4 and got.limited_by == "w"
    got = run(6, [g], {"w": {4, 5}})  # pages before the window may go: boundary 6 still usable
    assert got.pages == 6 and got.limited_by is None


def test_a_missing_snapshot_limits_the_prefix():
    s = _state("ssm")
    got = run(6, [s], {"ssm": {2}})  # only the snapshot at boundary 3 (on page 2)
    assert got.pages == 3 and got.limited_by == "ssm"
    got = run(6, [s], {"ssm": set()})
    assert got.pages == 0 and got.limited_by == "ssm"


def test_window_and_state_together_need_a_boundary_both_allow():
    w, s = _window("w", 4), _state("ssm")
    # snapshots at 2, 4 and 6 (pages 1, 3, 5); window page 5 missing: 6 fails on w, 4 is the answer
    got = run(6, [w, s], {"w": {0, 1, 2, 3, 4}, "ssm": {1, 3, 5}})
    assert got.pages == 4 and got.limited_by == "w"
    got = run(6, [s, w], {"w": {0, 1, 2, 3, 4}, "ssm": {1, 3}})
    assert got.pages == 4 and got.limited_by == "ssm"  # the first group, in spec order, that rules out 6


@pytest.mark.parametrize("seed", range(4))
def test_random_presence_matches_the_oracle(seed):
    rnd = random.Random(seed)
    for _ in range(2000):
        groups = []
        for k in range(rnd.randint(1, 3)):
            groups.append(_state(f"s{k}") if rnd.random() < 0.4 else _window(f"w{k}", rnd.choice([1, 3, 4, 6, 8, 13, 40])))
        full = rnd.randint(0, 12)
        density = rnd.random()
        present = {g.name: {i for i in range(13) if rnd.random() < density} for g in groups}
        run(full, groups, present)


# ---- a kind of one's own: registered here, served by the core unchanged ------------------------------
class ChunkedKind(GroupKind):
    """Chunked local attention over chunks of ``CHUNK`` pages (Llama 4's iRoPE layers): the next token
    attends to its own chunk only, so a boundary reads the pages of its chunk so far -- a boundary at a
    chunk's start reads none."""

    name = "chunked_local"
    __slots__ = ()
    CHUNK = 2

    def places(self, pages: int) -> range:
        return range(pages // self.CHUNK * self.CHUNK, pages)


def test_a_fourth_kind_defined_here_alone_runs_a_request_through_the_core_bit_exact():
    from kvtier import DevicePool, HostPool
    from kvtier.cache import HierarchicalCache
    from kvtier.config import CacheConfig
    from kvtier.core import Tier
    from kvtier.groups import ModelSpec

    register(ChunkedKind)
    attn = KVSpec.mha("m", 1, kv_heads=1, head_dim=8, page_size=P, dtype="float32")
    model = ModelSpec("toy", 2, (KVGroup("full", "full", (0,), attention=attn), KVGroup("local", "chunked_local", (1,), attention=attn)))
    pools = {"local": (DevicePool(attn, 16), HostPool(attn, 16))}
    cache = HierarchicalCache(DevicePool(attn, 16), HostPool(attn, 16), CacheConfig(write_policy="write_through"), model=model,
                              group_pools=pools)
    tokens = list(range(100, 100 + 7 * P))  # 7 full pages
    try:
        req = cache.begin(tokens)
        new = req.alloc(7)
        places = list(req.handed_places("local"))
        assert places == list(range(7))  # an engine hands over every page it computed (the default rule)
        ids = req.alloc_group("local", len(places))
        for place, gid in zip(places, ids):  # the object of page p holds p's bytes
            pools["local"][0].rows("k", 0)[gid].fill_(float(place))
        req.commit(new.pages, {"local": ids})
        cache.wait_idle()
        cache.evict_device(16)  # every page and object now only on host
        req = cache.begin(tokens[: 5 * P + 1])  # a prefix of 5 pages: its chunk is pages 4..5, so only page 4
        assert req.wait() == 5 and sorted(req.groups["local"]) == [4]
        assert torch.all(pools["local"][0].rows("k", 0)[req.groups["local"][4]] == 4.0)
        assert cache.component("local").loaded == 1  # the load brought the chunk's one object, not all five
        req.abort()
        # an object its boundary reads gone from host: the match stops at the chunk start, which reads none
        cache.evict_device(16)
        c = cache.component("local")
        node = cache.tree.nodes[cache.page_keys(tokens)[6]]  # the one object boundary 7 reads
        c.alloc[Tier.HOST].free([c.at[Tier.HOST].pop(node)])
        req = cache.begin(tokens)
        assert req.wait() == 6 and req.groups["local"] == {}  # boundary 6 starts a chunk: it reads no object
        req.abort()
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()
