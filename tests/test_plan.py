"""kvtier plan on the shipped Mooncake trace, replayed through the policy core: bounded by the infinite
cache, monotone in host size, in seconds."""

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from kvtier.l3.base import KeyStatus
from kvtier.l3.memory import MemoryBackend
from kvtier.config import CacheConfig
from kvtier.app.plan import PlanConfig, infinite_cache_hit_ratio, replay, run_plan, sweep_host
from kvtier.app.plan.config import attribute_hits
from kvtier.app.bench.plan import CONFIGURATIONS
from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace


@pytest.fixture(scope="module")
def trace():
    return load_mooncake_trace(default_trace_path())


def independent_bound(requests, block=512):
    """Longest-prefix hits of an unbounded set of block ids, computed here from scratch."""
    seen, hit, total = set(), 0, 0
    for r in requests:
        n = 0
        for h in r.hash_ids[: (r.input_length - 1) // block]:
            if h not in seen:
                break
            n += 1
        hit += n * block
        total += r.input_length
        seen.update(r.hash_ids[: r.input_length // block])
    return hit / total


def test_whole_trace_bounded_and_in_seconds(trace):
    t0 = time.perf_counter()
    report = run_plan(trace)
    elapsed = time.perf_counter() - t0
    assert report.requests == 3993 and elapsed < 30, elapsed
    bound = independent_bound(trace)
    assert report.infinite_cache_hit_ratio == round(bound, 4) == round(infinite_cache_hit_ratio(trace), 4)
    assert report.hit_ratio["total"] <= bound + 1e-9
    assert sum(report.hit_ratio[t] for t in ("device", "host", "storage")) == pytest.approx(report.hit_ratio["total"], abs=2e-4)
    # 1 TB of host per node cannot hold the trace's ~1.6 PB working set: device, host and storage all serve
    assert report.hit_ratio["device"] > 0 and report.hit_ratio["host"] > 0 and report.hit_ratio["storage"] > 0
    assert report.link_utilization["pcie_host_to_device"] > 0 and report.load_vs_recompute["host_hit_speedup"] > 1


def test_no_storage_hit_ratio_monotone_in_host_capacity(trace):
    cfg = PlanConfig(storage_tb=0.0, device_gb=40)
    rows = sweep_host(trace[:2000], cfg, [0.07, 0.1, 0.2, 0.5, 1.0, 4.0])
    totals = [r["hit_total"] for r in rows]
    assert totals == sorted(totals) and totals[-1] > totals[0], totals
    assert all(r["hit_storage"] == 0 for r in rows)


def test_more_nodes_with_round_robin_do_not_beat_the_bound(trace):
    report = run_plan(trace[:1500], PlanConfig(nodes=4, routing="round_robin", storage_tb=0.0, host_tb=0.1))
    assert report.hit_ratio["total"] <= report.infinite_cache_hit_ratio


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_every_configuration_replays_through_the_core_within_the_bound(trace, name):
    """Each path through the policy the benchmark times: bounded by the infinite cache, blocks served
    from the tiers that configuration has, the same tiers on a second replay (nothing left over)."""
    plan_fields, cache_fields = CONFIGURATIONS[name]
    cfg, cache_cfg = replace(PlanConfig(), **plan_fields), CacheConfig(**cache_fields)
    head = trace[:800]
    counts = replay(head, cfg, cache_cfg, per_request=True)
    bound = independent_bound(head)
    assert sum(counts.hit_blocks.values()) * 512 / counts.input_tokens <= bound + 1e-9
    assert counts.hit_blocks["device"] > 0 and len(counts.per_request) == len(head)
    assert (counts.hit_blocks["host"] > 0) == (cfg.host_tb > 0.01)  # a host below device + 2 requests keeps nothing
    again = replay(head, cfg, cache_cfg, per_request=True)
    assert again.per_request == counts.per_request


def test_hits_attributed_device_then_host_then_storage():
    assert attribute_hits(5, 2, 2) == (2, 2, 1)
    assert attribute_hits(3, 2, 2) == (2, 1, 0)  # the last token is computed: the deepest tier loses the block
    assert attribute_hits(1, 4, 0) == (1, 0, 0)
    assert attribute_hits(0, 0, 0) == (0, 0, 0)


def test_bench_plan_cli_json():
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "bench", "plan", "--limit", "400", "--reps", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["requests"] == 400
    assert [r["configuration"] for r in rep["configurations"]] == list(CONFIGURATIONS)
    assert all(r["requests_per_s"] > 0 and r["hit_blocks"]["device"] > 0 for r in rep["configurations"])
    assert rep["slowest_requests_per_s"] == min(r["requests_per_s"] for r in rep["configurations"])
    assert {(r["routing"], r["nodes"]) for r in rep["routing"]} == {
        (p, n) for p in ("round_robin", "affinity", "kv_aware") for n in (1, 16)
    }


def test_memory_backend_contract_and_lru():
    b = MemoryBackend(max_objects=2)
    v = [memoryview(bytes([i]) * 8) for i in range(3)]
    assert b.set(["a", "b"], v[:2]) == [KeyStatus.OK] * 2
    out = memoryview(bytearray(8))
    assert b.get(["a"], [out]) == [KeyStatus.OK] and bytes(out) == bytes([0]) * 8  # 'a' is now most recent
    b.set(["c"], v[2:])
    assert b.exists(["a", "c"]) == 2 and b.exists(["b"]) == 0 and b.evicted == 1
    assert b.get(["zz"], [out]) == [KeyStatus.MISS]


def test_plan_cli_json():
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.app.cli", "plan", "--limit", "300", "--json", "--plan-nodes", "2", "--sweep-host-tb", "0.1,1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["requests"] == 300 and rep["nodes"] == 2 and len(rep["sweep"]) == 2
    assert rep["hit_ratio"]["total"] <= rep["infinite_cache_hit_ratio"]


def test_the_replay_makes_no_cyclic_garbage_while_the_collector_is_paused(trace, monkeypatch):
    """The replay pauses CPython's cyclic collector (its full walks of the heap found nothing to free):
    that is only sound while a replay makes no reference cycles, so a collection forced mid-replay
    must find none, and the collector is on again after it (off, if it was off before)."""
    import gc

    from kvtier.core import CacheCore

    found, begin, seen = [], CacheCore.begin, [0]

    def begin_and_collect(self, *args, **kwargs):
        seen[0] += 1
        if seen[0] % 500 == 0:
            assert not gc.isenabled(), "the collector runs during the replay"
            found.append(gc.collect())
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(CacheCore, "begin", begin_and_collect)
    gc.collect()
    for name in ("default", "write_back", "write_through_selective", "16 nodes"):
        plan_fields, cache_fields = CONFIGURATIONS[name]
        replay(trace[:2000], replace(PlanConfig(), **plan_fields), CacheConfig(**cache_fields))
        assert gc.isenabled()
        gc.collect()  # the finished replay's cores (they hold cycles) go now, not at the next mid-replay check
    assert len(found) == 16 and found == [0] * 16, found
    gc.disable()
    try:
        replay(trace[:50])
        assert not gc.isenabled(), "a caller's paused collector was switched on"
    finally:
        gc.enable()
