"""A minimum sharing granularity (issue 56, item 6; ``CacheConfig.min_hit_tokens``): a request's cached prefix counts only
from that many tokens. A shorter one is served as a miss and recomputed -- from every tier, for ``kvtier run``'s engine
and for an engine that owns its device (vLLM's side) -- so a probe of a short guess learns nothing from its time, the
mitigation *The Early Bird Catches the Leak* proposes. What it costs in hits is the planner's to say."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvtier import DevicePool
from kvtier.app.engine import ReferenceEngine
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from kvtier.errors import ConfigError
from support.cli import kvtier
from support.tenants import MODEL, PS, SPEC, prompt, push_down, same_as_recompute, tier_cache


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_a_prefix_shorter_than_the_minimum_is_recomputed_and_a_longer_one_hits_from_every_tier(tmp_path, tier):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    with tier_cache(tmp_path, tier, CacheConfig(min_hit_tokens=4 * PS)) as cache:
        eng = ReferenceEngine(MODEL, cache)
        short, long = prompt(1, 3 * PS + 2), prompt(2, 5 * PS + 2)  # (3 cached pages: below 4; 5: above)
        for tokens in (short, long):
            eng.prefill(tokens)
        for tokens, want_hit in ((short, 0), (long, 5 * PS)):
            push_down(cache, tier)
            r = eng.prefill(tokens)
            same_as_recompute(base, tokens, r)
            assert r.hit_tokens == want_hit, (tier, r)
        assert cache.stats.hits_below_minimum == 1
        # a request that shares only 3 pages with the long prompt: a 3-page prefix, recomputed too
        push_down(cache, tier)
        partial = long[: 3 * PS] + prompt(3, 2 * PS)
        r = eng.prefill(partial)
        same_as_recompute(base, partial, r)
        assert r.hit_tokens == 0 and cache.stats.hits_below_minimum == 2
        cache.wait_idle()
        cache.check_integrity()


def test_an_engine_owned_devices_lookup_offers_nothing_shorter_than_the_minimum():
    """The vLLM side (:class:`EngineDeviceCore`): the connector's lookup offers no host pages below the minimum, and the
    load that follows it brings none; ``min_hit_tokens`` is a connector option too."""
    from kvtier.core.engine_device import EngineDeviceCore
    from kvtier.executors.local import LocalExecutor
    from kvtier.integrations.vllm.options import ConnectorOptions
    from support.offload import SPEC as ESPEC, engine_tensors, keys, make

    offload = make(engine_tensors())  # (its engine and host pool, under a core of its own)
    core = EngineDeviceCore(ESPEC, offload.host.allocator, LocalExecutor(offload.engine, None),
                            CacheConfig(min_hit_tokens=3 * ESPEC.page_size, preallocate_nodes=False))
    try:
        k = keys(5)
        core.offload(k[:2], [0, 1])
        assert core.lookup(k).host_pages == 0 and core.stats.hits_below_minimum == 1
        core.offload(k[:4], [0, 1, 2, 3])
        assert core.lookup(k).host_pages == 4 and core.stats.hits_below_minimum == 1
        core.check_integrity()
    finally:
        core.close()
        offload.close()
    assert ConnectorOptions.from_extra_config({"min_hit_tokens": 512}).cache.min_hit_tokens == 512


@pytest.mark.parametrize("value", [-1, 1.5, "lots"])
def test_a_bad_minimum_is_a_config_error(value):
    with pytest.raises(ConfigError, match="min_hit_tokens"):
        CacheConfig(min_hit_tokens=value)


def test_kvtier_plan_says_what_a_minimum_costs_in_hits_on_the_trace():
    """``kvtier plan --json --cache-min-hit-tokens N``: the planner replays the trace through the same core, so the
    hits a minimum gives up are the engine's."""
    ratios = []
    for tokens in (0, 4096):
        r = kvtier("plan", "--json", "--limit", "300", "--cache-min-hit-tokens", str(tokens))
        assert r.returncode == 0, r.stderr
        ratios.append(json.loads(r.stdout)["hit_ratio"]["total"])
    assert 0 < ratios[1] < ratios[0], ratios


def test_a_minimum_of_zero_changes_no_key_and_no_hit():
    cache = build_cache(SPEC, TierConfig(device_pages=16, host_pages=16), CacheConfig(min_hit_tokens=0))
    try:
        eng = ReferenceEngine(MODEL, cache)
        tokens = prompt(4, PS + 2)
        eng.prefill(tokens)
        assert eng.prefill(tokens).hit_tokens == PS and cache.stats.hits_below_minimum == 0
        assert torch.equal(torch.tensor([len(cache.page_keys(tokens))]), torch.tensor([1]))
    finally:
        cache.close()


# ---- a review's cases: the minimum holds for what is served, not only for what a lookup found ----------------------
def _one_host_page_three_in_l3(tmp_path, **storage):
    """A 4-page prompt cached: page 0 on host, pages 1..3 in L3 only (device empty)."""
    cache = build_cache(SPEC, TierConfig(device_pages=64, host_pages=64), CacheConfig(min_hit_tokens=4 * PS),
                        StorageConfig(url=f"file://{tmp_path}", **storage))
    eng = ReferenceEngine(MODEL, cache)
    tokens = prompt(1, 4 * PS + 2)
    eng.prefill(tokens)
    cache.wait_idle()
    cache.evict_device(cache.device.num_pages)
    assert cache.evict_host(3).evicted == 3  # (the three deepest pages: their L3 copies stay)
    return cache, eng, tokens


def test_a_host_hit_below_the_minimum_is_served_when_the_l3_pages_that_made_up_the_minimum_are_not_fetched(tmp_path):
    cache, eng, tokens = _one_host_page_three_in_l3(tmp_path, min_prefetch_pages=8)  # (3 stored pages: no prefetch)
    try:
        assert len(cache.match(tokens, count=False).nodes) == 0  # the core's own answer for what is usable now: a miss
        r = eng.prefill(tokens)
        # matched with its L3 pages, the prefix made the minimum; served without them (no prefetch), it is a miss
        assert r.hit_tokens == 0 and cache.stats.hits_below_minimum == 1, (r, cache.stats)
    finally:
        cache.close()


def test_a_prefix_cut_to_a_miss_after_its_prefetch_came_back_short_is_counted_below_the_minimum(tmp_path):
    cache, eng, tokens = _one_host_page_three_in_l3(tmp_path)
    keys = cache.page_keys(tokens)
    # page 2's L3 object corrupt (same size): the prefetch brings page 1 alone, so 2 pages are usable, below 4
    path = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == keys[2].hex())
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        fh.write(b"\xff" * 64)
    try:
        r = eng.prefill(tokens)
        assert r.hit_tokens == 0  # served as a miss (the re-match after the prefetch applies the minimum) ...
        assert cache.stats.hits_below_minimum == 1, cache.stats  # ... and counted as one
    finally:
        cache.close()


def test_an_engine_owned_devices_load_after_a_prefetch_cut_short_serves_no_hit_below_the_minimum(tmp_path):
    """EngineDeviceCore (vLLM's side): lookup offers host 1 + L3 3 = the minimum; the load's prefetch comes back short
    (page 2's object corrupt), and load_into copies the 2 pages it has -- a 2-page hit where the minimum is 4
    (CacheCore.begin re-matches after its prefetch and makes the same case a miss)."""
    from kvtier.core.engine_device import EngineDeviceCore
    from kvtier.executors.local import LocalExecutor
    from support.offload import SPEC as ESPEC, engine_tensors, keys, make

    offload = make(engine_tensors(), host_pages=8, url=f"file://{tmp_path}")
    core = EngineDeviceCore(ESPEC, offload.host.allocator, LocalExecutor(offload.engine, offload.storage),
                            CacheConfig(min_hit_tokens=4 * ESPEC.page_size, preallocate_nodes=False), StorageConfig(url=f"file://{tmp_path}"))
    try:
        k = keys(4)
        core.offload(k, [0, 1, 2, 3])
        core.wait_idle()
        assert core.evict_host(3).evicted == 3
        path = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == k[2].hex())
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            fh.write(b"\xff" * 64)
        assert core.lookup(k).pages == 4  # (host 1 + L3 3: the minimum, offered)
        load = core.load_into(k, [4, 5, 6, 7])
        core.release(load)
        assert load.loaded == 0 and core.stats.hits_below_minimum == 1, load
        core.check_integrity()
    finally:
        core.close()
        offload.close()
