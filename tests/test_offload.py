"""OffloadCache: host + L3 tiers behind engine-owned device memory (what the vLLM connector uses)."""

import torch

from kvtier.config import StorageConfig
from kvtier.hashing import Namespace
from kvtier.core.engine_device import HostLookup
from kvtier.pools import DevicePool
from support.offload import SPEC, engine_tensors, keys, make


def blocks(tensors, ids):
    return [torch.stack([t[i] for t in tensors]) for i in ids]


def test_wrap_rejects_wrong_shapes():
    import pytest

    from kvtier.errors import SpecError

    with pytest.raises(SpecError, match="layer 0 is"):
        DevicePool.wrap(SPEC, {"kv": [torch.zeros(12, 2, 4, 15, dtype=torch.bfloat16)] * 3})
    with pytest.raises(SpecError, match="3 layers"):
        DevicePool.wrap(SPEC, {"kv": engine_tensors()[:2]})


def test_host_round_trip_bit_exact_layer_by_layer():
    src = engine_tensors(seed=0)
    cache = make(src)
    k = keys(4)
    assert cache.save(k, [5, 2, 9, 0]).saved == 4
    dst = [torch.zeros_like(t) for t in src]
    cache2_device = DevicePool.wrap(SPEC, {"kv": dst})
    cache.engine.device = cache2_device  # load into another engine's memory (same spec)
    ld = cache.load(k, [1, 3, 4, 11])
    for layer in range(SPEC.num_layers):
        ld.wait_layer(layer)
    cache.release(ld)
    assert ld.loaded == 4 and ld.from_host == 4
    for a, b in zip(blocks(src, [5, 2, 9, 0]), blocks(dst, [1, 3, 4, 11])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    cache.check_integrity()
    cache.close()


def test_l3_round_trip_into_a_new_cache(tmp_path):
    url = f"file://{tmp_path}/store"
    src = engine_tensors(seed=3)
    with make(src, url=url) as a:
        a.save(keys(5), [0, 1, 2, 3, 4])
        assert a.drain()
    dst = [torch.zeros_like(t) for t in src]
    with make(dst, url=url) as b:  # a fresh process's view: empty host, same store
        found = b.lookup(keys(6))
        assert (found.host_pages, found.storage_pages) == (0, 5)
        ld = b.load(keys(5), [7, 8, 9, 10, 11])
        b.release(ld)
        assert (ld.loaded, ld.from_storage) == (5, 5)
        for x, y in zip(blocks(src, [0, 1, 2, 3, 4]), blocks(dst, [7, 8, 9, 10, 11])):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
        b.check_integrity()


def test_lru_evicts_leaves_first_and_keeps_prefixes():
    src = engine_tensors()
    cache = make(src, host_pages=6)
    a, b = keys(4, seed=1), keys(4, seed=1000)
    cache.save(a, [0, 1, 2, 3])
    cache.save(b[:2], [4, 5])
    cache.lookup(a)  # a is now more recent than b
    # b's last two pages need room; b's own held pages are not candidates, so a's *leaves* go
    assert cache.save(b, [4, 5, 6, 7]).saved == 2
    assert cache.lookup(a).host_pages == 2, "a's root pages survive; its deepest pages were evicted"
    assert cache.lookup(b).host_pages == 4
    assert cache.stats.evicted_pages == 2
    cache.check_integrity()
    cache.close()


def test_locked_pages_are_not_evicted_and_shortfall_is_reported():
    src = engine_tensors()
    cache = make(src, host_pages=4)
    a = keys(4)
    cache.save(a, [0, 1, 2, 3])
    ld = cache.load(a, [8, 9, 10, 11])  # locks all four host pages
    result = cache.save(keys(2, seed=500), [4, 5])
    assert (result.saved, result.no_space) == (0, 2), "no room while every page is locked"
    cache.release(ld)
    assert cache.save(keys(2, seed=500), [4, 5]).saved == 2
    short = cache.load(a, [8, 9, 10, 11])
    cache.release(short)
    assert short.loaded < 4 and cache.stats.load_shortfall == 4 - short.loaded
    cache.check_integrity()
    cache.close()


# ---- the same policy with the bytes in another process (the scheduler/worker split) ----------
def _fill_blocks(executor, blocks, seed):
    """Worker side: the engine computes KV into its blocks (deterministic bytes per block)."""
    g = torch.Generator().manual_seed(seed)
    dev = executor.engine.device
    for b in dev.spec.buffers:
        for layer in range(dev.spec.num_layers):
            rows = dev.rows(b.name, layer)
            for blk in blocks:
                rows[blk].view(torch.uint8).copy_(torch.randint(0, 256, (b.page_bytes,), dtype=torch.uint8, generator=g))


def _read_blocks(executor, blocks):
    return [executor.engine.device.page_bytes(b) for b in blocks]


def _split_core(url, host_pages=8):
    from kvtier.alloc import PageAllocator
    from kvtier.config import CacheConfig
    from kvtier.core.engine_device import EngineDeviceCore
    from kvtier.executors.pipe import PipeExecutor, WorkerSpec

    ns = Namespace("m", SPEC.fingerprint())
    storage = StorageConfig(url=url)
    port = PipeExecutor(WorkerSpec(SPEC, 12, host_pages, "page_first", storage=storage, namespace=ns))
    return EngineDeviceCore(SPEC, PageAllocator(host_pages, "host pool"), port,
                            CacheConfig(preallocate_nodes=False), storage, namespace=ns), port


def test_engine_device_core_with_its_executor_in_another_process(tmp_path):
    """The shape of a multi-process engine: the policy here (scheduler), the blocks, host pages and L3
    client in a worker process; only plans and completions cross. Bytes compared bit-exact after a
    host round trip, and after an L3 round trip into a fresh worker."""
    url = f"file://{tmp_path}/store"
    core, port = _split_core(url)
    port.run(_fill_blocks, [0, 1, 2, 3, 4], 7)
    computed = port.run(_read_blocks, [0, 1, 2, 3, 4])
    assert core.offload(keys(5), [0, 1, 2, 3, 4]).saved == 5
    ld = core.load_into(keys(5), [7, 8, 9, 10, 11])
    for layer in range(SPEC.num_layers):
        ld.wait_layer(layer)
    core.release(ld)
    assert (ld.loaded, ld.from_host, ld.ok) == (5, 5, True)
    assert port.run(_read_blocks, [7, 8, 9, 10, 11]) == computed
    core.wait_idle()
    core.check_integrity(idle=True)
    assert core.stats.storage_saved_pages == 5
    core.close()
    fresh, port2 = _split_core(url)
    assert fresh.lookup(keys(6)) == HostLookup(0, 5, probed=True)  # the store was asked
    ld = fresh.load_into(keys(5), [1, 2, 3, 4, 5])
    fresh.release(ld)
    assert (ld.loaded, ld.from_storage) == (5, 5)
    assert port2.run(_read_blocks, [1, 2, 3, 4, 5]) == computed
    fresh.wait_idle()
    fresh.check_integrity(idle=True)
    fresh.close()


def test_offload_misuse_is_typed_and_changes_nothing():
    import pytest

    from kvtier.errors import ConfigError, PageIndexError

    cache = make(engine_tensors(), host_pages=4)
    cache.save(keys(2), [0, 1])
    before = (cache.num_host_pages_used, cache.lookup(keys(2)))
    with pytest.raises(ConfigError, match="3 page keys but 2 device pages"):
        cache.save(keys(3), [0, 1])
    with pytest.raises(PageIndexError):
        cache.load(keys(2), [0, 99])
    assert (cache.num_host_pages_used, cache.lookup(keys(2))) == before
    cache.check_integrity()
    cache.close()


def test_asynchronous_offload_counts_pages_once_the_copy_completes():
    """``wait=False`` (what a scheduler whose workers copy needs): the pages are cached only when
    the copy's completion arrives; a copy that fails leaves nothing behind."""
    src = engine_tensors(seed=5)
    cache = make(src)
    core = cache.core
    r = core.offload(keys(3), [4, 5, 6], wait=False)
    assert r.saved == 3 and r.copy_op is not None
    core.wait_for([r.copy_op])
    assert all(core.holds(k) for k in keys(3)) and core.lookup(keys(3)).host_pages == 3
    # a copy the executor refuses (no engine block 40) completes as Failed: nothing cached, nothing leaked
    bad = core.offload(keys(2, seed=900), [1, 40], wait=False)
    core.wait_for([bad.copy_op])
    assert not any(core.holds(k) for k in keys(2, seed=900)) and core.stats.transfer_failures == 1
    core.wait_idle()
    core.check_integrity(idle=True)
    assert cache.num_host_pages_used == 3
    ld = cache.load(keys(3), [8, 9, 10])
    cache.release(ld)
    for a, b in zip(blocks(src, [4, 5, 6]), blocks(src, [8, 9, 10])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    cache.close()
