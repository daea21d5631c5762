"""OffloadCache: host + L3 tiers behind engine-owned device memory (what the vLLM connector uses)."""

import torch

from kvtier.config import StorageConfig
from kvtier.hashing import Namespace, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.tier import StorageTier
from kvtier.offload import OffloadCache
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec

SPEC = KVSpec("smol-like", "mha", 3, 4, "bfloat16", kv_heads=2, head_dim=8, kv_layout="hnd_paired")


def engine_tensors(num_blocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, 4, 16, generator=g).to(torch.bfloat16) for _ in range(SPEC.num_layers)]


def make(tensors, host_pages=8, url=None):
    device = DevicePool.wrap(SPEC, {"kv": tensors})
    host = HostPool(SPEC, host_pages, "page_first")
    storage = None
    if url:
        ns = Namespace("m", SPEC.fingerprint())
        storage = StorageTier(open_backend(url), host, ns, batch_pages=2)
    return OffloadCache(device, host, storage, StorageConfig(url=url))


def keys(n, seed=1):
    root = Namespace("m", SPEC.fingerprint()).root()
    return page_keys(list(range(seed, seed + n * SPEC.page_size)), SPEC.page_size, root)


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
