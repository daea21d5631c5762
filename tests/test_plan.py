"""kvtier plan on the shipped Mooncake trace: bounded by the infinite cache, monotone in host size, fast;
the fast LRU model serves every request exactly as the policy core does."""

import json
import subprocess
import sys
import time

import pytest

from kvtier.l3.base import KeyStatus
from kvtier.l3.memory import MemoryBackend
from kvtier.config import CacheConfig
from kvtier.app.plan import PlanConfig, capacity, infinite_cache_hit_ratio, planning_spec, replay, run_plan, sweep_host
from kvtier.app.plan.config import attribute_hits
from kvtier.app.plan.replay_lru import lru_model_gap
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
    assert report.replay_engine == "lru"
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


#: configurations that reach every path of the policy: L3 evictions, device shortfalls
#: (requests longer than the device, which are served but not inserted), several nodes
EQUIVALENCE = {
    "default": PlanConfig(),
    "small device, small L3": PlanConfig(device_gb=2, host_tb=0.1, storage_tb=0.15),
    "3 nodes, affinity": PlanConfig(nodes=3, host_tb=0.2, storage_tb=0.5),
    "2 nodes, round robin": PlanConfig(nodes=2, routing="round_robin", device_gb=5, host_tb=0.3, storage_tb=1.0),
    "no L3": PlanConfig(storage_tb=0.0),
}


@pytest.mark.parametrize("name", list(EQUIVALENCE))
def test_fast_model_serves_every_request_like_the_cache(trace, name):
    cfg = EQUIVALENCE[name]
    fast = replay(trace, cfg, engine="lru", per_request=True)
    ref = replay(trace, cfg, engine="cache", per_request=True)
    assert (fast.engine, ref.engine) == ("lru", "cache")
    assert len(fast.per_request) == len(trace)
    mismatch = next((i for i, (a, b) in enumerate(zip(fast.per_request, ref.per_request)) if a != b), None)
    assert mismatch is None, f"request {mismatch}: fast {fast.per_request[mismatch]} vs cache {ref.per_request[mismatch]}"
    assert fast.hit_blocks == ref.hit_blocks and fast.input_tokens == ref.input_tokens
    assert (fast.backed_up_blocks, fast.storage_saved_blocks) == (ref.backed_up_blocks, ref.storage_saved_blocks)
    assert fast.hit_blocks["device"] > 0 and fast.hit_blocks["host"] > 0
    assert (fast.hit_blocks["storage"] > 0) == (cfg.storage_tb > 0)


def test_equivalence_configs_reach_shortfalls_and_l3_evictions(trace):
    cap = capacity(EQUIVALENCE["small device, small L3"], planning_spec(PlanConfig()).page_bytes)
    distinct = len({h for r in trace for h in r.hash_ids[: r.input_length // 512]})
    assert max(r.input_length // 512 for r in trace) > cap.device  # some requests cannot be inserted
    assert cap.storage < distinct  # the L3 evicts


def test_plan_uses_the_cache_where_the_model_has_a_gap(trace):
    cap = capacity(PlanConfig(), planning_spec(PlanConfig()).page_bytes)
    assert lru_model_gap(CacheConfig(), cap, 375) is None
    assert "write_back" in lru_model_gap(CacheConfig(write_policy="write_back"), cap, 375)
    small_host = capacity(PlanConfig(host_tb=0.01), planning_spec(PlanConfig()).page_bytes)
    assert "host copies get skipped" in lru_model_gap(CacheConfig(), small_host, 375)
    head = trace[:300]
    assert run_plan(head).replay_engine == "lru"
    assert replay(head, PlanConfig(host_tb=0.01)).engine == "cache"
    assert run_plan(head, cache_cfg=CacheConfig(write_policy="write_back")).replay_engine == "cache"
    forced = run_plan(head, PlanConfig(replay="cache"))
    assert forced.replay_engine == "cache" and forced.hit_ratio == run_plan(head).hit_ratio


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
    assert rep["requests"] == 400 and rep["identical"] is True
    assert rep["lru_requests_per_s"] > 0 and rep["cache_requests_per_s"] > 0 and rep["lru_over_cache"] > 0


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
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "plan", "--limit", "300", "--json", "--plan-nodes", "2", "--sweep-host-tb", "0.1,1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["requests"] == 300 and rep["nodes"] == 2 and len(rep["sweep"]) == 2
    assert rep["hit_ratio"]["total"] <= rep["infinite_cache_hit_ratio"]
