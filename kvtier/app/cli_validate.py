"""``kvtier plan --calibrate`` and ``kvtier plan --validate``: the planner's measured costs, and its check
against a real engine (registered by :mod:`kvtier.app.cli_plan`, which owns the ``plan`` command)."""

from __future__ import annotations

import json
import sys

from kvtier.errors import ConfigError

#: ``--workload``: the shipped Mooncake trace (or ``--trace``), or the synthetic multi-turn chat trace
WORKLOADS = ("trace", "chat")
#: requests a validation replays when ``--limit`` is not given
DEFAULT_SLICE = 300


def load_workload(workload: str, trace: str | None, start: int, limit: int | None):
    """The validation slice: ``limit`` requests from ``start`` of the trace or of the chat workload."""
    from kvtier.app.plan.engine_slice import take_slice

    if workload == "chat":
        from kvtier.app.workloads.synthetic import ChatTrace

        if trace:
            raise ConfigError("--workload chat generates its requests: leave --trace out, or give --workload trace")
        requests, source = ChatTrace().requests(), "the synthetic chat workload"
    elif workload == "trace":
        from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace

        path = trace or default_trace_path()
        requests, source = load_mooncake_trace(path), f"trace {path}"
    else:
        from kvtier.errors import UnknownNameError

        raise UnknownNameError("workload", workload, WORKLOADS)
    return take_slice(requests, start, DEFAULT_SLICE if limit is None else limit, source)


def default_tiers(requests, page_tokens: int) -> tuple[int, int]:
    """Device and host pages that make every tier serve on ``requests`` (shrunk to the engine's page):
    a device of a tenth of the distinct pages (at least twice the longest request), a host of a
    third (at least the device plus two of the longest), the rest from L3."""
    longest = max(-(-r.input_length // page_tokens) for r in requests)
    distinct = len({h for r in requests for h in r.hash_ids[: r.input_length // page_tokens]})
    device = max(2 * longest, distinct // 10)
    return device, max(device + 2 * longest, distinct // 3)


def calibrate(out: str, engine_name: str, max_tokens: int, reps: int, io_backend: str, as_json: bool) -> None:
    from kvtier.app.cli_output import check_output_path
    from kvtier.app.plan.calibrate import CalibrationPlan, calibrate_run_engine
    from kvtier.app.plan.engines import engine

    check_output_path("--calibrate", out)
    eng = engine(engine_name)
    plan = CalibrationPlan(max_tokens=max_tokens, reps=reps)
    plan.prompt_lengths(eng.page_tokens)  # (a bad grid fails here, before anything runs)
    say = (lambda m: None) if as_json else (lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    if eng.vllm_model is not None:
        from kvtier.app.plan.calibrate import calibrate_vllm

        profile = calibrate_vllm(eng, plan, io_backend=io_backend, progress=say)
    else:
        profile = calibrate_run_engine(eng, plan, io_backend=io_backend, progress=say)
    profile.save(out)
    if as_json:
        json.dump(profile.as_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    p = profile.prefill
    print(f"profile of engine {profile.engine} ({profile.model}) written to {out}")
    print(f"  prefill: {p.overhead_s * 1e3:.2f} ms + {p.per_token_s * 1e6:.1f} us/token + {p.per_context_s * 1e9:.3f} ns/token^2 "
          f"+ {p.per_page_s * 1e3:.2f} ms/page ({p.points} points, median error {p.fit_error_pct}%)")
    for name, link in profile.links.items():
        print(f"  {name}: {link.latency_s * 1e6:.0f} us + {link.bytes_per_s / 1e9:.2f} GB/s (median error {link.fit_error_pct}%)")


def validate(engine_name: str, profile_path: str | None, workload: str, trace: str | None, start: int, limit: int | None,
             device_pages: int | None, host_pages: int | None, cache_cfg, target_load: float, time_scale: float | None,
             what: str | None, as_json: bool, trials: int = 3, warmup: int = 1) -> None:
    from kvtier.app.plan.engines import engine
    from kvtier.app.plan.profile import load_profile
    from kvtier.app.plan.validate import Setup, check_setup, validate as run_validation, what_if

    eng = engine(engine_name)
    check_setup(eng, cache_cfg, what)
    if profile_path is None:
        raise ConfigError(f"--validate needs the engine's measured costs: give --profile PATH (write one with "
                          f"kvtier plan --calibrate PATH --engine {engine_name})")
    profile = load_profile(profile_path)
    if not 0 < target_load < 1:
        raise ConfigError(f"--validate-load is the share of time the engine should be busy, between 0 and 1; got {target_load}")
    if time_scale is not None and not time_scale > 0:
        raise ConfigError(f"--validate-time-scale is machine seconds per trace second, > 0; got {time_scale}")
    if trials < 1:
        raise ConfigError(f"--trials is how many times each configuration is served, 1 or more; got {trials}")
    if warmup < 0:
        raise ConfigError(f"--validate-warmup is how many discarded runs of the base configuration come first, 0 or more; got {warmup}")
    requests = load_workload(workload, trace, start, limit)
    from kvtier.app.plan.engine_slice import engine_requests

    dev, host = default_tiers(engine_requests(requests, eng.page_tokens), eng.page_tokens)
    setup = Setup("base", device_pages or dev, host_pages or host, cache_cfg)
    for pages, flag in ((setup.device_pages, "--validate-device-pages"), (setup.host_pages, "--validate-host-pages")):
        if pages < 1:
            raise ConfigError(f"{flag} must be 1 or more pages; got {pages}")
    if what:
        what_if(setup, what)  # (a what-if that changes nothing fails here, before anything runs)
    report = run_validation(eng, requests, setup, profile, profile_path, workload=workload, start=start, time_scale=time_scale,
                            target_load=target_load, what=what, trials=trials, warmup=warmup)
    from kvtier.app.plan.calibrate import machine

    report.machine = machine()
    if as_json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    print_report(report)


def print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for c in report.configurations:
        s = c.setup
        t = Table(title=f"kvtier plan --validate {report.engine}: {report.requests} requests of {report.workload} from {report.start}, "
                        f"{s['name']} ({s['device_pages']} device / {s['host_pages']} host pages, {s['write_policy']})")
        for col in ("metric", "predicted", "measured", "error"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        p, m, e = c.predicted, c.measured, c.error
        for tier, pp in e["hit_ratio_pp"].items():
            t.add_row(f"hit ratio {tier}", f"{p['hit_ratio'][tier]:.2%}", f"{m['hit_ratio'][tier]:.2%}", f"{pp:+.2f} pp")
        for link, pct in e["bytes_pct"].items():
            t.add_row(f"bytes {link.replace('_', ' ')}", f"{p['bytes_moved'][link] / 1e6:.2f} MB", f"{m['bytes_moved'][link] / 1e6:.2f} MB",
                      "-" if pct is None else f"{pct:+.1f}%")
        for k in ("p50", "p90", "p99"):
            t.add_row(f"TTFT {k}", f"{p['ttft_s'][k] * 1e3:.1f} ms", f"{m['ttft_s'][k] * 1e3:.1f} ms", f"{e['ttft_pct'][k]:+.1f}%")
        t.add_row("TTFT per request", "", "", f"median |error| {e['ttft_per_request_mape_pct']:.1f}%")
        t.add_row("requests served alike", "", "", f"{e['requests_served_alike']} of {report.requests}"
                  + (" (the fewest of any trial)" if report.trials > 1 else ""))
        console.print(t)
        console.print(spread_table(c, report.trials))
        console.print(split_table(c))
    if report.what_if:
        w = report.what_if
        t = Table(title=f"what-if: {w['from']} -> {w['to']}")
        for col in ("metric", "predicted change", "measured change", "error"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for k in ("p50", "p90"):
            r = w[f"ttft_{k}"]
            rng = r["measured_change_range_pct"]
            judged = f"; {r['verdict']} the trials' {rng[0]:+.1f}..{rng[1]:+.1f}%" if rng and report.trials > 1 else ""
            t.add_row(f"TTFT {k}", f"{r['predicted_change_pct']:+.1f}%", f"{r['measured_change_pct']:+.1f}%",
                      f"{r['error_pp']:+.1f} pp{judged}")
        for tier in ("device", "host", "storage", "total"):
            r = w[f"hit_{tier}"]
            t.add_row(f"hit ratio {tier}", f"{r['predicted_change_pp']:+.2f} pp", f"{r['measured_change_pp']:+.2f} pp",
                      f"{r['error_pp']:+.2f} pp")
        console.print(t)
    scale = f"time scale {report.time_scale:g} machine s per trace s"
    if report.target_load is not None:
        scale += f" (for {report.target_load:.0%} of the engine's time busy, as the profile predicts)"
    console.print(f"{scale}; costs from {report.profile.get('profile')} (engine {report.profile.get('engine')}, "
                  f"measured {report.profile.get('measured_at')})")


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def spread_table(c, trials: int):
    """A configuration's TTFT statistics over the trials: the pooled measurement, the trial range, the bootstrap
    interval, where the prediction falls and the median signed error across trials."""
    from rich.table import Table

    t = Table(title=f"{c.setup['name']}: TTFT over {trials} trial{'s' if trials > 1 else ''} (ms)")
    for col in ("statistic", "predicted", "measured, pooled", "trial range", "interval", "prediction", "bias"):
        t.add_column(col, justify="left" if col == "statistic" else "right")
    for k, s in c.spread.items():
        lo, hi = s["trial_range"]
        ilo, ihi = s["interval"]
        bias = "-" if s["bias_pct"] is None else f"{s['bias_pct']:+.1f}%"
        t.add_row(f"TTFT {k}", _ms(s["predicted"]), _ms(s["measured"]), f"{_ms(lo)}..{_ms(hi)}",
                  f"{_ms(ilo)}..{_ms(ihi)} ({s['confidence']:.0%})", s["verdict"], bias)
    return t


def split_table(c):
    """A configuration's TTFT error by cause: the service model (per request, no queueing), the queue model (on the
    measured service times) and the two together."""
    from rich.table import Table

    sp = c.split
    t = Table(title=f"{c.setup['name']}: TTFT error by cause")
    for col in ("model", "compared", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col in ("model", "compared") else "right")

    def per_request(name: str, what: str, e: dict | None) -> None:
        if e is None:
            return
        pct = "" if e["median_signed_pct"] is None else f" ({e['median_abs_pct']:.1f}% / {e['median_signed_pct']:+.1f}%)"
        t.add_row(name, what, "", "", f"|{e['median_abs_ms']:.2f}| / {e['median_signed_ms']:+.2f} ms{pct}")

    per_request("service", "per request, median |error| / signed", sp["service"])
    per_request("drain after it", "per request, median |error| / signed", sp["drain"])
    for name, spread in (("service", sp.get("service_trials")), ("drain after it", sp.get("drain_trials"))):
        if spread is not None:  # (its median per trial: a bias inside the trials' own drift says little)
            medians = spread["trial_medians_ms"]
            t.add_row(name, "median per request, trials' range", f"{spread['predicted_ms']:.2f} ms",
                      f"{min(medians):.2f}..{max(medians):.2f} ms", spread["verdict"])
    for name, row in (("queue, on measured service", sp["queue"]), ("end to end", sp["end_to_end"])):
        if row is None:
            continue
        for k, e in row["error_pct"].items():
            t.add_row(name, f"TTFT {k}", _ms(row["predicted"][k]), _ms(row["measured"][k]), "-" if e is None else f"{e:+.1f}%")
        per_request(name, "per request, median |error| / signed", row["per_request"])
    if sp["note"]:
        t.caption = sp["note"]
    return t
