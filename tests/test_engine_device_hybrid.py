"""The engine-device core (the engine owns every group's device blocks: vLLM's hybrid KV cache
manager) with a hybrid model: full pages, sliding-window pages and state snapshots go out of the
engine's ids to host and L3 and come back into other engine ids bit-exact; a load copies only what
its boundary reads, stops where a group's object is missing (or the engine gave no id for it), and
a window the engine no longer holds is not copied out."""

from __future__ import annotations

import pytest

from kvtier.errors import PageAlignmentError, PageIndexError
from kvtier.hashing import group_object_key
from support.engine_device_hybrid import DEV, build, check_loaded, computed, keys_of, on_worker
from support.hybrid_bytes import _bytes, _garbage
from support.hybrid_models import FULL, MODEL

MODES = ("one process", "two processes")


def _delete_object(executor, group: str, key: bytes) -> None:
    tier = executor.group_storage[group]
    tier.backend.delete([tier.key(key)])


@pytest.mark.parametrize("mode", MODES)
def test_offload_then_load_into_other_engine_ids_bit_exact(mode):
    core = build(mode)
    keys = keys_of(core, 6)
    blocks, groups = computed(core, keys, 0)
    r = core.offload(keys, blocks, wait=False, groups=groups)
    assert r.saved == 6
    core.wait_for([r.copy_op])
    assert core.component("swa").stats()["host_objects"] == 6 and core.component("ssm").stats()["host_objects"] == 3
    assert core.lookup(keys) == core.lookup(keys)  # (a lookup changes nothing a second one sees)
    assert core.lookup(keys).host_pages == 6
    on_worker(core, _garbage)
    dst = list(range(10, 16))
    want = {"swa": [None] * 4 + [14, 15], "ssm": [None] * 5 + [15]}  # vLLM's window blocks, the state slot at the end
    load = core.plan_load(keys, dst, groups=want)
    core.wait_for([load.op])
    assert load.ok and load.loaded == 6
    check_loaded(core, keys, load, 0, dst, want)
    assert core.component("swa").stats()["loaded"] == 2 and core.component("ssm").stats()["loaded"] == 1
    core.wait_idle()
    core.check_integrity(idle=True)
    core.close()


@pytest.mark.parametrize("mode", MODES)
def test_load_stops_where_an_object_is_missing_or_the_engine_has_no_id_for_it(mode):
    core = build(mode)
    keys = keys_of(core, 6)
    blocks, groups = computed(core, keys, 0, window_from=2)  # the engine no longer held window pages 0, 1
    r = core.offload(keys, blocks, wait=False, groups=groups)
    core.wait_for([r.copy_op])
    assert core.component("swa").stats()["host_objects"] == 4  # only what the engine still had went out
    found = core.lookup(keys[:3])
    assert (found.host_pages, found.limited_by) == (0, "swa")  # boundaries 1..3 read window pages below 3 (window 6 tokens)
    assert core.lookup(keys).host_pages == 6
    # no window block for page 5 (boundary 6 reads pages 4, 5) and no state slot at boundary 5: the load stops at 4
    on_worker(core, _garbage)
    dst = list(range(10, 16))
    want = {"swa": [None, None, 12, 13, 14, None], "ssm": [None, None, None, 13, None, 15]}
    load = core.plan_load(keys, dst, groups=want)
    core.wait_for([load.op])
    assert load.loaded == 4 and load.ok
    check_loaded(core, keys, load, 0, dst, want)
    # the engine holds the first 4 pages itself (first=4): only pages 4, 5 and their objects move
    on_worker(core, _garbage)
    want = {"swa": [None] * 4 + [14, 15], "ssm": [None] * 5 + [15]}
    load = core.plan_load(keys, dst, first=4, groups=want)
    core.wait_for([load.op])
    assert load.loaded == 6
    check_loaded(core, keys, load, 4, dst, want)
    assert on_worker(core, _bytes, "full", dst[3]) == bytes([0xEE]) * FULL.page_bytes  # the engine's own page: not written
    core.wait_idle()
    core.check_integrity(idle=True)
    core.close()


@pytest.mark.parametrize("mode", MODES)
def test_l3_round_trip_into_a_fresh_core_needs_every_groups_objects(mode, tmp_path):
    core = build(mode, tmp_path)
    keys = keys_of(core, 6)
    blocks, groups = computed(core, keys, 0)
    r = core.offload(keys, blocks, wait=False, groups=groups)
    core.wait_for([r.copy_op])
    core.wait_idle()
    saved = core.stats.storage_saved_pages
    core.close()
    assert saved == 6
    fresh = build(mode, tmp_path)
    found = fresh.lookup(keys)
    assert (found.host_pages, found.storage_pages, found.probed) == (0, 6, True)
    on_worker(fresh, _garbage)
    dst = list(range(10, 16))
    want = {"swa": [None] * 4 + [14, 15], "ssm": [None] * 5 + [15]}
    load = fresh.plan_load(keys, dst, groups=want)
    fresh.wait_for([load.op])
    assert load.ok and (load.loaded, load.from_storage) == (6, 6)
    check_loaded(fresh, keys, load, 0, dst, want)
    fresh.wait_idle()
    fresh.check_integrity(idle=True)
    fresh.close()
    # the snapshot at boundary 6 lost from the store: a restarted engine is offered boundary 4 (the one before)
    gone = group_object_key(keys[5], "ssm")
    third = build(mode, tmp_path)
    on_worker(third, _delete_object, "ssm", gone)
    found = third.lookup(keys)
    assert found.storage_pages == 4
    third.close()


def test_misuse_is_typed_and_changes_nothing():
    core = build("one process")
    keys = keys_of(core, 3)
    blocks, groups = computed(core, keys, 0)
    with pytest.raises(PageAlignmentError, match="one engine id"):
        core.offload(keys, blocks, groups={"swa": [1, 2]})
    with pytest.raises(PageIndexError, match="not an engine id"):
        core.offload(keys, blocks, groups={"swa": [1, -2, 3]})
    with pytest.raises(Exception, match="KV group"):
        core.offload(keys, blocks, groups={"nope": [1, 2, 3]})
    with pytest.raises(PageAlignmentError):
        core.plan_load(keys, blocks, groups={"ssm": [None]})
    assert core.lookup(keys).host_pages == 0
    core.check_integrity(idle=True)
    core.close()


def test_a_failed_copy_out_leaves_no_object_behind():
    core = build("one process")
    keys = keys_of(core, 4)
    blocks, groups = computed(core, keys, 0)
    groups["swa"][2] = DEV + 5  # not an id of the engine's window pool: the executor refuses the plan
    r = core.offload(keys, blocks, wait=False, groups=groups)
    core.wait_for([r.copy_op])
    assert core.lookup(keys).host_pages == 0 and core.stats.transfer_failures == 1
    assert all(c.stats()["host_objects"] == 0 for c in core.components)
    core.wait_idle()
    core.check_integrity(idle=True)
    core.close()


def test_window_pool_pressure_evicts_window_objects_and_the_lookup_stops_before_them():
    """A window pool smaller than the page pool: older window objects go under its own pressure
    (least recently used first), their full pages stay, and a lookup of the old prompt stops where
    its window went missing."""
    small = build("one process", window_host=4)
    a, b = keys_of(small, 4, seed=0), keys_of(small, 4, seed=7777)
    for ks, base in ((a, 0), (b, 8)):
        blocks, groups = computed(small, ks, base)
        r = small.offload(ks, blocks, wait=False, groups=groups)
        small.wait_for([r.copy_op])
    swa = small.component("swa")
    assert swa.stats()["host_objects"] == 4 and swa.evicted == 4
    assert small.lookup(b).host_pages == 4
    found = small.lookup(a)
    assert found.host_pages == 0 and found.limited_by == "swa"
    assert all(small.holds(k) for k in a)  # the full pages of the older prompt are still cached
    small.wait_idle()
    small.check_integrity(idle=True)
    small.close()


def _corrupt_page(executor, key: bytes) -> None:
    path = executor.storage.backend._path(executor.storage.key(key))
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF
    open(path, "wb").write(bytes(raw))


def test_a_hybrid_load_whose_fetch_is_cut_short_copies_nothing(tmp_path):
    """Its objects were read for its end boundary, so a fetch that stops early (a corrupt page) leaves
    the copy into the engine whole or nothing: nothing, and the engine recomputes from its own pages."""
    core = build("one process", tmp_path)
    keys = keys_of(core, 6)
    blocks, groups = computed(core, keys, 0)
    r = core.offload(keys, blocks, wait=False, groups=groups)
    core.wait_for([r.copy_op])
    core.wait_idle()
    core.close()
    fresh = build("one process", tmp_path)
    on_worker(fresh, _corrupt_page, keys[3])
    on_worker(fresh, _garbage)
    dst = list(range(10, 16))
    want = {"swa": [None] * 4 + [14, 15], "ssm": [None] * 5 + [15]}
    load = fresh.plan_load(keys, dst, groups=want)
    fresh.wait_for([load.op])
    assert load.loaded == 6 and not load.ok  # offered, then failed as a whole
    for i, b in enumerate(dst):
        assert on_worker(fresh, _bytes, "full", b) == bytes([0xEE]) * FULL.page_bytes, f"page {i} was written"
    assert on_worker(fresh, _bytes, "swa", 15) == bytes([0xEE]) * MODEL.group("swa").object_spec().page_bytes
    fresh.wait_idle()
    fresh.check_integrity(idle=True)
    # the pages that arrived stay cached on host; the fetch brought the objects of boundary 6 only, so
    # no shorter boundary is usable, and the corrupt page was dropped from the store
    assert all(fresh.holds(k) for k in keys[:3]) and not fresh.holds(keys[3])
    found = fresh.lookup(keys)
    assert (found.host_pages, found.storage_pages, found.limited_by) == (0, 0, "swa")
    fresh.close()


def test_the_engine_owned_device_core_has_no_device_object_api():
    """The engine owns the device: its core hands out no device ids of a group (an AttributeError on
    ``None`` before), while a core that owns the device does."""
    core = build("one process")
    try:
        assert not hasattr(core, "alloc_group") and not hasattr(core, "free_group")
    finally:
        core.close()
