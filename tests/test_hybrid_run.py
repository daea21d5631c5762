"""The hybrid reference model (MLA + DSA, sliding-window and linear-attention state layers): outputs
with hits from every tier equal a full recompute bit for bit, and a hit moves only what each group
needs -- the window's pages, one snapshot."""

from __future__ import annotations

import json

import torch

from kvtier import DevicePool
from kvtier.core.plans import Tier
from kvtier.app.engine import HybridEngine
from kvtier.app.model import ModelConfig
from kvtier.app.model.hybrid import FULL, SLIDING, STATE, HybridConfig, HybridReferenceModel
from kvtier.build import TierConfig, build_hybrid_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from support.pools import fill_pool, loads_refused
from support.cli import SMALL, kvtier
from support.hybrid_rules import read_places

BASE = ModelConfig(hidden=64, num_layers=3, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                   index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)
CFG = HybridConfig(base=BASE, window=12, swa_heads=2, swa_head_dim=16, state_heads=2, state_dim=8, state_every=2)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE.vocab_size, (n,), generator=g).tolist()


def engines(tmp_path, device_pages=24, host_pages=24):
    model = HybridReferenceModel(CFG)
    spec = CFG.model_spec()
    cache = build_hybrid_cache(spec, TierConfig(device_pages=device_pages, host_pages=host_pages), CacheConfig(),
                               StorageConfig(url=f"file://{tmp_path}"), state_every=CFG.state_every)
    pools = {name: DevicePool(dev.spec, 64) for name, (dev, _h) in cache.group_pools.items()}
    null = NullCache(DevicePool(spec.group(FULL).attention, 64), pools)
    base = HybridEngine(model, null, {FULL: null.device, **pools})
    ours = HybridEngine(model, cache, {FULL: cache.device, **{n: dev for n, (dev, _h) in cache.group_pools.items()}})
    return base, ours, cache


def same(a, b):
    assert torch.equal(a.logits, b.logits)
    for sa, sb in zip(a.selections[len(a.selections) - len(b.selections):], b.selections):
        assert all(torch.equal(x, y) for x, y in zip(sa, sb)), "DSA top-k differs"


def moved(cache) -> dict[str, int]:
    return {c.name: c.loaded for c in cache.components}


def test_model_spec_groups():
    spec = CFG.model_spec()
    assert [(g.name, g.kind, g.layers) for g in spec.groups] == [(FULL, "full", (0, 3)), (SLIDING, "sliding_window", (1, 4)),
                                                                 (STATE, "state", (2, 5))]
    assert spec.group(STATE).state_bytes == 2 * (2 * 8 * 8 * 4)


def test_outputs_with_hits_from_every_tier_equal_recompute_and_move_only_what_each_group_needs(tmp_path):
    base, eng, cache = engines(tmp_path, device_pages=16, host_pages=16)
    system = prompt(0, 64)  # 8 pages
    a = system + prompt(1, 37)
    try:
        # 1. cold: everything computed
        r = eng.prefill(a)
        same(base.prefill(a), r)
        assert r.computed_tokens == len(a)
        cache.wait_idle()
        # 2. device hit: the system prompt's 8 pages (a snapshot sits at 8: state_every=2)
        b = system + prompt(2, 21)
        r = eng.prefill(b)
        same(base.prefill(b), r)
        assert r.device_hit_tokens == 64
        # 3. host hit: evict device, ask again; one load brings the pages, the window's 2 pages, 1 snapshot
        cache.wait_idle()
        cache.evict_device(16)
        before = moved(cache)
        r = eng.prefill(a)
        same(base.prefill(a), r)
        hit = r.host_hit_tokens // BASE.page_size
        assert hit > 0 and r.device_hit_tokens == 0
        window = len(read_places(CFG.model_spec().group(SLIDING), hit, BASE.page_size))
        assert {k: v - before[k] for k, v in moved(cache).items()} == {SLIDING: window, STATE: 1} and window < hit
        # 4. storage hit: evict device and host; pages, window pages and the snapshot come back from the file store
        cache.wait_idle()
        cache.evict_device(16)
        cache.evict_host(16)
        fetched = {c.name: c.fetched for c in cache.components}
        r = eng.prefill(b)
        same(base.prefill(b), r)
        assert r.storage_hit_tokens > 0 and r.device_hit_tokens == r.host_hit_tokens == 0
        hit = r.storage_hit_tokens // BASE.page_size
        window = len(read_places(CFG.model_spec().group(SLIDING), hit, BASE.page_size))
        assert {c.name: c.fetched - fetched[c.name] for c in cache.components} == {SLIDING: window, STATE: 1}
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()


def test_a_failed_load_is_recomputed_and_logits_still_equal(tmp_path):
    base, eng, cache = engines(tmp_path, device_pages=32, host_pages=16)
    a = prompt(0, 64) + prompt(1, 37)
    try:
        eng.prefill(a)
        cache.wait_idle()
        cache.evict_device(32)
        for dev, _h in cache.group_pools.values():  # what a failed load leaves behind is not the object
            fill_pool(dev, 7)
        with loads_refused(cache):
            r = eng.prefill(a)
        same(base.prefill(a), r)
        assert r.computed_tokens == len(a) and cache.stats.load_failed_pages > 0
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()


def test_a_load_counts_in_every_group_when_it_completes_and_a_failed_one_apart(tmp_path):
    """The full group counts the pages of loads that completed; every other group counts its objects the
    same way (a failed load's objects: ``load_failed``), so the window never loads more than the pages."""
    from kvtier.app.runner import _group_report

    base, eng, cache = engines(tmp_path, device_pages=32, host_pages=16)
    a = prompt(0, 64) + prompt(1, 37)
    try:
        eng.prefill(a)
        cache.wait_idle()
        cache.evict_device(32)
        with loads_refused(cache):
            same(base.prefill(a), eng.prefill(a))
        cache.wait_idle()
        assert {c.name: c.loaded for c in cache.components} == {SLIDING: 0, STATE: 0}  # as the full pages: none loaded
        assert cache.stats.loaded_pages == 0 < cache.stats.load_failed_pages
        assert {c.name: (c.load_failed, c.filled) for c in cache.components} == {SLIDING: (2, 0), STATE: (1, 0)}
        report = _group_report(cache, CFG)
        assert report[FULL]["pages_loaded"] == 0 and report[SLIDING]["pages_loaded"] == report[SLIDING]["pages_skipped"] == 0
        cache.evict_device(32)
        r = eng.prefill(a)  # the same hit, its load completing now
        same(base.prefill(a), r)
        cache.wait_idle()
        assert r.host_hit_tokens == 96 and cache.stats.loaded_pages == 12
        assert {c.name: (c.loaded, c.load_failed) for c in cache.components} == {SLIDING: (2, 2), STATE: (1, 1)}
        report = _group_report(cache, CFG)
        assert report[FULL] == {"pages_loaded": 12, "pages_load_failed": cache.stats.load_failed_pages, "bytes": 12 * cache.spec.page_bytes}
        assert (report[SLIDING]["pages_loaded"], report[SLIDING]["pages_skipped"], report[SLIDING]["load_failed"]) == (2, 10, 2)
        assert (report[STATE]["snapshots_loaded"], report[STATE]["load_failed"]) == (1, 1)
        cache.check_integrity(idle=True)
    finally:
        cache.close()


def check_group_report_adds_up(report) -> None:
    """Every group's figures of a hybrid ``kvtier run`` report: loads counted as they completed, the same way
    in every group (the window's pages and the snapshots are among the full pages loaded), none negative."""
    g = report["groups"]
    full, window, state = g[FULL], g[SLIDING], g[STATE]
    assert all(v >= 0 for group in (full, window, state) for v in group.values()), g
    assert full["pages_loaded"] == report["stats"]["loaded_pages"] and full["pages_load_failed"] == report["stats"]["load_failed_pages"]
    assert window["pages_loaded"] + window["pages_skipped"] == full["pages_loaded"], g
    assert state["snapshots_loaded"] <= full["pages_loaded"], g


def test_the_group_report_adds_up_when_loads_fail(monkeypatch):
    """Every other host->device load of the full group fails (its request recomputes): each group reports
    what its completed loads brought, and what failed loads did not bring apart."""
    import kvtier.app.runner as runner

    def every_other_load_fails(*args, **kwargs):
        cache = build_hybrid_cache(*args, **kwargs)
        submit, loads = cache.engine.submit, iter(range(1 << 30))

        def submit_or_fail(src, dst, *a, **kw):
            if (src, dst) == (Tier.HOST, Tier.DEVICE) and next(loads) % 2:
                raise RuntimeError("injected: the copy engine failed")
            return submit(src, dst, *a, **kw)

        cache.engine.submit = submit_or_fail
        return cache

    monkeypatch.setattr(runner, "build_hybrid_cache", every_other_load_fails)
    cfg = runner.RunConfig(workload=runner.WorkloadConfig(sessions=4, turns=3, system_tokens=128, user_tokens=40, reply_tokens=24),
                           tiers=TierConfig(device_pages=20, host_pages=24), model_kind="hybrid")
    report = runner.run_workload(cfg, progress=False).as_dict()
    assert report["logits_bit_exact"] is True and report["stats"]["load_failed_pages"] > 0
    check_group_report_adds_up(report)
    g = report["groups"]
    assert g[FULL]["pages_loaded"] > 0 and g[SLIDING]["pages_loaded"] > 0 and g[STATE]["snapshots_loaded"] > 0
    assert g[SLIDING]["load_failed"] > 0 and g[STATE]["load_failed"] > 0


def test_kvtier_run_model_hybrid_is_bit_exact_with_hits_from_every_tier():
    r = kvtier("run", "--model", "hybrid", "--no-progress", "--json", "-", *SMALL)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["model"] == "hybrid"
    assert all(report["hit_ratio"][t] > 0 for t in ("device", "host", "storage")), report["hit_ratio"]
    assert report["logits_bit_exact"] is True and report["indexer_topk_equal"] is True
    g = report["groups"]
    # a sliding-window group loads only its window: fewer pages than the full group, the rest skipped
    assert 0 < g[SLIDING]["pages_loaded"] < g[FULL]["pages_loaded"] == g[SLIDING]["pages_loaded"] + g[SLIDING]["pages_skipped"]
    assert 0 < g[STATE]["snapshots_loaded"] < g[FULL]["pages_loaded"]
    assert 0 < g["vs_full_attention_twin"] < 1


def test_kvtier_run_model_hybrid_through_the_copy_kernel_under_its_interpreter_keeps_every_copy():
    """The README's CPU proof of the kernel, for a hybrid model: its transfer engines (one thread per KV group)
    launch the kernel at once, and Triton's interpreter keeps its launch state in globals -- unserialized,
    copies failed and the run lost its host hits. Every copy lands, logits bit-exact with recompute."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    workload = ["--workload-sessions", "3", "--workload-turns", "2", "--workload-system-tokens", "64", "--workload-user-tokens", "24",
                "--workload-reply-tokens", "16", "--tiers-device-pages", "8", "--tiers-host-pages", "12"]
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "run", "--model", "hybrid", "--cache-io-backend", "triton", "--no-progress",
                        "--json", "-", *workload], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert "transfer job" not in r.stderr and report["stats"]["transfer_failures"] == 0, r.stderr[-2000:]
    assert report["hit_ratio"]["host"] > 0 and report["stats"]["loaded_pages"] > 0, report["hit_ratio"]
    assert report["logits_bit_exact"] is True and report["indexer_topk_equal"] is True
    check_group_report_adds_up(report)
    g = report["groups"]
    assert g[SLIDING]["pages_loaded"] > 0 and g[STATE]["snapshots_loaded"] > 0
    assert g[FULL]["pages_load_failed"] == g[SLIDING]["load_failed"] == g[STATE]["load_failed"] == 0


def test_kvtier_run_refuses_an_unknown_model_in_one_line():
    r = kvtier("run", "--model", "mamba", "--no-progress")
    assert r.returncode == 2 and "dsa or hybrid" in r.stderr and "Traceback" not in r.stderr


def test_a_hybrid_tenants_pages_and_group_objects_are_a_hit_for_that_tenant_only(tmp_path):
    """A hybrid request's tenant scopes its keys, and through them its window pages and state snapshots: tenant b's
    same prompt computes everything with a's pages on device, tenant c's with them on host; tenant a hits again; every
    output equals recompute."""
    base, ours, cache = engines(tmp_path, device_pages=48, host_pages=48)
    tokens = prompt(7, 6 * 8 + 3)
    try:
        same(base.prefill(tokens), ours.prefill(tokens, tenant="a"))
        for push, other in ((False, "b"), (True, "c")):  # (each other tenant once: its own pages would be its hit)
            cache.wait_idle()
            if push:
                cache.evict_device(cache.device.num_pages)
            r = ours.prefill(tokens, tenant=other)
            same(base.prefill(tokens), r)
            assert r.hit_tokens == 0
        cache.wait_idle()
        cache.evict_device(cache.device.num_pages)
        r = ours.prefill(tokens, tenant="a")
        same(base.prefill(tokens), r)
        assert r.host_hit_tokens > 0
        cache.wait_idle()
        cache.check_integrity()
    finally:
        cache.close()
