"""The reference MLA+DSA model: outputs with cache hits from every tier equal a full recompute."""

import pytest
import torch

from kvtier import DevicePool
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.app.model.dsa import quantize, read_pages, write_tokens
from kvtier.app.engine import ReferenceEngine
from kvtier.app.model import ModelConfig, ReferenceModel
from kvtier.core import NullCache
from support.pools import loads_refused

CFG = ModelConfig(hidden=64, num_layers=3, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                  index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def test_indexer_page_format_is_exact():
    spec = CFG.kv_spec()
    dev = DevicePool(spec, 4)
    buf = dev.buffer("indexer", 0)
    keys = torch.randn(3, 32)
    q, scales = quantize(keys, 16)
    write_tokens(buf, torch.tensor([2, 2, 1]), torch.tensor([0, 5, 7]), q, scales, 8)
    row = buf[2]
    assert torch.equal(row[0:32], q[0].view(torch.uint8)) and torch.equal(row[5 * 32 : 6 * 32], q[1].view(torch.uint8))
    scale_base = 8 * 32
    assert torch.equal(row[scale_base : scale_base + 8].view(torch.float32), scales[0])
    assert torch.equal(row[scale_base + 5 * 8 : scale_base + 6 * 8].view(torch.float32), scales[1])
    assert torch.equal(buf[1][7 * 32 : 8 * 32], q[2].view(torch.uint8))
    kq, ks = read_pages(buf, torch.tensor([2]), 8, 32, 16)
    assert torch.equal(kq[5].view(torch.uint8), q[1].view(torch.uint8)) and torch.equal(ks[5], scales[1])


def engines(tmp_path, device_pages=24, host_pages=24):
    model = ReferenceModel(CFG)
    spec = CFG.kv_spec()
    base = ReferenceEngine(model, NullCache(DevicePool(spec, 64)))
    cache = build_cache(spec, TierConfig(device_pages=device_pages, host_pages=host_pages), CacheConfig(), StorageConfig(url=f"file://{tmp_path}"))
    return base, ReferenceEngine(model, cache), cache


def same(a, b):
    assert torch.equal(a.logits, b.logits)
    for sa, sb in zip(a.selections[len(a.selections) - len(b.selections):], b.selections):
        assert all(torch.equal(x, y) for x, y in zip(sa, sb)), "DSA top-k differs"


def test_outputs_with_hits_from_every_tier_equal_recompute(tmp_path):
    base, eng, cache = engines(tmp_path, device_pages=16, host_pages=16)
    system = prompt(0, 64)
    a = system + prompt(1, 37)
    # 1. cold: everything computed
    r = eng.prefill(a)
    same(base.prefill(a), r)
    assert r.computed_tokens == len(a)
    cache.wait_idle()
    # 2. device hit: same system prompt, another question
    b = system + prompt(2, 21)
    r = eng.prefill(b)
    same(base.prefill(b), r)
    assert r.device_hit_tokens == 64
    # 3. host hit: evict device, ask again
    cache.wait_idle()
    cache.evict_device(16)
    r = eng.prefill(a)
    same(base.prefill(a), r)
    assert r.host_hit_tokens > 0 and r.device_hit_tokens == 0
    # 4. storage hit: evict device and host; pages come back from the file store
    cache.wait_idle()
    cache.evict_device(16)
    cache.evict_host(16)
    r = eng.prefill(b)
    same(base.prefill(b), r)
    assert r.storage_hit_tokens > 0 and r.device_hit_tokens == r.host_hit_tokens == 0
    cache.wait_idle()
    cache.check_integrity()
    cache.close()


def test_unrestored_indexer_pages_change_topk(tmp_path):
    """Negative control: if the indexer pages of a host hit were not restored, top-k (and logits) would differ."""
    base, eng, cache = engines(tmp_path)
    a = prompt(3, 96) + prompt(4, 5)
    eng.prefill(a)
    cache.wait_idle()
    cache.evict_device(24)
    ref = base.prefill(a)
    # load as usual, then wipe the indexer buffer where the restored pages landed
    m = cache.match(a)
    cache.lock(m.last_node)
    ld = cache.load_back(m)
    ld.wait()
    for layer in range(CFG.num_layers):
        cache.device.buffer("indexer", layer)[torch.tensor(ld.device_pages)] = 0
    cache.unlock(m.last_node)
    r = eng.prefill(a)  # device hits now, on the wiped indexer pages
    assert r.device_hit_tokens > 0
    differs = not torch.equal(ref.logits, r.logits) or any(
        not torch.equal(x, y)
        for sa, sb in zip(ref.selections[len(ref.selections) - len(r.selections) :], r.selections)
        for x, y in zip(sa, sb)
    )
    assert differs, "top-k did not depend on the indexer cache: the equality test would be vacuous"
    cache.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_many_requests_bit_exact(tmp_path, layout):
    model = ReferenceModel(CFG)
    spec = CFG.kv_spec()
    base = ReferenceEngine(model, NullCache(DevicePool(spec, 64)))
    cache = build_cache(
        spec,
        TierConfig(device_pages=14, host_pages=20, host_layout=layout),
        CacheConfig(write_policy="write_through_selective", write_through_threshold=1),
        StorageConfig(url=f"file://{tmp_path}"),
    )
    eng = ReferenceEngine(model, cache)
    systems = [prompt(10, 48), prompt(11, 40)]
    hist = [list(systems[i % 2]) for i in range(4)]
    for turn in range(3):
        for s in range(4):
            hist[s] += prompt(100 * turn + s, 13 + s)
            same(base.prefill(hist[s]), eng.prefill(hist[s]))
    cache.wait_idle()
    cache.check_integrity()
    st = cache.stats
    assert st.device_hit_pages and st.host_hit_pages and st.storage_prefetched_pages
    cache.close()


def test_a_failed_load_is_recomputed_and_logits_still_equal(tmp_path):
    """A host->device load that fails mid-request: the engine learns it from ``wait()``, recomputes
    the lost pages, and its outputs equal recompute bit for bit (before the fix it attended over
    whatever the device pages held)."""
    base, eng, cache = engines(tmp_path, device_pages=32, host_pages=16)  # the lost pages stay quarantined while it runs
    a = prompt(0, 64) + prompt(1, 37)
    eng.prefill(a)
    cache.wait_idle()
    cache.evict_device(32)
    cache.device.buffers["latent"][0].fill_(7)  # what a failed load leaves behind is not the page
    with loads_refused(cache):
        r = eng.prefill(a)
    same(base.prefill(a), r)
    assert r.computed_tokens == len(a) and cache.stats.load_failed_pages > 0
    cache.wait_idle()
    cache.check_integrity(idle=True)
    cache.close()
