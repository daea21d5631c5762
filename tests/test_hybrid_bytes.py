"""A hybrid model's bytes through the tiers, bit-exact, in one process and across a process
boundary: full-attention pages, sliding-window pages and state snapshots go to host and to L3 and
come back, each in its own pools, moved by the plans that move their pages; a load brings only the
window and the snapshot its boundary reads, and a hit stops where every group still has its object."""

from __future__ import annotations

import pytest

from kvtier import DevicePool, HostPool
from kvtier.cache import HierarchicalCache
from kvtier.core import Tier
from kvtier.errors import SpecError
from kvtier.hashing import group_object_key
from kvtier.spec import KVSpec
from support.hybrid_bytes import TOKENS, _garbage, build, check_served, compute
from support.hybrid_models import FULL, MODEL, SWA, P

MODES = ("one process", "two processes")


# ---- next to the bytes (this process, or the worker) -------------------------------------------------
def _store_name(executor, key: bytes) -> str:
    return executor.storage.key(key)


def _delete(executor, key: bytes) -> None:
    executor.storage.backend.delete([executor.storage.key(key)])


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
