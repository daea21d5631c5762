"""kvtier plan on the shipped Mooncake trace: bounded by the infinite cache, monotone in host size, fast."""

import json
import subprocess
import sys
import time

import pytest

from kvtier.l3.base import KeyStatus
from kvtier.l3.memory import MemoryBackend
from kvtier.plan import PlanConfig, infinite_cache_hit_ratio, run_plan, sweep_host
from kvtier.workloads.mooncake import default_trace_path, load_mooncake_trace


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
    rows = sweep_host(trace[:2000], cfg, [0.0005, 0.05, 0.2, 0.5, 1.0, 4.0])
    totals = [r["hit_total"] for r in rows]
    assert totals == sorted(totals) and totals[-1] > totals[0], totals
    assert all(r["hit_storage"] == 0 for r in rows)


def test_more_nodes_with_round_robin_do_not_beat_the_bound(trace):
    report = run_plan(trace[:1500], PlanConfig(nodes=4, routing="round_robin", storage_tb=0.0, host_tb=0.1))
    assert report.hit_ratio["total"] <= report.infinite_cache_hit_ratio


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
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "plan", "--limit", "300", "--json", "--plan-nodes", "2", "--sweep-host-tb", "0.1,1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["requests"] == 300 and rep["nodes"] == 2 and len(rep["sweep"]) == 2
    assert rep["hit_ratio"]["total"] <= rep["infinite_cache_hit_ratio"]
