"""A hybrid model's bytes through the tiers, bit-exact, in one process and across a process
boundary: full-attention pages, sliding-window pages and state snapshots go to host and to L3 and
come back, each in its own pools, moved by the plans that move their pages; a load brings only the
window and the snapshot its boundary reads, and a hit stops where every group still has its object."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvtier import DevicePool, HostPool
from kvtier.alloc import PageAllocator
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import CacheCore, Tier
from kvtier.errors import SpecError
from kvtier.groups import KVGroup, ModelSpec, StateTensor
from kvtier.hashing import Namespace, group_object_key
from kvtier.spec import KVSpec
from conftest import fill_pool
from support.hybrid_rules import read_places

P = 4
FULL = KVSpec.mla("hy-full", 2, kv_lora_rank=16, qk_rope_dim=8, page_size=P)
SWA = KVSpec.mha("hy-swa", 2, kv_heads=2, head_dim=8, page_size=P)
MODEL = ModelSpec("hy", 5, (
    KVGroup("full", "full", (0, 3), attention=FULL),
    KVGroup("swa", "sliding_window", (1, 4), attention=SWA, window=6),
    KVGroup("ssm", "state", (2,), state=(StateTensor("conv", (6, 3), "float32"), StateTensor("h", (2, 4, 4), "bfloat16"))),
))
TOKENS = list(range(500, 500 + 6 * P))
MODES = ("one process", "two processes")


def payload(key: object, nbytes: int) -> torch.Tensor:
    seed = xxhash.xxh64_intdigest(repr(key).encode()) & 0x7FFFFFFF
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def expected(spec: KVSpec, key: object) -> bytes:
    parts = [payload((key, layer, b.name), b.page_bytes) for layer in range(spec.num_layers) for b in spec.buffers]
    return torch.cat(parts).numpy().tobytes()


# ---- next to the bytes (this process, or the worker): the executor's pools ---------------------------
def _pool(executor, group: str) -> DevicePool:
    return executor.engine.device if group == "full" else executor.groups[group].device


def _write(executor, group: str, slot: int, key: object) -> None:
    pool = _pool(executor, group)
    for layer in range(pool.spec.num_layers):
        for b in pool.spec.buffers:
            pool.rows(b.name, layer)[slot].view(torch.uint8).copy_(payload((key, layer, b.name), b.page_bytes))


def _bytes(executor, group: str, slot: int) -> bytes:
    return _pool(executor, group).page_bytes(slot)


def _garbage(executor) -> None:
    for group in ["full", *executor.groups]:
        fill_pool(_pool(executor, group), 0xEE)


def _store_name(executor, key: bytes) -> str:
    return executor.storage.key(key)


def _delete(executor, key: bytes) -> None:
    executor.storage.backend.delete([executor.storage.key(key)])


def build(mode: str, root=None, dev: int = 8, host: int = 16):
    """The hybrid cache, write_through to device/host and (``root``) to a file store."""
    storage = StorageConfig(url=f"file://{root}", write_policy="write_through", min_prefetch_pages=1) if root else StorageConfig()
    ns = Namespace("hy", MODEL.fingerprint())
    config = CacheConfig(write_policy="write_through")
    others = [g for g in MODEL.groups if g.kind != "full"]
    if mode == "one process":
        from kvtier.build import open_storage_tier

        host_pool = HostPool(FULL, host)
        pools = {g.name: (DevicePool(g.object_spec(), dev), HostPool(g.object_spec(), host)) for g in others}
        return HierarchicalCache(DevicePool(FULL, dev), host_pool, config, namespace=ns, storage=open_storage_tier(storage, host_pool, ns),
                                 storage_config=storage, model=MODEL, group_pools=pools, state_every=2)
    from kvtier.executors.pipe import PipeExecutor, WorkerSpec

    port = PipeExecutor(WorkerSpec(FULL, dev, host, storage=storage, namespace=ns, model=MODEL,
                                   group_pages={g.name: (dev, host) for g in others}))
    return CacheCore(FULL, PageAllocator(dev, "device"), PageAllocator(host, "host"), port, config, storage, namespace=ns, model=MODEL,
                     group_pools={g.name: (PageAllocator(dev), PageAllocator(host)) for g in others}, state_every=2)


def compute(cache, tokens: list[int]):
    """A request that computes every page it does not have, its window pages and its snapshots."""
    req = cache.begin(tokens)
    full = len(req.keys)
    new = req.alloc(full - req.num_cached)
    for j, page in enumerate(new.pages):
        cache.port.run(_write, "full", page, ("full", req.keys[req.num_cached + j]))
    groups = {}
    for c in cache.components:
        places = req.handed_places(c.name)
        ids: list[int | None] = [None] * full
        for place, gid in zip(places, req.alloc_group(c.name, len(places))):
            cache.port.run(_write, c.name, gid, (c.name, req.keys[place]))
            ids[place] = gid
        groups[c.name] = ids
    req.commit(req.cached_pages + new.pages, groups)
    return req


def check_served(cache, req, pages: int) -> None:
    """The request's cached pages and the objects it was given hold their own bytes, and it was given
    exactly what its boundary reads."""
    assert req.wait() == pages
    for i, page in enumerate(req.cached_pages):
        assert cache.port.run(_bytes, "full", page) == expected(FULL, ("full", req.keys[i])), f"page {i}"
    for c in cache.components:
        needed = read_places(c.group, pages, P)
        assert sorted(req.groups[c.name]) == needed
        spec = c.group.object_spec()
        for place, gid in req.groups[c.name].items():
            assert cache.port.run(_bytes, c.name, gid) == expected(spec, (c.name, req.keys[place])), f"{c.name} object {place}"


def test_object_specs_hold_each_groups_bytes():
    assert MODEL.group("swa").object_spec() == SWA
    state = MODEL.group("ssm").object_spec()
    assert state.attention == "state" and state.page_size == 1 and state.num_layers == 1
    assert state.page_bytes == 6 * 3 * 4 + 2 * 4 * 4 * 2 == MODEL.group("ssm").state_bytes
    with pytest.raises(SpecError):
        KVSpec("bad", "state", 1, 4, "uint8", state_bytes=8)  # a snapshot is one slot


@pytest.mark.parametrize("mode", MODES)
def test_every_groups_bytes_come_back_from_host_bit_exact_and_only_what_the_boundary_reads(mode):
    cache = build(mode)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        cache.evict_device(6)  # every page and object has a host copy (write_through): off the device
        assert cache.dev_alloc.num_used == 0 and all(not c.at[Tier.DEVICE] for c in cache.components)
        cache.port.run(_garbage)  # garbage where the bytes were
        before = {c.name: c.loaded for c in cache.components}
        req = cache.begin(TOKENS)
        assert req.served(6) == (0, 6, 0)
        check_served(cache, req, 6)
        # bytes moved per group: the window's two pages, one snapshot -- not all six pages' objects
        assert {c.name: c.loaded - before[c.name] for c in cache.components} == {"swa": 2, "ssm": 1}
        req.commit(req.cached_pages, {})
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()


def test_a_shorter_prompt_reuses_the_snapshot_kept_on_its_boundary():
    cache = build("one process")
    try:
        compute(cache, TOKENS)
        req = cache.begin(TOKENS[: 4 * P])  # snapshots at 2, 4, 6 (state_every=2): boundary 4 has one
        assert req.num_cached == 4
        check_served(cache, req, 4)
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
@pytest.mark.parametrize("mode", MODES)
def test_a_restarted_cache_hits_l3_with_every_groups_objects_bit_exact(tmp_path, mode):
    cache = build(mode, tmp_path)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        saved = {c.name: c.saved for c in cache.components}
    finally:
        cache.close()
    assert saved == {"swa": 6, "ssm": 3}  # every window page, the snapshots at 2, 4 and 6
    fresh = build(mode, tmp_path)
    try:
        req = fresh.begin(TOKENS)
        assert req.served(6) == (0, 0, 6)
        check_served(fresh, req, 6)
        # from L3 only what the boundary reads: its window's pages and its snapshot
        assert {c.name: c.fetched for c in fresh.components} == {"swa": 2, "ssm": 1}
        req.commit(req.cached_pages, {})
        fresh.wait_idle()
        fresh.check_integrity(idle=True)
    finally:
        fresh.close()


@pytest.mark.parametrize("lost, hit", [("ssm", 4), ("swa", 4)])
def test_a_group_object_missing_in_l3_stops_the_hit_where_every_group_still_has_one(tmp_path, lost, hit):
    cache = build("one process", tmp_path)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        cache.port.run(_delete, group_object_key(cache.page_keys(TOKENS)[5], lost))  # the snapshot at 6 / window page 5
    finally:
        cache.close()
    fresh = build("one process", tmp_path)
    try:
        assert fresh.match(TOKENS).num_storage_pages == hit
        req = fresh.begin(TOKENS)
        assert req.served(hit) == (0, 0, hit)
        check_served(fresh, req, hit)
        req.abort()
    finally:
        fresh.close()


def test_a_corrupt_group_object_in_l3_is_a_miss_and_is_deleted(tmp_path):
    cache = build("one process", tmp_path)
    try:
        compute(cache, TOKENS)
        cache.wait_idle()
        name = cache.port.run(_store_name, group_object_key(cache.page_keys(TOKENS)[5], "ssm"))
    finally:
        cache.close()
    path = next(p for p in tmp_path.rglob("*") if p.is_file() and name.split("/")[-1] in p.name)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte in the snapshot's payload
    path.write_bytes(bytes(raw))
    fresh = build("one process", tmp_path)
    try:
        req = fresh.begin(TOKENS)
        req.wait()
        assert req.num_cached < 6  # the snapshot at 6 failed its check: that boundary is not offered
        check_served(fresh, req, req.num_cached)
        req.abort()
        fresh.wait_idle()
        assert not path.exists()  # deleted, so the next save repairs it
    finally:
        fresh.close()
