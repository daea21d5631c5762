"""The planner's measured costs: the fits recover known answers from synthetic timings, a profile is
read back as written and refused when corrupt or of another model, the cost models add up, and a
trace slice maps onto engine pages with its prefix sharing intact."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kvtier.app.plan import PlanConfig, plan_costs, run_plan
from kvtier.app.plan.config import TokenCosts
from kvtier.app.plan.engine_slice import block_tokens, engine_requests, make_slice, prefix_ids, prompt_tokens, take_slice
from kvtier.app.plan.engines import engine_model
from kvtier.app.plan.profile import (EngineTraits, IdleFit, LinkFit, PrefillFit, fit_after, fit_link, fit_prefill, load_profile,
                                     median_abs_pct_error, nnls)
from kvtier.app.plan.calibrate import idle_fit, load_links
from kvtier.app.plan.timing import NominalCosts, ProfiledCosts, simulate
from kvtier.app.workloads.mooncake import TraceRequest
from kvtier.errors import ConfigError

from support.plan_profiles import PREFILL, profile_of

TRUE = PREFILL


def grid(seed: int = 0, points: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = rng.integers(33, 4096, points)
    c = (rng.random(points) * (n - 1)).astype(int) // 32 * 32
    return n, c


def test_prefill_fit_recovers_the_coefficients_that_made_the_timings():
    n, c = grid()
    seconds = [TRUE.seconds(int(a), int(b)) for a, b in zip(n, c)]
    fit = fit_prefill(n, c, seconds, 32)
    for name in ("overhead_s", "per_token_s", "per_context_s", "per_page_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    # terms the timings do not have stay out
    assert fit.per_context_power_s == pytest.approx(0.0, abs=1e-15) and fit.per_cached_page_s == pytest.approx(0.0, abs=1e-12)
    assert fit.points == 40 and fit.fit_error_pct == 0.0


def test_prefill_fit_finds_the_exponent_of_a_context_term_that_is_not_quadratic_and_the_cost_of_a_cached_page():
    true = replace(TRUE, per_context_s=0.0, per_context_power_s=4e-5, context_power=1.4, per_cached_page_s=5e-5)
    n, c = grid(4)
    fit = fit_prefill(n, c, [true.seconds(int(a), int(b)) for a, b in zip(n, c)], 32)
    assert fit.context_power == 1.4 and fit.per_context_power_s == pytest.approx(4e-5, rel=1e-6)
    assert fit.per_cached_page_s == pytest.approx(5e-5, rel=1e-5)  # what reusing a page of prefix costs
    assert fit.per_context_s == pytest.approx(0.0, abs=1e-15) and fit.fit_error_pct == 0.0
    assert fit.seconds(4000, 1000) == pytest.approx(true.seconds(4000, 1000))


def test_prefill_fit_with_noise_predicts_within_the_noise_and_never_goes_negative():
    n, c = grid(1)
    rng = np.random.default_rng(2)
    seconds = [TRUE.seconds(int(a), int(b)) * (1 + 0.03 * rng.standard_normal()) for a, b in zip(n, c)]
    fit = fit_prefill(n, c, seconds, 32)
    assert min(fit.overhead_s, fit.per_token_s, fit.per_context_s, fit.per_page_s) >= 0
    tn, tc = grid(3)  # fresh points: the fit generalizes, it does not just interpolate its own
    truth = [TRUE.seconds(int(a), int(b)) for a, b in zip(tn, tc)]
    assert median_abs_pct_error([fit.seconds(int(a), int(b)) for a, b in zip(tn, tc)], truth) < 3.0
    # the attention term is what makes long prompts cost more than linearly: the fit keeps it
    assert fit.per_context_s == pytest.approx(TRUE.per_context_s, rel=0.25)


def test_link_fit_recovers_latency_and_bandwidth():
    sizes = [50_000 * k for k in (1, 4, 16, 64) for _ in range(3)]
    fit = fit_link(sizes, [120e-6 + b / 3e9 for b in sizes])
    assert fit.latency_s == pytest.approx(120e-6, rel=1e-6) and fit.bytes_per_s == pytest.approx(3e9, rel=1e-6)
    assert fit.seconds(0) == 0.0 and fit.seconds(3e9) == pytest.approx(1 + 120e-6)



def test_load_links_are_what_a_host_and_an_l3_hit_add_over_the_same_prefill_on_the_device():
    """A load is priced as the engine pays it: a prefill whose prefix only host held, less the fit of one whose
    device held it; an L3 hit's on top of that host load. The bench's links of the other ops are kept."""
    page = 50_000
    rows = {"host": [], "storage": []}
    for n in (300, 700, 1500, 3000):
        cached = (n - 1) // 32 * 32
        pages = cached // 32
        host = 1e-3 + pages * page / 2e9
        rows["host"].append((n, {"cached_tokens": cached, "host_pages": pages, "storage_pages": 0}, TRUE.seconds(n, cached) + host))
        rows["storage"].append((n, {"cached_tokens": cached, "host_pages": 0, "storage_pages": pages},
                                TRUE.seconds(n, cached) + host + 3e-4 + pages * page / 1e9))
    bench = {name: LinkFit(1e-5, 9e9) for name in ("host_to_device", "device_to_host", "storage_get", "storage_put")}
    links = load_links(TRUE, bench, rows, page)
    assert (links["host_to_device"].latency_s, links["host_to_device"].bytes_per_s) == (pytest.approx(1e-3), pytest.approx(2e9))
    assert (links["storage_get"].latency_s, links["storage_get"].bytes_per_s) == (pytest.approx(3e-4), pytest.approx(1e9))
    assert links["device_to_host"] is bench["device_to_host"] and links["storage_put"] is bench["storage_put"]
    assert bench["host_to_device"].latency_s == 1e-5  # the caller's links are not changed
    # where the grid measured the same prompt and prefix on the device, that is the reference, not the fit (which
    # misses this engine's prefills by 2 ms here, as much as a small load costs)
    points = [(n, row["cached_tokens"], TRUE.seconds(n, row["cached_tokens"]) + 2e-3) for n, row, _ in rows["host"]]
    off = {where: [(n, row, t + 2e-3) for n, row, t in rows[where]] for where in rows}
    paired = load_links(TRUE, bench, off, page, points + points)
    assert (paired["host_to_device"].latency_s, paired["storage_get"].latency_s) == (pytest.approx(1e-3), pytest.approx(3e-4))
    assert load_links(TRUE, bench, off, page)["host_to_device"].latency_s == pytest.approx(3e-3)

def test_after_request_fit_splits_a_fixed_part_from_a_drain_that_costs_only_when_bytes_move():
    sizes = [0, 0, 0, 100_000, 100_000, 200_000, 400_000, 1_600_000]
    overhead, drain = fit_after(sizes, [0.0003 + (0.0015 + b / 8e8 if b else 0.0) for b in sizes])
    assert overhead == pytest.approx(0.0003, rel=1e-6) and drain.latency_s == pytest.approx(0.0015, rel=1e-6)
    assert drain.bytes_per_s == pytest.approx(8e8, rel=1e-6) and drain.seconds(0) == 0.0
    with pytest.raises(ConfigError, match="2 or more sizes that move bytes"):
        fit_after([0, 0, 100], [0.1, 0.1, 0.2])


def test_nnls_clamps_a_term_least_squares_would_make_negative():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    b = np.array([3.0, 2.0, 1.0])  # falls with the second column: its best coefficient is negative
    assert np.linalg.lstsq(a, b, rcond=None)[0][1] < 0
    x = nnls(a, b)
    assert x[1] == 0.0 and x[0] == pytest.approx(2.0)


def test_fits_refuse_too_little_data():
    with pytest.raises(ConfigError, match="5 or more timings"):
        fit_prefill([64, 128, 256, 512], [0, 0, 0, 0], [0.1, 0.2, 0.4, 0.8], 32)
    with pytest.raises(ConfigError, match="2 or more sizes"):
        fit_link([100, 100], [0.1, 0.2])


def test_a_profile_reads_back_as_written(tmp_path):
    p = profile_of(traits=EngineTraits(settle="background", threads=2), idle=IdleFit([0.01, 0.1], [0.002, 0.005], [0.0, 0.1]),
                   after_request=LinkFit(0.001, 2e8))
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p


def test_idle_cost_rises_with_the_gap_on_a_log_scale_and_with_the_request():
    idle = IdleFit([0.01, 0.1, 1.0], [0.002, 0.006, 0.008], [0.0, 0.1, 0.2])
    assert idle.seconds(0.0, 1.0) == 0.0 and idle.seconds(0.005, 1.0) == pytest.approx(0.001)  # below the shortest gap: towards 0
    assert idle.seconds(0.1, 0.0) == pytest.approx(0.006) and idle.seconds(0.1, 0.5) == pytest.approx(0.006 + 0.05)
    assert idle.seconds(10.0, 1.0) == pytest.approx(0.008 + 0.2)  # past the longest: as the longest
    assert idle.seconds(0.0316227766, 1.0) == pytest.approx(0.004 + 0.05)  # halfway on a log scale
    assert IdleFit().seconds(1.0, 1.0) == 0.0


def test_idle_fit_splits_what_a_short_and_a_long_prompt_pay_into_a_fixed_part_and_a_share():
    # after 10 ms idle: 5 ms + 10 % more; after 100 ms: 8 ms + 20 %; the 1 s runs are noisy and would say less
    short = {0.0: [0.02] * 3, 0.01: [0.02 + 0.005 + 0.002] * 3, 0.1: [0.02 + 0.008 + 0.004] * 3, 1.0: [0.021] * 3}
    long = {0.0: [0.2] * 3, 0.01: [0.2 + 0.005 + 0.02] * 3, 0.1: [0.2 + 0.008 + 0.04] * 3, 1.0: [0.2] * 3}
    fit = idle_fit(short, long)
    assert fit.gaps_s == [0.01, 0.1, 1.0]
    assert fit.extra_s == pytest.approx([0.005, 0.008, 0.008]) and fit.extra_share == pytest.approx([0.1, 0.2, 0.2])


def test_the_queue_model_charges_the_idle_cost_only_to_a_request_that_finds_the_node_idle():
    profile = profile_of(idle=IdleFit([0.01], [0.05], [0.0]), prefill=PrefillFit(0.1, 0.0, 0.0, 0.0, 32))
    costs = ProfiledCosts(profile, 32, 1000.0)
    # three 0.1 s requests: the second arrives while the first runs (queued), the third after an idle second
    reqs = [TraceRequest(t, 64, 1, (i, 100 + i)) for i, t in enumerate((0, 50, 1200))]
    timing = simulate(reqs, [0, 0, 0], [(0, 0, 0)] * 3, PlanConfig(), costs, [(0, 0, 0)] * 3)
    assert timing.per_request_queue_s.tolist() == pytest.approx([0.0, 0.05, 0.0])
    assert timing.per_request_ttft_s.tolist() == pytest.approx([0.1, 0.15, 0.15])


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.pop("prefill"), "lacks 'prefill'"),
    (lambda d: d.update(format="something"), "format"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["prefill"].update(per_token_s=-1), "prefill.per_token_s must be a number >= 0"),
    (lambda d: d["prefill"].update(per_token_s="fast"), "'fast'"),
    (lambda d: d["links"].pop("storage_get"), "links must name"),
    (lambda d: d["links"]["storage_put"].update(latency_s=float("nan")), "latency_s"),
    (lambda d: d.update(page_tokens=16), "page_tokens 16"),
    (lambda d: d.update(surprise=1), "unknown keys ['surprise']"),
    (lambda d: d.update(idle={"gaps_s": [0.1, 0.01], "extra_s": [0.0, 0.0], "extra_share": [0.0, 0.0]}), "increasing gaps"),
    (lambda d: d.update(after_request={"latency_s": -1, "bytes_per_s": 1}), "after_request.latency_s"),
])
def test_a_corrupt_profile_is_one_config_error_naming_the_file(tmp_path, edit, needle):
    data = profile_of().as_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="not a kvtier plan profile") as e:
        load_profile(path)
    assert needle in str(e.value) and str(path) in str(e.value)


def test_a_missing_or_unreadable_profile_says_how_to_make_one(tmp_path):
    with pytest.raises(ConfigError, match="kvtier plan --calibrate"):
        load_profile(tmp_path / "absent.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_profile(tmp_path / "text.json")


def test_a_profile_of_another_model_or_engine_is_refused():
    hybrid = profile_of("run-hybrid")
    with pytest.raises(ConfigError, match="'reference-hybrid', not 'reference-dsa'"):
        plan_costs(PlanConfig(spec="reference-dsa"), hybrid, "h.json")
    with pytest.raises(ConfigError, match="--plan-spec reference-hybrid"):
        plan_costs(PlanConfig(), hybrid, "h.json")  # deepseek-v3.2: no engine of it to calibrate
    run = profile_of("run")
    run.check_model("reference-dsa", engine_model("reference-dsa").fingerprint())  # its own: accepted
    with pytest.raises(ConfigError, match="engine 'run', not 'vllm'"):
        run.check_model("reference-dsa", engine_model("reference-dsa").fingerprint(), engine="vllm")


def test_profiled_costs_add_up_as_the_engine_runs_them():
    p = profile_of()
    costs = ProfiledCosts(p, 32, 1000.0)
    link = p.links
    compute = TRUE.seconds(320, 6 * 32)
    # 2 device, 1 host, 3 storage pages: L3 read first, the load of 4 under the compute, then 5 pages backed up and saved
    service, after = costs.request(320, (2, 1, 3), (1, 5, 5))
    fetch, load, room = link["storage_get"].seconds(3000), link["host_to_device"].seconds(4000), link["device_to_host"].seconds(1000)
    assert service == pytest.approx(fetch + room + max(compute, load))
    assert after == 0.0  # the made-up profile holds nothing after a request
    drains = ProfiledCosts(profile_of(after_request=LinkFit(0.002, 1e6), after_request_overhead_s=0.0005), 32, 1000.0)
    assert drains.request(320, (2, 1, 3), (1, 5, 5))[1] == pytest.approx(0.0005 + 0.002 + 10 * 1000 / 1e6)
    assert drains.request(320, (2, 1, 3), (0, 0, 0))[1] == pytest.approx(0.0005)  # nothing to drain: its commit alone
    serial = ProfiledCosts(profile_of(traits=EngineTraits(load_overlaps_compute=False, settle="background"), after_request=LinkFit(1, 1)),
                           32, 1000.0)
    service, after = serial.request(320, (2, 1, 3), (0, 5, 5))
    assert service == pytest.approx(fetch + compute + load) and after == 0.0


def test_nominal_costs_are_the_planners_figures():
    cost = TokenCosts.of(PlanConfig())
    service, after = NominalCosts(cost).request(4096, (1, 2, 1), None)  # 4 of 8 blocks cached: the larger of compute and load
    assert after == 0.0
    assert service == pytest.approx(max(2048 * cost.recompute_s, 2 * 512 * cost.load_host_s + 512 * cost.load_storage_s))
    assert NominalCosts(cost).request(4096, (0, 0, 0), None)[0] == pytest.approx(4096 * cost.recompute_s)


def test_a_plan_says_where_its_times_come_from():
    trace = [TraceRequest(i * 1000, 2000, 1, (i % 3, 10 + i, 20 + i, 30 + i)) for i in range(20)]
    cfg = PlanConfig(spec="reference-dsa", device_gb=1, host_tb=0.01, storage_tb=0)
    assert run_plan(trace, cfg).cost_model["source"] == "nominal"
    report = run_plan(trace, cfg, costs=plan_costs(cfg, profile_of(), "p.json"))
    assert report.cost_model == {"source": "profile", "profile": "p.json", "engine": "run", "model": "reference-dsa",
                                 "measured_at": "2026-12-05T00:00:00"}
    assert report.latency["ttft_s"]["p50"] > 0


def test_prefix_ids_make_an_id_name_its_whole_prefix():
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1024, 1, (9, 2)), TraceRequest(2, 1100, 1, (1, 2))]
    a, b, c = prefix_ids(reqs)
    assert a.hash_ids[:2] == c.hash_ids[:2] and b.hash_ids[1] != a.hash_ids[1]  # block 2 under 9 is another block
    assert len(c.hash_ids) == 3 and c.hash_ids[2] not in a.hash_ids + b.hash_ids  # a tail without an id gets its own


def test_an_engine_slice_keeps_full_blocks_and_shares_exactly_what_the_trace_shares():
    reqs = [TraceRequest(0, 1100, 1, (5, 6, 7)), TraceRequest(2000, 1024, 1, (5, 6)), TraceRequest(4000, 600, 1, (8, 9))]
    scaled = engine_requests(reqs, 32)
    assert [r.input_length for r in scaled] == [68, 64, 37]
    assert [r.input_length // 32 for r in scaled] == [r.input_length // 512 for r in reqs]
    work = make_slice(reqs, 32, 2048, 0.5)
    assert work.arrivals_s == [0.0, 1.0, 2.0] and [len(p) for p in work.prompts] == [68, 64, 37]
    assert work.prompts[0][:64] == work.prompts[1][:64] and work.prompts[0][:32] != work.prompts[2][:32]
    assert all(100 <= t < 2048 for p in work.prompts for t in p)
    assert prompt_tokens(scaled[0], 32, 2048) == work.prompts[0]
    # a different block never repeats another's tokens, even in a small vocabulary
    blocks = {tuple(block_tokens(h, 32, 2048)) for h in range(2000)}
    assert len(blocks) == 2000


def test_a_slice_past_the_end_names_both_sizes():
    reqs = [TraceRequest(i, 600, 1, (i, i + 100)) for i in range(10)]
    assert len(take_slice(reqs, 4, 6, "t")) == 6
    with pytest.raises(ConfigError, match="runs past the end of t \\(10 requests\\); give --limit 6 or less"):
        take_slice(reqs, 4, 7, "t")
