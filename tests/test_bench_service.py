"""``kvtier bench service`` (issue 46's benchmark), a small run: a real ``kvtier serve`` per part, both sides
of every row measured in the run, and the facts its figures stand on -- the attached engine's lookups took
the published pages from the service, one copy of the pages is held for two engines, the second engine
is served every page the first computed, from host; an engine's lookups are timed beside a flooding client too."""

from __future__ import annotations

import json

import pytest

from support.cli import kvtier

from kvtier.service.wire import MAX_FRAME

PAGE = 64  # the bench's page formats' page size


def test_bench_service_prints_every_row_with_both_sides_measured_in_the_run():
    r = kvtier("bench", "service", "--json", "--prompt-tokens", "256", "--requests", "6", "--copy-pages", "16", "--rounds", "2",
               "--trace-limit", "6", "--checksum-pages", "2", "--scheduler-waiting", "1,8")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["case"] for row in out["lookup"]] == ["host_hit", "miss"]
    for row in out["lookup"]:
        assert row["pages"] == 256 // PAGE and row["requests"] == 6
        assert 0 < row["in_process_p50_us"] <= row["in_process_p99_us"] and 0 < row["service_p50_us"] <= row["service_p99_us"]
        assert row["p50_ratio"] == round(row["service_p50_us"] / row["in_process_p50_us"], 3)
    bw = out["bandwidth"]
    assert bw["pages"] == 16 and bw["private_gbps"] > 0 and bw["region_gbps"] > 0
    assert bw["ratio"] == pytest.approx(bw["region_gbps"] / bw["private_gbps"], rel=0.02)  # (the GB/s printed rounded)
    share = out["sharing"]
    assert share["requests"] == 6
    # two engines of their own hold two copies; through the service, one
    assert share["in_process_host_bytes"] == 2 * share["service_host_bytes"] > 0
    # the second engine attached to the service is served every full page of the workload, from host
    assert share["service_second_hit_ratio"] == 1.0
    assert share["service_second_host_hit_pages"] == share["input_tokens"] // PAGE
    assert share["in_process_second_hit_ratio"] < 1.0
    # an engine's lookups alone and beside a client flooding the largest lookup frames, both in this run
    flood = out["flood"]
    assert flood["pages"] == 256 // PAGE and flood["lookups"] == 6 and flood["flood_frames"] >= 1
    assert flood["flood_frame_bytes"] > MAX_FRAME // 2
    assert 0 < flood["alone_p50_us"] <= flood["alone_p99_us"] and 0 < flood["flooded_p50_us"] <= flood["flooded_p99_us"]
    assert flood["p50_ratio"] == round(flood["flooded_p50_us"] / flood["alone_p50_us"], 3)
    assert flood["p99_ratio"] == round(flood["flooded_p99_us"] / flood["alone_p99_us"], 3)
    # the page records' checksum against a copy of the same bytes, per host layout; the region they fill adopted whole
    assert [row["layout"] for row in out["checksum"]] == ["page_first", "layer_first"]
    for row in out["checksum"]:
        assert row["pages"] == 2 and row["checksum_gbps"] > 0 and row["copy_gbps"] > 0 and row["adopt_gbps"] > 0
        assert row["speed_over_copy"] == pytest.approx(row["checksum_gbps"] / row["copy_gbps"], rel=0.02)
    # MLA's latent once per node: a page of TP ranks is one rank's bytes, 1/TP of every rank's copy kept
    for row in out["mla_once"]:
        assert row["per_rank_page_bytes"] == row["tp_size"] * row["region_page_bytes"]
        assert row["saved_fraction"] == round(1 - 1 / row["tp_size"], 3)
    # vLLM's scheduler asking about waiting requests: a round trip each, or one a step (the bench checks every answer
    # was a whole host hit, and refuses to print otherwise)
    assert [row["waiting"] for row in out["scheduler_steps"]] == [1, 8]
    for row in out["scheduler_steps"]:
        assert (row["per_request_round_trips"], row["per_step_round_trips"]) == (row["waiting"], 1)
        assert row["per_step_ms"] == pytest.approx(row["first_step_ms"] + row["second_step_ms"], abs=0.002)
        assert min(row["in_process_ms"], row["per_request_ms"], row["second_step_ms"]) > 0
        assert row["per_request_over_per_step"] == pytest.approx(row["per_request_ms"] / row["per_step_ms"], rel=0.02, abs=0.01)


@pytest.mark.integration
@pytest.mark.timeout(1500)  # (five vLLM engine starts: past the suite's 300 s default on a loaded machine)
def test_bench_service_vllm_row_times_a_restarted_engine_served_from_the_service():
    """Five vLLM engine processes (vLLM's CPU build): each side's prompt served every page from the tier its
    row names (the bench checks it and refuses to print otherwise), TTFTs measured in this run."""
    r = kvtier("bench", "service", "--json", "--prompt-tokens", "128", "--requests", "4", "--copy-pages", "4", "--rounds", "1",
               "--trace-limit", "2", "--vllm", "--vllm-prompt-tokens", "300", "--vllm-prompts", "1", timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout)["vllm"]
    assert row["model"] == "smollm2" and row["prompt_tokens"] == 300 and row["prompts"] == 1
    assert row["hit_pages"] >= 1  # whatever block size vLLM chose, the prefix fills at least one block
    for side in ("service_restarted", "in_process_host", "file_l3_restarted", "recompute"):
        assert row[f"{side}_ttft_ms"] > 0
    assert row["service_over_in_process"] == pytest.approx(row["service_restarted_ttft_ms"] / row["in_process_host_ttft_ms"], rel=0.01)
