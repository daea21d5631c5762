"""A hybrid model's bytes through the tiers, bit-exact: full-attention pages, sliding-window pages
and state snapshots go to host and come back, each in its own pools, moved by the plans that move
their pages; a load back brings only the window and the snapshot the boundary reads."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvtier import DevicePool, HostPool
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig
from kvtier.core import Tier
from kvtier.core.hybrid_match import window_pages
from kvtier.errors import SpecError
from kvtier.groups import KVGroup, ModelSpec, StateTensor
from kvtier.spec import KVSpec

P = 4
FULL = KVSpec.mla("hy-full", 2, kv_lora_rank=16, qk_rope_dim=8, page_size=P)
SWA = KVSpec.mha("hy-swa", 2, kv_heads=2, head_dim=8, page_size=P)
MODEL = ModelSpec("hy", 5, (
    KVGroup("full", "full", (0, 3), attention=FULL),
    KVGroup("swa", "sliding_window", (1, 4), attention=SWA, window=6),
    KVGroup("ssm", "state", (2,), state=(StateTensor("conv", (6, 3), "float32"), StateTensor("h", (2, 4, 4), "bfloat16"))),
))
TOKENS = list(range(500, 500 + 6 * P))


def payload(key: object, nbytes: int) -> torch.Tensor:
    seed = xxhash.xxh64_intdigest(repr(key).encode()) & 0x7FFFFFFF
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def write(pool: DevicePool, slot: int, key: object) -> None:
    for layer in range(pool.spec.num_layers):
        for b in pool.spec.buffers:
            pool.rows(b.name, layer)[slot].view(torch.uint8).copy_(payload((key, layer, b.name), b.page_bytes))


def expected(spec: KVSpec, key: object) -> bytes:
    parts = [payload((key, layer, b.name), b.page_bytes) for layer in range(spec.num_layers) for b in spec.buffers]
    return torch.cat(parts).numpy().tobytes()


def build(dev: int = 8, host: int = 16) -> HierarchicalCache:
    pools = {g.name: (DevicePool(g.object_spec(), dev), HostPool(g.object_spec(), host)) for g in MODEL.groups if g.kind != "full"}
    return HierarchicalCache(DevicePool(FULL, dev), HostPool(FULL, host), CacheConfig(write_policy="write_back"), model=MODEL,
                             group_pools=pools, state_every=2)


def compute(cache: HierarchicalCache, tokens: list[int]):
    """A request that computes every page it does not have, its window pages and its snapshots."""
    req = cache.begin(tokens)
    full = len(req.keys)
    new = req.alloc(full - req.num_cached)
    for j, page in enumerate(new.pages):
        write(cache.device, page, ("full", req.keys[req.num_cached + j]))
    groups = {}
    for c in cache.components:
        pool = cache.group_pools[c.name][0]
        places = [b - 1 for b in req.snapshot_boundaries()] if c.is_state else list(range(req.num_cached, full))
        ids: list[int | None] = [None] * full
        for place, gid in zip(places, req.alloc_group(c.name, len(places))):
            write(pool, gid, (c.name, req.keys[place]))
            ids[place] = gid
        groups[c.name] = ids
    req.commit(req.cached_pages + new.pages, groups)
    return req


def test_object_specs_hold_each_groups_bytes():
    assert MODEL.group("swa").object_spec() == SWA
    state = MODEL.group("ssm").object_spec()
    assert state.attention == "state" and state.page_size == 1 and state.num_layers == 1
    assert state.page_bytes == 6 * 3 * 4 + 2 * 4 * 4 * 2 == MODEL.group("ssm").state_bytes
    with pytest.raises(SpecError):
        KVSpec("bad", "state", 1, 4, "uint8", state_bytes=8)  # a snapshot is one slot


def test_every_groups_bytes_come_back_from_host_bit_exact_and_only_what_the_boundary_reads():
    cache = build()
    try:
        compute(cache, TOKENS)
        cache.evict_device(6)  # write_back: pages and objects backed up to host, then off the device
        cache.wait_idle()
        assert cache.dev_alloc.num_used == 0 and all(not c.at[Tier.DEVICE] for c in cache.components)
        for pool in [cache.device] + [dev for dev, _ in cache.group_pools.values()]:  # garbage where the bytes were
            for layer in range(pool.spec.num_layers):
                for b in pool.spec.buffers:
                    pool.rows(b.name, layer).view(torch.uint8).fill_(0xEE)
        before = {c.name: c.loaded for c in cache.components}
        req = cache.begin(TOKENS)
        assert req.wait() == 6 and req.served(6) == (0, 6, 0)
        for i, page in enumerate(req.cached_pages):
            assert cache.device.page_bytes(page) == expected(FULL, ("full", req.keys[i])), f"page {i}"
        swa_dev, ssm_dev = cache.group_pools["swa"][0], cache.group_pools["ssm"][0]
        assert sorted(req.groups["swa"]) == list(window_pages(MODEL.group("swa"), 6, P)) == [4, 5]
        assert sorted(req.groups["ssm"]) == [5]
        for place, gid in req.groups["swa"].items():
            assert swa_dev.page_bytes(gid) == expected(SWA, ("swa", req.keys[place])), f"window page {place}"
        (gid,) = req.groups["ssm"].values()
        assert ssm_dev.page_bytes(gid) == expected(ssm_dev.spec, ("ssm", req.keys[5]))
        # bytes moved per group: the window's two pages, one snapshot -- not all six pages' objects
        assert {c.name: c.loaded - before[c.name] for c in cache.components} == {"swa": 2, "ssm": 1}
        req.commit(req.cached_pages, {})
        cache.check_integrity(idle=True)
    finally:
        cache.close()


def test_a_shorter_prompt_reuses_the_snapshot_kept_on_its_boundary():
    cache = build()
    try:
        compute(cache, TOKENS)
        req = cache.begin(TOKENS[: 4 * P])  # snapshots at 2, 4, 6 (state_every=2): boundary 4 has one
        assert req.num_cached == 4 and sorted(req.groups["ssm"]) == [3] and sorted(req.groups["swa"]) == [2, 3]
        ssm_dev = cache.group_pools["ssm"][0]
        assert ssm_dev.page_bytes(req.groups["ssm"][3]) == expected(ssm_dev.spec, ("ssm", req.keys[3]))
        req.abort()
        req = cache.begin(TOKENS[: 3 * P] + [1, 2, 3, 4])  # boundary 3 has no snapshot: back to 2
        assert req.num_cached == 2
        req.abort()
    finally:
        cache.close()


def test_group_pools_must_be_built_from_the_groups_object_spec():
    pools = {"swa": (DevicePool(FULL, 4), HostPool(FULL, 4)),
             "ssm": (DevicePool(MODEL.group("ssm").object_spec(), 4), HostPool(MODEL.group("ssm").object_spec(), 4))}
    with pytest.raises(SpecError, match="object_spec"):
        HierarchicalCache(DevicePool(FULL, 4), HostPool(FULL, 4), model=MODEL, group_pools=pools)


# ---- L3: every group's objects under their own keys, a hit only where all of them are there ----------
def build_with_store(root, dev: int = 8, host: int = 16) -> HierarchicalCache:
    from kvtier.build import open_storage_tier
    from kvtier.config import StorageConfig
    from kvtier.hashing import Namespace

    storage = StorageConfig(url=f"file://{root}", write_policy="write_through", min_prefetch_pages=1)
    host_pool = HostPool(FULL, host)
    ns = Namespace("hy", MODEL.fingerprint())
    pools = {g.name: (DevicePool(g.object_spec(), dev), HostPool(g.object_spec(), host)) for g in MODEL.groups if g.kind != "full"}
    return HierarchicalCache(DevicePool(FULL, dev), host_pool, CacheConfig(write_policy="write_through"), namespace=ns,
                             storage=open_storage_tier(storage, host_pool, ns), storage_config=storage, model=MODEL, group_pools=pools,
                             state_every=2)


def _check_served(cache: HierarchicalCache, req, pages: int) -> None:
    assert req.wait() == pages
    for i, page in enumerate(req.cached_pages):
        assert cache.device.page_bytes(page) == expected(FULL, ("full", req.keys[i])), f"page {i}"
    for c in cache.components:
        dev = cache.group_pools[c.name][0]
        needed = ([pages - 1] if pages else []) if c.is_state else list(window_pages(c.group, pages, P))
        assert sorted(req.groups[c.name]) == needed
        for place, gid in req.groups[c.name].items():
            assert dev.page_bytes(gid) == expected(dev.spec, (c.name, req.keys[place])), f"{c.name} object {place}"


def test_a_restarted_cache_hits_l3_with_every_groups_objects_bit_exact(tmp_path):
    cache = build_with_store(tmp_path)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        saved = {c.name: c.saved for c in cache.components}
    finally:
        cache.close()
    assert saved == {"swa": 6, "ssm": 3}  # every window page, the snapshots at 2, 4 and 6
    fresh = build_with_store(tmp_path)
    try:
        req = fresh.begin(TOKENS)
        assert req.served(6) == (0, 0, 6)
        _check_served(fresh, req, 6)
        # from L3 only what the boundary reads: its window's pages and its snapshot
        assert {c.name: c.fetched for c in fresh.components} == {"swa": 2, "ssm": 1}
        req.commit(req.cached_pages, {})
        fresh.check_integrity(idle=True)
    finally:
        fresh.close()


@pytest.mark.parametrize("lost, hit", [("ssm", 4), ("swa", 4)])
def test_a_group_object_missing_in_l3_stops_the_hit_where_every_group_still_has_one(tmp_path, lost, hit):
    from kvtier.hashing import group_object_key

    cache = build_with_store(tmp_path)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        keys = cache.page_keys(TOKENS)
        tier = cache.storage
        tier.backend.delete([tier.key(group_object_key(keys[5], lost))])  # the snapshot at 6 / the window page 5
    finally:
        cache.close()
    fresh = build_with_store(tmp_path)
    try:
        m = fresh.match(TOKENS)
        assert m.num_storage_pages == hit
        req = fresh.begin(TOKENS)
        assert req.served(hit) == (0, 0, hit)
        _check_served(fresh, req, hit)
        req.abort()
    finally:
        fresh.close()


def test_a_corrupt_group_object_in_l3_is_a_miss_and_is_deleted(tmp_path):
    from kvtier.hashing import group_object_key

    cache = build_with_store(tmp_path)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        keys = cache.page_keys(TOKENS)
        name = cache.storage.key(group_object_key(keys[5], "ssm"))
    finally:
        cache.close()
    path = next(p for p in tmp_path.rglob("*") if p.is_file() and name.split("/")[-1] in p.name)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte in the snapshot's payload
    path.write_bytes(bytes(raw))
    fresh = build_with_store(tmp_path)
    try:
        req = fresh.begin(TOKENS)
        req.wait()
        assert req.num_cached < 6  # the snapshot at 6 failed its check: that boundary is not offered
        _check_served(fresh, req, req.num_cached)
        req.abort()
        fresh.wait_idle()
        assert not path.exists()  # deleted, so the next save repairs it
    finally:
        fresh.close()
