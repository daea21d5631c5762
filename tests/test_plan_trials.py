"""``kvtier plan --validate --trials N``: the spread of what the engine measured, where the prediction falls in
it, and the TTFT error split by cause (service model, queue model, end to end).

The numbers checked here are recomputed from the raw values (each trial's per-request times, as the
engine returned them), never asserted as timings: the 2-core CI machine is shared."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.app.cli_validate import load_workload, print_report
from kvtier.app.plan.engine_slice import make_slice
from kvtier.app.plan.engines import engine
from kvtier.app.plan.profile import LinkFit
from kvtier.app.plan.split import per_request_error, queue_on_measured, split_error
from kvtier.app.plan.timing import ProfiledCosts
from kvtier.app.plan.trials import STATISTICS, bootstrap, judge, spreads, statistic
from kvtier.app.plan.validate import Setup, default_measure, predict, predicted_timing, validate
from kvtier.config import CacheConfig

from support.plan_profiles import profile_of

TIERS = ("device", "host", "storage")


# ---- the spread, on numbers ---------------------------------------------------------------------------------
def lognormal(trials: int, requests: int, seed: int = 1) -> np.ndarray:
    """TTFTs shaped like the engine's: skewed, a request's size showing in every trial."""
    rng = np.random.default_rng(seed)
    size = rng.lognormal(-3.5, 0.8, requests)
    return size * rng.lognormal(0.0, 0.1, (trials, requests))


def test_the_trial_range_holds_every_trials_statistic_and_the_interval_is_seeded_and_holds_the_pooled_one():
    measured = lognormal(3, 200)
    predicted = {k: float(statistic(measured[0], k)) for k in STATISTICS}
    got = spreads(predicted, measured)
    for k, s in got.items():
        own = [float(statistic(row, k)) for row in measured]
        assert s.trials == tuple(own) and s.trial_range == (min(own), max(own))
        assert s.measured == float(statistic(measured.reshape(-1), k))  # every trial's requests pooled
        assert s.interval[0] <= s.measured <= s.interval[1], (k, s.interval, s.measured)
        assert s.confidence == 0.95
    # the same numbers and seed: the same intervals; another seed: other ones
    assert bootstrap(measured) == bootstrap(measured) == {k: s.interval for k, s in got.items()}
    assert bootstrap(measured, seed=7) != bootstrap(measured)
    # resampling requests whole: a matrix whose trials are equal gives the interval of one trial's requests, resampled alike
    same = np.tile(measured[:1], (3, 1))
    one = bootstrap(measured[:1])
    assert {k: pytest.approx(v, rel=1e-12) for k, v in bootstrap(same).items()} == one


def test_the_prediction_is_judged_from_the_numbers_and_the_bias_is_the_median_signed_error_across_trials():
    measured = lognormal(3, 120, seed=2)
    s = spreads({"p50": 1.0}, measured)["p50"]
    low, high = min(s.trial_range[0], s.interval[0]), max(s.trial_range[1], s.interval[1])
    assert s.span == (low, high) and low < high
    for predicted, verdict in ((low * 0.9, "below"), (low, "inside"), ((low + high) / 2, "inside"), (high, "inside"),
                               (high * 1.1, "above")):
        got = spreads({"p50": predicted}, measured)["p50"]
        assert got.verdict == verdict == judge(predicted, low, high)
        errors = [(predicted - v) / v * 100 for v in got.trials]
        assert got.trial_errors_pct == pytest.approx(tuple(errors)) and got.bias_pct == pytest.approx(float(np.median(errors)))
    # below the spread: every trial measured more, so the bias is negative
    assert spreads({"p50": low * 0.9}, measured)["p50"].bias_pct < 0


# ---- the split, on the planner's own timing ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_slice():
    eng = engine("run")
    requests = load_workload("chat", None, 0, 24)
    profile = profile_of("run", after_request_overhead_s=1.5e-3, after_request=LinkFit(1e-4, 2e9))  # a drain after each request
    costs = ProfiledCosts(profile, eng.page_tokens, profile.page_bytes, "made-up")
    setup = Setup("base", 10, 20, CacheConfig())
    work = make_slice(requests, eng.page_tokens, eng.vocab, 0.05)
    pred = predict(eng, work, setup)
    return eng, requests, profile, costs, setup, work, pred


def test_a_predicted_ttft_is_its_queueing_plus_its_service_request_by_request(chat_slice):
    _eng, _requests, _profile, costs, _setup, work, pred = chat_slice
    timing = predicted_timing(work, pred, costs)
    assert np.array_equal(timing.per_request_ttft_s, timing.per_request_queue_s + timing.per_request_service_s)
    assert (timing.per_request_queue_s > 0).any() and (timing.per_request_queue_s == 0).any()  # the slice queues, at times
    # kvtier run's engine settles its tiers after each request (the profile's trait): the drain holds it before the next
    assert (timing.per_request_after_s > 0).all()


def test_the_queue_model_on_the_predicted_service_times_gives_back_the_predicted_ttft(chat_slice):
    """The queue run on given service and drain times is the planner's queue: fed the planner's own, it gives
    its TTFT exactly, so whatever it gets wrong on measured times is the queue model's."""
    _eng, _requests, _profile, costs, _setup, work, pred = chat_slice
    timing = predicted_timing(work, pred, costs)
    again = queue_on_measured(work.requests, work.time_scale, timing.per_request_service_s, timing.per_request_after_s)
    assert np.array_equal(again.per_request_ttft_s, timing.per_request_ttft_s)
    split = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s] * 2, [timing.per_request_service_s] * 2,
                        [timing.per_request_after_s] * 2)
    assert split.queue.error_pct == {"p50": 0.0, "p90": 0.0} and split.queue.per_request.median_abs_ms == 0.0
    assert split.service.median_abs_ms == split.drain.median_abs_ms == split.end_to_end.per_request.median_abs_ms == 0.0
    assert split.service.requests == split.end_to_end.per_request.requests == 2 * len(work.requests)
    # the end-to-end percentiles: the prediction's own against the trials' requests pooled (two equal trials
    # interpolate their percentiles otherwise than one: one trial to see them equal)
    one = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s], [timing.per_request_service_s],
                      [timing.per_request_after_s])
    assert one.end_to_end.error_pct == one.queue.error_pct == {"p50": 0.0, "p90": 0.0}


def test_the_service_error_is_per_request_and_signed(chat_slice):
    _eng, _requests, _profile, costs, _setup, work, pred = chat_slice
    timing = predicted_timing(work, pred, costs)
    slow = timing.per_request_service_s * 1.25  # every request took a quarter longer than predicted
    split = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s], [slow], [timing.per_request_after_s])
    assert split.service.median_signed_pct == pytest.approx(-20.0) and split.service.median_abs_pct == pytest.approx(20.0)
    assert split.service.median_signed_ms < 0
    e = per_request_error(np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 2.0]))
    assert (e.median_abs_ms, e.median_signed_ms, e.median_abs_pct, e.median_signed_pct) == (1000.0, 0.0, 50.0, 0.0)
    # an engine that does not time its service (vLLM's): the end-to-end row only
    none = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s], [[]], [[]])
    assert none.service is none.queue is None and none.end_to_end.error_pct == {"p50": 0.0, "p90": 0.0} and none.note


def test_each_parts_median_per_trial_is_judged_against_the_prediction(chat_slice):
    """The drain's level moves from one replay to the next: each trial's median is reported, and the prediction is
    judged inside, below or above their range."""
    _eng, _requests, _profile, costs, _setup, work, pred = chat_slice
    timing = predicted_timing(work, pred, costs)
    after = timing.per_request_after_s
    trials = [after * 0.9, after * 1.3, after * 1.1]  # a machine that drifted
    split = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s] * 3, [timing.per_request_service_s] * 3,
                        trials)
    level = float(np.median(after)) * 1e3
    d = split.drain_trials
    assert d.predicted_ms == pytest.approx(level, abs=1e-3) and d.verdict == "inside"
    assert d.trial_medians_ms == pytest.approx([0.9 * level, 1.3 * level, 1.1 * level], abs=1e-3)
    slower = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s] * 2, [timing.per_request_service_s] * 2,
                         [after * 1.2, after * 1.5])
    assert slower.drain_trials.verdict == "below" and slower.service_trials.verdict == "inside"  # (service: exact, one value)
    none = split_error(work.requests, work.time_scale, timing, [timing.per_request_ttft_s], [[]], [[]])
    assert none.drain_trials is None and none.service_trials is None


# ---- trials against kvtier run's engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trials_report(chat_slice):
    """kvtier run's engine serving 24 chat requests twice per configuration, base and half host, every run recorded."""
    eng, requests, profile, _costs, _setup, _work, _pred = chat_slice
    real = default_measure(eng, profile)
    calls = []

    def measure(work, setup):
        calls.append((setup.name, real(work, setup)))
        return calls[-1][1]

    report = validate(eng, requests, Setup("base", 10, 20, CacheConfig()), profile, "made-up.json", workload="chat", what="half-host",
                      target_load=0.3, measure=measure, trials=2, warmup=1)
    assert calls[0][0] == "base"  # the warm-up: served first, then discarded
    return report, calls[1:]


def test_trials_alternate_base_and_what_if_and_every_trial_serves_the_predicted_pages(trials_report):
    report, calls = trials_report
    assert [name for name, _ in calls] == ["base", "half host", "base", "half host"]  # after the warm-up
    assert [(r["trial"], r["configuration"], r["discarded"]) for r in report.runs] == [
        (0, "base", True), (1, "base", False), (1, "half host", False), (2, "base", False), (2, "half host", False)]
    # what the report keeps of each trial is that trial's run, the warm-up's nowhere
    for c in report.configurations:
        assert [t["wall_s"] for t in c.trials] == [round(r.wall_s, 3) for n, r in calls if n == c.setup["name"]]
    assert report.trials == 2
    for c, runs in zip(report.configurations, ([r for n, r in calls if n == "base"], [r for n, r in calls if n == "half host"])):
        assert len(c.trials) == 2 and c.error["requests_served_alike"] == 24 and c.error["hit_pages_equal"]
        for t, run in zip(c.trials, runs):
            assert t["requests_served_alike"] == 24 and t["hit_pages"] == c.predicted["hit_pages"]
            assert [tuple(p) for p in run.served] == [tuple(r["pages_predicted"]) for r in c.per_request]
        # the measured TTFT statistics are those of both trials' requests pooled
        pooled = np.concatenate([r.ttft_s for r in runs])
        assert c.split["end_to_end"]["measured"]["p50"] == float(np.percentile(pooled, 50))
        for k, s in c.spread.items():
            own = [float(statistic(np.asarray(r.ttft_s), k)) for r in runs]
            assert list(s["trials"]) == own and list(s["trial_range"]) == [min(own), max(own)]
            assert s["measured"] == float(statistic(pooled, k)) and s["interval"][0] <= s["measured"] <= s["interval"][1]
            low, high = min(own + [s["interval"][0]]), max(own + [s["interval"][1]])
            assert s["verdict"] == ("below" if s["predicted"] < low else "above" if s["predicted"] > high else "inside")
            assert s["bias_pct"] == pytest.approx(float(np.median([(s["predicted"] - v) / v * 100 for v in own])))
    base, half = report.configurations
    assert all(base.measured["hit_pages"][t] > 0 for t in TIERS)  # every tier served: the equality covers each
    assert half.measured["hit_pages"]["host"] < base.measured["hit_pages"]["host"]
    w = report.what_if["ttft_p50"]
    each = [(h["ttft_s"]["p50"] - b["ttft_s"]["p50"]) / b["ttft_s"]["p50"] * 100 for b, h in zip(base.trials, half.trials)]
    assert w["measured_change_trials_pct"] == pytest.approx(each, abs=0.01)
    assert w["verdict"] == judge(w["predicted_change_pct"], *w["measured_change_range_pct"])


def test_the_split_adds_up_per_request_and_its_parts_come_from_the_runs(trials_report):
    report, calls = trials_report
    for c in report.configurations:
        runs = [r for n, r in calls if n == c.setup["name"]]
        for i, row in enumerate(c.per_request):
            # predicted end to end = predicted queueing + predicted service (each rounded to 10 us in the report)
            assert row["ttft_predicted_s"] == pytest.approx(row["queue_predicted_s"] + row["service_predicted_s"], abs=1.5e-5)
            assert row["ttft_measured_trials_s"] == [round(r.ttft_s[i], 5) for r in runs]
            assert row["drain_predicted_s"] > 0 and "drain_measured_s" in row and "service_measured_s" in row
        sp = c.split
        n = 2 * 24
        assert sp["service"]["requests"] == sp["drain"]["requests"] == sp["end_to_end"]["per_request"]["requests"] == n
        # the engine's own service time: its TTFT less its wait, request by request
        for r in runs:
            assert np.allclose(np.asarray(r.ttft_s), np.asarray(r.queue_s) + np.asarray(r.service_s)) and min(r.drain_s) >= 0
        replayed = np.concatenate([queue_on_measured(report_work(report, c), report.time_scale, r.service_s, r.drain_s).per_request_ttft_s
                                   for r in runs])
        # (the arrivals from the report's time scale, rounded to 6 digits: equal to within that)
        assert sp["queue"]["predicted"]["p90"] == pytest.approx(float(np.percentile(replayed, 90)), rel=1e-5)
        assert sp["queue"]["measured"] == sp["end_to_end"]["measured"]
        # end to end: the same percentiles the spread judges, on both sides
        assert sp["end_to_end"]["predicted"]["p90"] == c.spread["p90"]["predicted"]
        assert sp["end_to_end"]["measured"]["p90"] == c.spread["p90"]["measured"]
    # (the split of the what-if is its own: another configuration, other service times)
    assert report.configurations[0].split != report.configurations[1].split


def report_work(report, c):
    eng = engine(report.engine)
    return make_slice(load_workload("chat", None, 0, report.requests), eng.page_tokens, eng.vocab, report.time_scale).requests


def test_the_human_report_shows_the_spread_the_judgement_and_the_split(trials_report, capsys, monkeypatch):
    report, _ = trials_report
    monkeypatch.setenv("COLUMNS", "240")
    print_report(report)
    out = capsys.readouterr().out
    for c in report.configurations:
        name = c.setup["name"]
        assert f"{name}: TTFT over 2 trials (ms)" in out and f"{name}: TTFT error by cause" in out
        for k, s in c.spread.items():
            assert f"TTFT {k}" in out and s["verdict"] in out
    for needle in ("trial range", "interval", "(95%)", "bias", "service", "drain after it", "queue, on measured service", "end to end"):
        assert needle in out, needle
