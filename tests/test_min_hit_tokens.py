"""A minimum sharing granularity (issue 56, item 6; ``CacheConfig.min_hit_tokens``): a request's cached prefix counts only
from that many tokens. A shorter one is served as a miss and recomputed -- from every tier, for ``kvtier run``'s engine
and for an engine that owns its device (vLLM's side) -- so a probe of a short guess learns nothing from its time, the
mitigation *The Early Bird Catches the Leak* proposes. What it costs in hits is the planner's to say."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier import DevicePool
from kvtier.app.engine import ReferenceEngine
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from kvtier.errors import ConfigError
from support.cli import kvtier
from test_tenants import MODEL, PS, SPEC, prompt, same_as_recompute


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_a_prefix_shorter_than_the_minimum_is_recomputed_and_a_longer_one_hits_from_every_tier(tmp_path, tier):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    cache = build_cache(SPEC, TierConfig(device_pages=64, host_pages=64), CacheConfig(min_hit_tokens=4 * PS),
                        StorageConfig(url=f"file://{tmp_path}"))
    eng = ReferenceEngine(MODEL, cache)

    def push_down() -> None:
        cache.wait_idle()
        if tier != "device":
            cache.evict_device(cache.device.num_pages)
        if tier == "storage":
            cache.evict_host(cache.host.num_pages)

    try:
        short, long = prompt(1, 3 * PS + 2), prompt(2, 5 * PS + 2)  # (3 cached pages: below 4; 5: above)
        for tokens in (short, long):
            eng.prefill(tokens)
        for tokens, want_hit in ((short, 0), (long, 5 * PS)):
            push_down()
            r = eng.prefill(tokens)
            same_as_recompute(base, tokens, r)
            assert r.hit_tokens == want_hit, (tier, r)
        assert cache.stats.hits_below_minimum == 1
        # a request that shares only 3 pages with the long prompt: a 3-page prefix, recomputed too
        push_down()
        partial = long[: 3 * PS] + prompt(3, 2 * PS)
        r = eng.prefill(partial)
        same_as_recompute(base, partial, r)
        assert r.hit_tokens == 0 and cache.stats.hits_below_minimum == 2
        cache.wait_idle()
        cache.check_integrity()
    finally:
        cache.close()


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
