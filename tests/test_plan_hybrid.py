"""``kvtier plan`` with hybrid models: what a block costs per group, what each tier holds and moves,
the window and the state cadence in the capacity, and the monotone-or-refused rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.app.plan import PlanConfig, check_plannable, run_plan, sweep
from kvtier.app.plan.config import block_bytes, capacity, group_capacity, planning_model, planning_spec, slots_per_block, window_groups
from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace
from kvtier.errors import ConfigError, UnknownNameError
from kvtier.groups import HYBRID_PRESETS


@pytest.fixture(scope="module")
def trace():
    return load_mooncake_trace(default_trace_path(), 1500)


def test_a_slot_costs_a_full_page_a_window_page_of_its_own_pool_and_a_snapshot_at_its_cadence():
    gpt = PlanConfig(spec="gpt-oss-120b")
    full, window = (g.attention.with_(page_size=512).page_bytes for g in HYBRID_PRESETS["gpt-oss-120b"].groups)
    # gpt-oss's window page is a full page: it takes a slot of the same pool, as many as a tier keeps
    assert full == window and window_groups(gpt) == ["sliding"] and group_capacity(gpt, capacity(gpt, full)) == {}
    assert planning_spec(gpt).page_bytes == full and block_bytes(gpt) == full and slots_per_block(gpt) == 2
    # Gemma 3's is 5.2 full pages: a pool of its own, one window page per block, paid in every slot
    gemma = PlanConfig(spec="gemma-3-27b")
    g_full, g_window = (g.attention.with_(page_size=512).page_bytes for g in HYBRID_PRESETS["gemma-3-27b"].groups)
    assert window_groups(gemma) == [] and block_bytes(gemma) == g_full + g_window and slots_per_block(gemma) == 1
    qwen = HYBRID_PRESETS["qwen3-next-80b-a3b"]
    snapshot = qwen.group("linear").state_bytes
    for every in (1, 3):
        cfg = PlanConfig(spec="qwen3-next-80b-a3b", state_every=every)
        assert block_bytes(cfg) == qwen.group("full").attention.with_(page_size=512).page_bytes + snapshot / every
        cap = capacity(cfg, block_bytes(cfg))
        assert group_capacity(cfg, cap)["linear"] == cap  # ids never compete: objects live as long as their pages
    assert planning_model(PlanConfig()) is None and block_bytes(PlanConfig()) == planning_spec(PlanConfig()).page_bytes


def test_a_hit_moves_only_the_window_and_the_report_says_per_group_what_it_holds_and_moves(trace):
    cfg = PlanConfig(spec="gpt-oss-120b", device_gb=40, host_tb=1.0, storage_tb=20.0)
    report = run_plan(trace, cfg)
    g = report.groups
    assert g["sliding"]["kind"] == "sliding_window" and g["sliding"]["window_tokens"] == 128
    assert g["sliding"]["shares_slots"] and g["full"]["slots_shared_with"] == ["sliding"]
    assert "objects_reserved_per_node" not in g["sliding"]  # it takes slots as it keeps pages: no reserve
    # window pages no request read went first: the host kept fewer of them than of full pages
    assert 0 < g["sliding"]["objects_held_at_most"]["host"] < g["full"]["host_blocks"] and g["sliding"]["evicted"] > 0
    assert g["sliding"]["backed_up"] > 0 and g["moved_bytes"]["loaded"] > 0
    # a hit loads its blocks' full pages but only its window's pages: far fewer
    loaded_blocks = round((report.hit_ratio["host"] + report.hit_ratio["storage"]) * report.input_tokens / 512)
    assert 0 < g["sliding"]["loaded"] < loaded_blocks / 3
    assert report.hit_ratio["total"] <= report.infinite_cache_hit_ratio
    # a slot is a full page: half of a full-attention twin's block (18 of its 36 layers)
    assert 2 * report.block_bytes == 2 * round(block_bytes(cfg)) == g["full_attention_twin"]["bytes_per_block"]


def test_state_snapshots_cost_their_size_at_their_cadence(trace):
    rare = run_plan(trace, PlanConfig(spec="qwen3-next-80b-a3b", state_every=8))
    often = run_plan(trace, PlanConfig(spec="qwen3-next-80b-a3b", state_every=1))
    # a 39.5 MB snapshot per block outweighs what the linear layers save; one every 8 blocks does not
    assert often.groups["full"]["device_blocks"] < often.groups["full_attention_twin"]["device_blocks"]
    assert rare.groups["full"]["device_blocks"] > 2 * rare.groups["full_attention_twin"]["device_blocks"]
    # the price: a prefix is usable only where a snapshot was kept
    assert rare.groups["linear"]["limited_matches"] > often.groups["linear"]["limited_matches"]
    for r in (rare, often):  # what the block size reserved held every snapshot kept
        held, reserved = r.groups["linear"]["objects_held_at_most"], r.groups["linear"]["objects_reserved_per_node"]
        assert held["device"] <= reserved["device"] and held["host"] <= reserved["host"] and "warning" not in r.groups["linear"]


@pytest.mark.parametrize("preset, device, pool", [("gpt-oss-120b", 40, "shared"), ("gpt-oss-120b", 40, "own"),
                                                  ("gemma-3-27b", 80, "shared"),
                                                  ("qwen3-next-80b-a3b", 40, "shared")])
def test_hybrid_sweeps_are_monotone_where_the_plan_accepts_them(trace, preset, device, pool):
    base = PlanConfig(spec=preset, storage_tb=0.0, device_gb=device, window_pool=pool)
    totals = [r["hit_total"] for r in sweep(trace, base, "host_tb", [0.3, 0.5, 1.0, 4.0])]
    assert totals == sorted(totals) and totals[-1] > totals[0], totals
    grown = [r["hit_total"] for r in sweep(trace, replace(base, host_tb=4.0), "device_gb", [device, 2 * device, 4 * device])]
    assert grown == sorted(grown), grown


def test_window_pages_sharing_the_full_pages_pool_shrink_the_working_set(trace):
    """The same bytes of host: a window page per block in a pool of its own, against window pages in the
    full pages' pool where the ones no request reads go first -- the shared pool keeps more prefixes."""
    for host_tb in (0.3, 0.5):
        cfg = PlanConfig(spec="gpt-oss-120b", storage_tb=0.0, device_gb=40, host_tb=host_tb)
        own, shared = (run_plan(trace, replace(cfg, window_pool=pool)) for pool in ("own", "shared"))
        assert shared.hit_ratio["total"] > own.hit_ratio["total"], (host_tb, shared.hit_ratio, own.hit_ratio)
        # the full pages' slots also held the window pages, yet fewer of those than of blocks: the same bytes held
        # more blocks than a full-attention twin's (a block of 36 layers) could
        g = shared.groups
        assert g["sliding"]["objects_held_at_most"]["host"] < shared.capacity_blocks["host"] / 2
        assert g["full"]["blocks_held_at_most"]["device"] > g["full_attention_twin"]["device_blocks"]


def test_what_the_plan_refuses_for_hybrid_models(trace):
    with pytest.raises(ConfigError, match="cannot hold the longest request"):
        check_plannable(trace, PlanConfig(spec="gemma-3-27b", device_gb=40))
    with pytest.raises(ConfigError, match="cannot hold the longest request"):  # a block and its window page: two slots
        longest = max(r.input_length // 512 + 1 for r in trace)
        slot = planning_spec(PlanConfig(spec="gpt-oss-120b")).page_bytes
        check_plannable(trace, PlanConfig(spec="gpt-oss-120b", device_gb=1.5 * longest * slot / 1e9))
    with pytest.raises(UnknownNameError, match="qwen3-next-80b-a3b"):
        planning_spec(PlanConfig(spec="no-such-model"))
    with pytest.raises(ConfigError, match="state_every"):
        PlanConfig(spec="qwen3-next-80b-a3b", state_every=0)
