"""``kvtier plan --calibrate`` and ``--validate`` against ``kvtier run``'s engine on a short slice.

The planner's replay and the engine share the policy core, the page granularity, the tier sizes,
the write policy and the request order, so every request must be served the same pages from
the same tiers, and every link must move the same bytes. Times go into the report only: this
suite asserts none of them (the 2-core CI machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.app.plan.calibrate import CalibrationPlan, load_lengths
from kvtier.app.plan.profile import load_profile

from support.plan_profiles import profile_of

TIERS = ("device", "host", "storage")


def kvtier(*argv: str, timeout: float = 300) -> dict:
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", *argv], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def run_profile(tmp_path_factory):
    """A profile of kvtier run's engine, measured on a small grid (seconds, not minutes)."""
    path = tmp_path_factory.mktemp("profile") / "run.json"
    written = kvtier("plan", "--calibrate", str(path), "--engine", "run", "--calibrate-max-tokens", "256", "--calibrate-reps", "1",
                     "--json")
    profile = load_profile(path)
    assert written["engine"] == profile.engine == "run" and profile.model == "reference-dsa"
    # what it measured is on record: prompt lengths from two pages to the maximum, each with cached prefixes
    points = profile.notes["prefill_points"]
    lengths = sorted({n for n, _, _ in points})
    assert (lengths[0], lengths[-1], len(lengths)) == (64, 256, 6) and any(c > 0 for _, c, _ in points)
    assert all(t > 0 for _, _, t in points) and profile.prefill.points == len(points)
    assert set(profile.links) == {"host_to_device", "device_to_host", "storage_get", "storage_put"}
    timed = CalibrationPlan().link_reps * len(CalibrationPlan().link_pages)  # each op at each page count, the warm-up round left out
    assert all(profile.links[name].bytes_per_s > 0 and profile.links[name].points == timed for name in ("device_to_host", "storage_put"))
    # loads are timed on the engine's own path: each prefix pushed off the device (and off the host), then loaded back whole
    ps = profile.page_tokens
    for name, where in (("host_to_device", "host"), ("storage_get", "storage")):
        rows = profile.notes[f"{where}_loads"]
        assert profile.links[name].points == len(rows) == len(load_lengths(lengths))
        other = "storage" if where == "host" else "host"
        assert all(row[f"{where}_pages"] == (n - 1) // ps and row[f"{other}_pages"] == 0 and row["cached_tokens"] == (n - 1) // ps * ps
                   for n, row, _ in rows), rows
    return str(path)


def check_same_as_the_engine(config: dict, requests: int) -> None:
    pred, meas, err = config["predicted"], config["measured"], config["error"]
    assert pred["hit_pages"] == meas["hit_pages"], (pred["hit_pages"], meas["hit_pages"])
    assert err["requests_served_alike"] == requests and err["hit_pages_equal"]
    assert [r["pages_predicted"] for r in config["per_request"]] == [r["pages_measured"] for r in config["per_request"]]
    assert pred["bytes_moved"] == meas["bytes_moved"]
    assert all(err["hit_ratio_pp"][t] == 0.0 for t in (*TIERS, "total"))
    # the report's time fields are there (their values are the benchmark's business, not the suite's)
    for side in (pred, meas):
        assert set(side["ttft_s"]) == {"mean", "p50", "p90", "p99"} and side["ttft_s"]["p50"] > 0
    assert set(err["ttft_pct"]) == {"mean", "p50", "p90", "p99"} and err["ttft_per_request_mape_pct"] >= 0


def test_validate_run_engine_serves_exactly_what_the_planner_predicts(run_profile):
    report = kvtier("plan", "--validate", "run", "--profile", run_profile, "--workload", "chat", "--limit", "30",
                    "--validate-device-pages", "20", "--validate-host-pages", "40", "--what-if", "half-host", "--trials", "2", "--json")
    assert report["engine"] == "run" and report["requests"] == 30 and report["workload"] == "chat"
    # a discarded warm-up, then two trials, base and what-if in alternation (tests/test_plan_trials.py checks the spread and
    # the split they give)
    assert report["trials"] == 2 and [(r["trial"], r["configuration"], r["discarded"]) for r in report["runs"]] == [
        (0, "base", True), (1, "base", False), (1, "half host", False), (2, "base", False), (2, "half host", False)]
    assert report["profile"]["source"] == "profile" and report["profile"]["profile"] == run_profile
    assert 0 < report["time_scale"] and report["target_load"] == 0.5
    base, half = report["configurations"]
    assert (base["setup"]["host_pages"], half["setup"]["host_pages"]) == (40, 20)
    for config in (base, half):
        check_same_as_the_engine(config, 30)
        assert [t["requests_served_alike"] for t in config["trials"]] == [30, 30]
        assert set(config["spread"]) == {"p50", "p90", "p99", "mean"}
        assert set(config["split"]) >= {"service", "drain", "queue", "end_to_end"}
    # the slice and the sizes make every tier serve: the equality covers device, host and L3 hits
    assert all(base["measured"]["hit_pages"][t] > 0 for t in TIERS)
    assert half["measured"]["hit_pages"]["host"] < base["measured"]["hit_pages"]["host"]
    w = report["what_if"]
    assert (w["from"], w["to"]) == ("base", "half host")
    assert w["hit_host"]["error_pp"] == 0.0 and w["hit_host"]["measured_change_pp"] < 0
    assert {"predicted_change_pct", "measured_change_pct", "error_pp"} <= set(w["ttft_p50"])


def test_validate_hybrid_run_engine_serves_exactly_what_the_planner_predicts(tmp_path):
    """The hybrid engine's window pages and state snapshots come from its own allocation
    (``HybridObjects``), which the planner's replay of it makes too: the same hits."""
    path = tmp_path / "hybrid.json"
    profile_of("run-hybrid").save(path)
    report = kvtier("plan", "--validate", "run-hybrid", "--profile", str(path), "--workload", "chat", "--limit", "24",
                    "--validate-device-pages", "16", "--validate-host-pages", "32", "--cache-write-policy", "write_back",
                    "--what-if", "write-through", "--trials", "1", "--validate-warmup", "0", "--json")
    assert [(r["trial"], r["configuration"]) for r in report["runs"]] == [(1, "base"), (1, "write_through")]
    back, through = report["configurations"]
    assert (back["setup"]["write_policy"], through["setup"]["write_policy"]) == ("write_back", "write_through")
    for config in (back, through):
        check_same_as_the_engine(config, 24)
    assert back["measured"]["hit_pages"]["device"] > 0 and back["measured"]["hit_pages"]["host"] > 0
