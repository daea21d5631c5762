"""Sliding-window pages in the full pages' own pools: one budget per tier.

A window group whose page is a full page's size (gpt-oss: the same heads over as
many layers) can keep its pages in the pools of the full pages, as vLLM's hybrid
allocator shares its block pool. Then both kinds compete for the same ids, in one
least-recently-used order where a window page goes before a full page of equal
recency, and a window page no open request reads is evictable though its page
stays. A device page whose window page was evicted there gets it back from its
host copy beside the next load (a "fill"). Core cases with a recording executor,
then the bytes, bit-exact, in one process and across a process boundary.
"""

from __future__ import annotations

import pytest

from kvtier import DevicePool, HostPool
from kvtier.alloc import PageAllocator
from kvtier.build import build_hybrid_cache, open_storage_tier
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig, TierConfig
from kvtier.core import CacheCore, Failed, Reason, Tier
from kvtier.errors import ConfigError, SpecError
from kvtier.executors.accounting import AccountingExecutor
from kvtier.groups import HYBRID_PRESETS, KVGroup, ModelSpec
from kvtier.hashing import Namespace
from kvtier.radix import NO_PAGE
from support.hybrid_bytes import _bytes, _garbage, _write, compute, expected
from support.hybrid_core import Recorder, commit_all
from support.hybrid_models import GPT_LIKE, P, PAGE, SPEC, hybrid_model

A = list(range(4 * PAGE))
B = list(range(9000, 9000 + 4 * PAGE))


class FailingLoads(Recorder):
    """Records every plan; host -> device copies fail (the bytes they wrote are garbage)."""

    def submit(self, plan):
        if plan.src is Tier.HOST and plan.dst is Tier.DEVICE:
            self.plans.append(plan)
            self._done.append(Failed(plan.op, Reason.ERROR))
            return
        super().submit(plan)


def shared_core(window: int, *, dev: int = 8, host: int = 16, write_policy: str = "write_back", state: bool = False, port=None):
    """A core whose window group (its page a full page: ``hybrid_model`` gives both the same spec) takes
    the full pages' own ids in both tiers."""
    model, full = hybrid_model(window, state)
    device, host_ids = PageAllocator(dev, "device"), PageAllocator(host, "host")
    pools = {"swa": (device, host_ids)}
    if state:
        pools["ssm"] = (PageAllocator(16, "ssm device"), PageAllocator(16, "ssm host"))
    port = port or Recorder()
    core = CacheCore(full, device, host_ids, port, CacheConfig(write_policy=write_policy), model=model, group_pools=pools)
    return core, port


def nodes_of(core, tokens):
    return [core.tree.nodes.get(k) for k in core.page_keys(tokens)]


def window_places(core, tokens, tier=Tier.DEVICE):
    at = core.component("swa").at[tier]
    return [i for i, n in enumerate(nodes_of(core, tokens)) if n is not None and n in at]


def on_device(core, tokens):
    return [i for i, n in enumerate(nodes_of(core, tokens)) if n is not None and n.device_page != NO_PAGE]


# ---- the policy ---------------------------------------------------------------------------------------
def test_window_pages_go_before_full_pages_of_equal_recency():
    core, _ = shared_core(window=2)  # a boundary reads its last page's window page only
    commit_all(core, A)  # 4 full pages + 4 window pages: the 8 device ids
    assert core.dev_alloc.num_free == 0 and core.component("swa").sharing
    got = core.alloc_device(2)
    assert got.ok
    # every page was used at the same time as its window page: the windows went, the oldest first
    assert on_device(core, A) == [0, 1, 2, 3] and window_places(core, A) == [2, 3]
    assert core.component("swa").evicted == 2 and core.stats.device_evicted_pages == 0
    core.check_integrity(caller_device_pages=set(got.pages))
    core.free_device(got.pages)
    req = core.begin(A)  # the prefix still hits whole: its boundary reads page 3's window only
    assert (req.num_cached, req.groups["swa"].keys()) == (4, {3})
    req.abort()
    core.check_integrity(idle=True)


def test_full_pages_older_than_every_window_page_go_before_them():
    core, _ = shared_core(window=2, dev=16)
    commit_all(core, A)
    commit_all(core, B)  # later: its pages and windows are more recent than A's
    assert core.alloc_device(6).ok
    # A's four window pages (as recent as A's pages, so first), then A's two deepest pages (older than B's windows)
    assert window_places(core, A) == [] and on_device(core, A) == [0, 1]
    assert window_places(core, B) == [0, 1, 2, 3] and on_device(core, B) == [0, 1, 2, 3]


def test_a_window_page_an_open_request_reads_is_never_evicted():
    core, _ = shared_core(window=2)
    commit_all(core, A)
    req = core.begin(A)  # locks A's pages, holds the window page its boundary reads
    got = core.alloc_device(3)  # only the three windows no request reads can go
    assert got.ok and window_places(core, A) == [3] and on_device(core, A) == [0, 1, 2, 3]
    assert not core.alloc_device(1).ok  # the rest is the request's
    core.free_device(got.pages)
    req.abort()
    again = core.alloc_device(4)  # the three freed ids, and the window page it held: released, evictable again
    assert again.ok and window_places(core, A) == [] and on_device(core, A) == [0, 1, 2, 3]
    core.check_integrity(caller_device_pages=set(again.pages))


def test_a_device_page_gets_its_evicted_window_page_back_from_host():
    core, port = shared_core(window=6, host=16, write_policy="write_through")  # boundary 4 reads pages 2 and 3
    commit_all(core, A)
    core.wait_idle()  # backed up: host copies of the pages and their windows
    got = core.alloc_device(4)  # the four device window pages go; the pages stay on device
    assert got.ok and window_places(core, A) == [] and on_device(core, A) == [0, 1, 2, 3]
    assert window_places(core, A, Tier.HOST) == [0, 1, 2, 3]
    core.free_device(got.pages)
    port.plans.clear()
    req = core.begin(A)
    assert (req.num_cached, req.device_hit, sorted(req.groups["swa"])) == (4, 4, [2, 3])
    loads = [p for p in port.plans if (p.src, p.dst) == (Tier.HOST, Tier.DEVICE)]
    assert len(loads) == 1 and loads[0].num_pages == 0  # no page moved: only the two window pages
    (run,) = loads[0].groups
    host = core.component("swa").at[Tier.HOST]
    assert run.group == "swa" and run.src_pages == tuple(host[n] for n in nodes_of(core, A)[2:4]) and run.at == ()
    assert core.component("swa").filled == 0  # counted when the load completes
    req.abort()
    core.wait_idle()
    swa = core.component("swa")
    assert (swa.filled, swa.loaded, core.stats.loaded_pages) == (2, 0, 0)  # fills apart: no page loaded, nor one beside a page
    core.check_integrity(idle=True)


def test_a_fill_of_pages_above_the_boundary_locks_and_releases_what_it_brings():
    core, port = shared_core(window=40, write_policy="write_through")  # every page's window page is read
    commit_all(core, A)
    core.wait_idle()
    got = core.alloc_device(2)  # window pages 0 and 1 go; 2 and 3 stay on device
    assert window_places(core, A) == [2, 3]
    core.free_device(got.pages)
    port.plans.clear()
    req = core.begin(A)
    (load,) = [p for p in port.plans if (p.src, p.dst) == (Tier.HOST, Tier.DEVICE)]
    assert load.num_pages == 0 and len(load.groups[0].src_pages) == 2 and sorted(req.groups["swa"]) == [0, 1, 2, 3]
    req.abort()
    core.wait_idle()
    core.check_integrity(idle=True)  # no lock left behind on the path


def test_making_device_room_for_a_load_never_evicts_the_host_window_pages_it_reads():
    # A and its window pages on host, its boundary's window page the oldest thing there; then D's pages on
    # host (newer), and C's pages filling the device. Loading A evicts two of C's pages, whose backups need
    # host room: what no request reads may go, never the window page A's load reads (before the load held
    # it, it went first, and A hit nothing)
    core, _ = shared_core(window=2, dev=8, host=10)  # a boundary reads its last page's window page only
    commit_all(core, A)
    for k in (1, 2, 3):  # boundaries 1-3 read window pages 0-2: more recent than page 3's
        core.begin(A[: k * PAGE]).abort()
    assert core.evict_device(4).evicted == 4 and window_places(core, A, Tier.HOST) == [0, 1, 2, 3]
    D, C = list(range(7000, 7000 + 2 * PAGE)), list(range(5000, 5000 + 6 * PAGE))
    commit_all(core, D, windows=[])
    assert core.evict_device(2).evicted == 2 and core.host_alloc.num_free == 0  # host: A (8 ids) and D (2)
    commit_all(core, C, windows=[])
    assert core.dev_alloc.num_free == 2
    req = core.begin(A)
    assert (req.num_cached, sorted(req.groups["swa"])) == (4, [3])  # whole, its boundary's window page came along
    assert 3 in window_places(core, A, Tier.HOST)  # the room came from window pages no request reads
    req.abort()
    core.wait_idle()
    core.check_integrity(idle=True)


def test_without_a_host_copy_the_match_stops_where_the_window_pages_are():
    core, _ = shared_core(window=6, write_policy="write_back")  # nothing on host
    commit_all(core, A)
    assert core.alloc_device(3).ok  # windows 0, 1, 2 go: boundary 4 lacks page 2's, boundary 3 page 1's ...
    m = core.match(A)
    assert (len(m.nodes), m.limited_by) == (0, "swa")


def test_a_failed_fill_drops_the_objects_it_brought_and_keeps_the_pages():
    core, port = shared_core(window=6, write_policy="write_through", port=FailingLoads())
    commit_all(core, A)
    core.wait_idle()
    got = core.alloc_device(4)
    core.free_device(got.pages)
    req = core.begin(A)
    # the window pages it needed are garbage: no boundary it holds window pages for is left
    assert (req.wait(), req.failed, req.groups["swa"]) == (0, 4, {})
    assert on_device(core, A) == [0, 1, 2, 3]  # the pages were never touched
    assert window_places(core, A) == [] and core.quarantined_group_pages() != {}
    core.check_integrity(caller_group_pages={})
    req.abort()
    core.wait_idle()
    core.check_integrity(idle=True)  # the quarantine let go once nobody could name them
    assert core.dev_alloc.num_free == 4


def test_what_sharing_refuses():
    model, full = hybrid_model(2, True)
    device, host = PageAllocator(8), PageAllocator(8)
    own = (PageAllocator(8), PageAllocator(8))

    def core(pools):
        return CacheCore(full, device, host, AccountingExecutor(), model=model, group_pools=pools)

    with pytest.raises(ConfigError, match="one tier only"):
        core({"swa": (device, own[1]), "ssm": own})
    with pytest.raises(ConfigError, match="only sliding-window groups"):
        core({"swa": own, "ssm": (device, host)})
    big = ModelSpec("big", 3, (KVGroup("full", "full", (0,), attention=full),
                               KVGroup("swa", "sliding_window", (1, 2), attention=full.with_(num_layers=2), window=2)))
    with pytest.raises(ConfigError, match="fits a full page's slot"):
        CacheCore(full, device, host, AccountingExecutor(), model=big, group_pools={"swa": (device, host)})


# ---- the bytes -----------------------------------------------------------------------------------------
TOKENS = list(range(700, 700 + 6 * P))
MODES = ("one process", "two processes")


def build_shared(mode: str, root=None, dev: int = 12, host: int = 24):
    storage = StorageConfig(url=f"file://{root}", write_policy="write_through", min_prefetch_pages=1) if root else StorageConfig()
    ns = Namespace("gpt-like", GPT_LIKE.fingerprint())
    config = CacheConfig(write_policy="write_through")
    ssm = GPT_LIKE.group("ssm").object_spec()
    if mode == "one process":
        device, host_pool = DevicePool(SPEC, dev), HostPool(SPEC, host)
        pools = {"swa": (device, host_pool), "ssm": (DevicePool(ssm, dev), HostPool(ssm, host))}
        return HierarchicalCache(device, host_pool, config, namespace=ns, storage=open_storage_tier(storage, host_pool, ns),
                                 storage_config=storage, model=GPT_LIKE, group_pools=pools, state_every=2)
    from kvtier.executors.pipe import PipeExecutor, WorkerSpec

    port = PipeExecutor(WorkerSpec(SPEC, dev, host, storage=storage, namespace=ns, model=GPT_LIKE, group_pages={"ssm": (dev, host)},
                                   shared_groups=("swa",)))
    device, host_ids = PageAllocator(dev, "device"), PageAllocator(host, "host")
    return CacheCore(SPEC, device, host_ids, port, config, storage, namespace=ns, model=GPT_LIKE,
                     group_pools={"swa": (device, host_ids), "ssm": (PageAllocator(dev), PageAllocator(host))}, state_every=2)


def _scribble(executor, slots: list[int]) -> None:
    """Another request's bytes in ``slots`` of the shared device pool."""
    for s in slots:
        _write(executor, "full", s, ("someone else", s))


def check_served(cache, req, pages: int) -> None:
    """Its pages and the objects it was given hold their own bytes."""
    assert req.wait() == pages
    for i, page in enumerate(req.cached_pages):
        assert cache.port.run(_bytes, "full", page) == expected(SPEC, ("full", req.keys[i])), f"page {i}"
    for c in cache.components:
        spec = c.group.object_spec()
        for place, gid in req.groups[c.name].items():
            assert cache.port.run(_bytes, c.name, gid) == expected(spec, (c.name, req.keys[place])), f"{c.name} object {place}"


@pytest.mark.parametrize("mode", MODES)
def test_window_pages_evicted_from_a_shared_pool_come_back_from_host_bit_exact(mode):
    cache = build_shared(mode)
    try:
        compute(cache, TOKENS)  # 6 pages + 6 window pages in the 12 shared device slots
        cache.wait_idle()
        got = cache.alloc_device(6)  # equal recency: the six window pages go, the pages stay
        assert got.ok and sorted(on_device(cache, TOKENS)) == list(range(6))
        cache.port.run(_scribble, got.pages)  # their slots now hold another request's bytes
        cache.free_device(got.pages)
        req = cache.begin(TOKENS)
        check_served(cache, req, 6)  # pages from device, window pages 4 and 5 from host, the snapshot at 6
        assert sorted(req.groups["swa"]) == [4, 5] and cache.component("swa").filled == 2
        req.abort()
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_restarted_cache_with_shared_pools_hits_l3_bit_exact(tmp_path, mode):
    first = build_shared(mode, tmp_path)
    try:
        compute(first, TOKENS)
        first.wait_idle()
    finally:
        first.close()
    cache = build_shared(mode, tmp_path)
    try:
        cache.port.run(_garbage)
        req = cache.begin(TOKENS)
        assert req.served(6) == (0, 0, 6)
        check_served(cache, req, 6)  # window pages fetched into the shared host pool, loaded into the shared device pool
        assert cache.component("swa").fetched == 2
        req.abort()
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()


def test_build_hybrid_cache_shares_a_window_group_whose_page_is_a_full_page():
    gpt = HYBRID_PRESETS["gpt-oss-120b"]
    small = ModelSpec(gpt.name, gpt.num_layers, tuple(
        g if g.attention is None else KVGroup(g.name, g.kind, g.layers, attention=g.attention.with_(page_size=16), window=g.window)
        for g in gpt.groups))
    tiers = TierConfig(device_pages=8, host_pages=16)
    shared = build_hybrid_cache(small, tiers)
    own = build_hybrid_cache(small, tiers, share_window_pools=False)
    try:
        assert shared.group_pools["sliding"] == (shared.device, shared.host) and shared.component("sliding").sharing
        assert own.group_pools["sliding"][0] is not own.device and not own.component("sliding").sharing
    finally:
        shared.close()
        own.close()
    with pytest.raises(SpecError, match="not full pages"):
        from kvtier.executors.pipe import WorkerSpec

        WorkerSpec(SPEC, 4, 4, model=ModelSpec("m", 3, (KVGroup("full", "full", (0, 1), attention=SPEC),
                                                        KVGroup("w", "sliding_window", (2,), attention=SPEC.with_(num_layers=1),
                                                                window=2))), shared_groups=("w",)).build()
