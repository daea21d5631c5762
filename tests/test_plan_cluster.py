"""kvtier plan at cluster scale: routing policies, arrival-time queueing, per-node load, sweeps that are
monotone in every tier or refused, and the plot."""

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from kvtier.app.plan import (PlanConfig, check_plannable, compare_routing, distinct_blocks, min_host_tb, planning_spec, route,
                             run_plan, sweep)
from kvtier.app.plan.routing import ROUTING_POLICIES, prefill_tokens_per_second
from kvtier.app.workloads.mooncake import TraceRequest, default_trace_path, load_mooncake_trace
from kvtier.app.workloads.synthetic import ChatTrace
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError

#: the chat trace's cluster: small tiers, so that capacity matters
CHAT = dict(device_gb=1, host_tb=0.004, storage_tb=0.0)


@pytest.fixture(scope="module")
def shipped():
    return load_mooncake_trace(default_trace_path())


@pytest.fixture(scope="module")
def chat():
    return ChatTrace().requests()


def test_generated_chat_trace_shares_its_first_block(chat):
    assert len(chat) == 300 * 6
    assert all(r.hash_ids[0] == 0 for r in chat)
    assert len({r.hash_ids[1] for r in chat}) == 300  # 300 conversations, each its own second block
    assert [r.timestamp_ms for r in chat] == sorted(r.timestamp_ms for r in chat)


def test_affinity_puts_a_shared_first_block_on_one_node_and_warns(chat):
    r = run_plan(chat, PlanConfig(nodes=8, routing="affinity", **CHAT))
    assert sorted(n["requests"] for n in r.per_node) == [0] * 7 + [len(chat)]
    assert r.load_balance["max_over_mean_prompt_tokens"] == pytest.approx(8.0)
    assert len(r.warnings) == 1 and "8.0x its fair share" in r.warnings[0] and "kv_aware" in r.warnings[0]


def test_kv_aware_spreads_the_load_and_keeps_the_hits(chat):
    aff = run_plan(chat, PlanConfig(nodes=8, routing="affinity", **CHAT))
    kv = run_plan(chat, PlanConfig(nodes=8, routing="kv_aware", **CHAT))
    rr = run_plan(chat, PlanConfig(nodes=8, routing="round_robin", **CHAT))
    fair = sum(n["prompt_tokens"] for n in kv.per_node) / 8
    assert all(fair / 2 <= n["prompt_tokens"] <= 2 * fair for n in kv.per_node), kv.per_node
    assert kv.warnings == []
    assert kv.hit_ratio["total"] >= 0.9 * aff.hit_ratio["total"]
    assert kv.hit_ratio["total"] > rr.hit_ratio["total"]  # round robin splits every conversation over the nodes


def test_kv_aware_follows_the_prefix_and_yields_to_load():
    """Hand-made: conversation A's turns, all at once, then a turn of B. With no weight on load every A turn
    goes where A began; with the default weight a queue of prefill pushes later turns elsewhere."""
    a = (100, 101, 102, 103)
    reqs = [TraceRequest(0, 4 * 512 + 10, 1, a) for _ in range(6)] + [TraceRequest(0, 2 * 512 + 10, 1, (200, 201))]
    sticky = route(reqs, PlanConfig(nodes=4, kv_load_weight=0.0))
    assert sticky[:6] == [sticky[0]] * 6
    # each A turn queues ~4 blocks of prefill less what it reuses; at weight 1e6 a node with any queue loses
    spread = route(reqs, PlanConfig(nodes=4, kv_load_weight=1e6))
    assert len(set(spread[:4])) == 4
    assert route(reqs, PlanConfig(nodes=4, routing="round_robin")) == [0, 1, 2, 3, 0, 1, 2]
    assert route(reqs, PlanConfig(nodes=4, routing="affinity")) == [100 % 4] * 6 + [200 % 4]


def _check_monotone(requests, base: PlanConfig, sizes: dict[str, list[float]], cache_cfg: CacheConfig = CacheConfig()):
    for field, values in sizes.items():
        rows = sweep(requests, base, field, values, cache_cfg)
        totals = [r["hit_total"] for r in rows]
        assert totals == sorted(totals), f"{base.routing}: hit ratio falls as {field} grows: {list(zip(values, totals))}"
        yield field, totals


@pytest.mark.parametrize("routing", ROUTING_POLICIES)
def test_sweeps_are_monotone_on_the_shipped_trace(shipped, routing):
    base = PlanConfig(nodes=4, routing=routing, device_gb=40, host_tb=0.2, storage_tb=0.0)
    l3_all = distinct_blocks(shipped) * planning_spec(base).page_bytes / 1e12 / base.nodes
    grown = dict(_check_monotone(shipped, base, {"host_tb": [0.07, 0.1, 0.2, 0.5], "device_gb": [15, 20, 40, 80],
                                                  "storage_tb": [0, round(l3_all * 1.01, 3), 20]}))
    assert grown["host_tb"][-1] > grown["host_tb"][0] and grown["storage_tb"][-1] > grown["storage_tb"][0]


@pytest.mark.parametrize("routing", ROUTING_POLICIES)
def test_sweeps_are_monotone_on_the_chat_trace(chat, routing):
    base = PlanConfig(nodes=4, routing=routing, **CHAT)
    grown = dict(_check_monotone(chat, base, {"host_tb": [0.0025, 0.004, 0.008, 0.02], "device_gb": [0.6, 0.8, 1, 1.5],
                                               "storage_tb": [0, 0.04, 0.1]}))
    assert grown["host_tb"][-1] > grown["host_tb"][0] and grown["storage_tb"][-1] > grown["storage_tb"][0]


@pytest.mark.parametrize("write_policy", ["write_back", "write_through_selective"])
def test_sweeps_are_monotone_under_the_other_write_policies(chat, write_policy):
    base = PlanConfig(nodes=4, routing="kv_aware", **CHAT)
    grown = dict(_check_monotone(chat, base, {"host_tb": [0.0025, 0.004, 0.02], "device_gb": [0.6, 1, 1.5], "storage_tb": [0, 0.04]},
                                 CacheConfig(write_policy=write_policy)))
    assert grown["host_tb"][-1] > grown["host_tb"][0] and grown["storage_tb"][-1] > grown["storage_tb"][0]


def test_configurations_that_could_fall_are_refused_in_one_line(chat):
    cases = [
        (PlanConfig(device_gb=0.2, host_tb=1), "cannot hold the longest request", "--plan-device-gb"),
        (PlanConfig(device_gb=1, host_tb=0.0015), "smaller than the device's", "--plan-host-tb"),
        (PlanConfig(device_gb=1, host_tb=0.004, storage_tb=0.01), "distinct blocks", "--plan-storage-tb"),
    ]
    for cfg, why, fix in cases:
        with pytest.raises(ConfigError) as e:
            run_plan(chat, cfg)
        msg = str(e.value)
        assert why in msg and fix in msg and "\n" not in msg
        # the size the message names is accepted
        flag, value = re.search(r"--plan-(\S+) (?:0 \(no L3\) or )?([0-9.e+-]+) or more", msg).groups()
        check_plannable(chat, replace(cfg, **{flag.replace("-", "_"): float(value)}))
    with pytest.raises(ConfigError, match="smaller than the device"):  # a sweep checks every size before it runs one
        sweep(chat, PlanConfig(**CHAT), "host_tb", [0.004, 0.0015])
    fix = min_host_tb(chat, PlanConfig(**CHAT))
    check_plannable(chat, replace(PlanConfig(**CHAT), host_tb=fix))  # the size the message names is accepted


def test_queueing_grows_with_the_arrival_rate_and_shrinks_with_nodes(chat):
    span_s = (chat[-1].timestamp_ms - chat[0].timestamp_ms) / 1000
    offered = sum(r.input_length for r in chat) / span_s  # prompt tokens per second at 1x
    one_node = prefill_tokens_per_second(PlanConfig())
    assert offered * 40 > one_node  # at 40x the arrivals outrun one node's prefill
    delays = [run_plan(chat, PlanConfig(arrival_speedup=s, **CHAT)).latency["queue_delay_s"]["mean"] for s in (1, 10, 40)]
    assert delays[0] < delays[1] < delays[2], delays
    by_nodes = [run_plan(chat, PlanConfig(nodes=n, arrival_speedup=40, **CHAT)) for n in (1, 2, 8)]
    waits = [r.latency["queue_delay_s"]["mean"] for r in by_nodes]
    assert waits[0] > waits[1] > waits[2], waits
    for r in by_nodes:
        assert r.latency["ttft_s"]["p50"] >= r.latency["queue_delay_s"]["p50"] and r.latency["ttft_s"]["p99"] > 0
        assert sum(n["requests"] for n in r.per_node) == len(chat)
        assert all(0 < n["busy_fraction"] <= 1 for n in r.per_node)


def test_compare_routing_rows(chat):
    rows = compare_routing(chat, PlanConfig(nodes=4, **CHAT))
    assert [r["routing"] for r in rows] == list(ROUTING_POLICIES)
    by = {r["routing"]: r for r in rows}
    assert by["kv_aware"]["hit_total"] > by["round_robin"]["hit_total"]
    assert by["affinity"]["max_over_mean_prompt_tokens"] == pytest.approx(4.0)
    assert all(len(r["prompt_tokens_per_node"]) == 4 and r["ttft_p99_s"] >= r["ttft_p50_s"] for r in rows)


def test_plan_cli_plot_and_routing_comparison(tmp_path):
    png = tmp_path / "plan.png"
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "plan", "--limit", "300", "--json", "--plan-nodes", "2",
                        "--sweep-host-tb", "0.1,0.3", "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [row["routing"] for row in rep["routing_comparison"]] == list(ROUTING_POLICIES)
    assert [row["host_tb"] for row in rep["sweep"]] == [0.1, 0.3]
    assert rep["routing"] == "kv_aware" and len(rep["per_node"]) == 2 and set(rep["latency"]) == {"queue_delay_s", "ttft_s"}
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plan_cli_refusal_is_one_line_exit_2(tmp_path):
    for args, text in ((["--plan-host-tb", "0.01"], "--plan-host-tb"),
                       (["--sweep-host-tb", "0.1", "--sweep-device-gb", "20"], "one tier at a time"),
                       (["--plot", str(tmp_path / "absent" / "p.png")], "does not exist")):
        r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "plan", "--limit", "200", *args], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_kv_aware_weights_host_blocks_below_device_blocks(chat):
    from kvtier.app.plan.routing import _cached_value, host_weight

    # the router's device estimate: blocks sent since device_since lead the prefix; the rest count w_host each
    ids = [11, 12, 13, 14]
    assert _cached_value(ids, 4, {11: 10, 12: 10, 13: 5, 14: 5}, 8, 0.5) == 2 + 0.5 * 2
    assert _cached_value(ids, 3, {11: 10, 12: 10, 13: 10, 14: 10}, 8, 0.0) == 3
    assert _cached_value(ids, 2, {11: 1, 12: 1}, 8, 0.25) == 0.5
    cfg = PlanConfig()
    spec = planning_spec(cfg)
    recompute_s = cfg.flops_per_token / (cfg.prefill_tflops * 1e12)
    load_s = spec.bytes_per_token / (cfg.pcie_gbps * 1e9)
    assert host_weight(cfg) == pytest.approx(1 - load_s / recompute_s) and 0.9 < host_weight(cfg) < 1
    assert host_weight(replace(cfg, kv_host_weight=0.3)) == 0.3
    # the weight is live: valuing host blocks at nothing sends some requests elsewhere
    base = PlanConfig(nodes=4, **CHAT)
    assert route(chat, replace(base, kv_host_weight=0.0)) != route(chat, replace(base, kv_host_weight=1.0))
