"""``kvtier plan``: the planner's command (registered by :mod:`kvtier.app.cli`, which derives its
``--plan-*`` and ``--cache-*`` flags from the config dataclasses)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from kvtier.errors import ConfigError


def _numbers(flag: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"{flag} takes numbers separated by commas, e.g. 0.25,0.5,1; got {text!r}")
    return values


def plan(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format trace (JSONL); default: the one shipped in the package"),
    limit: Optional[int] = typer.Option(None, help="plan only the first N requests"),
    sweep_host_tb: Optional[str] = typer.Option(
        None, "--sweep-host-tb", help="comma-separated host sizes (TB per node): hit ratio for each"
    ),
    sweep_device_gb: Optional[str] = typer.Option(None, "--sweep-device-gb", help="comma-separated device sizes (GB per node)"),
    sweep_storage_tb: Optional[str] = typer.Option(None, "--sweep-storage-tb", help="comma-separated L3 sizes (TB per node)"),
    compare_routing: bool = typer.Option(False, "--compare-routing", help="also plan every routing policy: hit ratio, TTFT, load balance"),
    plot_png: Optional[str] = typer.Option(
        None,
        "--plot",
        help="write a PNG: hit ratio vs capacity per routing policy (the sweep "
        "given, else host sizes from the smallest accepted), and prompt tokens per node",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    tenants: int = typer.Option(1, "--tenants", help="spread the trace's requests over this many tenants (request i is tenant i mod N), "
                                "none a hit for another's blocks: what isolating tenants costs in hits"),
    profile: Optional[str] = typer.Option(None, "--profile", help="an engine's measured costs (kvtier plan --calibrate): TTFT from "
                                          "them instead of the nominal --plan-* link speeds and FLOP rate", rich_help_panel="measured"),
    calibrate: Optional[str] = typer.Option(None, "--calibrate", help="measure --engine on this machine (prefill against prompt and "
                                            "cached prefix, each tier's links) and write the profile here", rich_help_panel="measured"),
    engine: str = typer.Option("run", "--engine", help="--calibrate's engine: run, run-hybrid (kvtier run's), vllm, vllm-hybrid "
                               "(vLLM's CPU engine with kvtier's connector)", rich_help_panel="measured"),
    calibrate_max_tokens: int = typer.Option(4096, "--calibrate-max-tokens", help="the longest prompt calibration measures (the fit is "
                                             "trusted up to it)", rich_help_panel="measured"),
    calibrate_reps: int = typer.Option(3, "--calibrate-reps", help="runs per calibration point (their median)", rich_help_panel="measured"),
    validate: Optional[str] = typer.Option(None, "--validate", help="replay a slice through the planner and through ENGINE (run, "
                                           "run-hybrid, vllm, vllm-hybrid) on real tiers, side by side (needs --profile)",
                                           rich_help_panel="measured"),
    workload: str = typer.Option("trace", "--workload", help="--validate's requests: trace (the shipped trace, or --trace) or chat "
                                 "(the synthetic multi-turn workload)", rich_help_panel="measured"),
    start: int = typer.Option(0, "--start", help="--validate: the slice's first request (--limit: its length, default 300)",
                              rich_help_panel="measured"),
    what_if: Optional[str] = typer.Option(None, "--what-if", help="--validate a second configuration too: half-host, write-back or "
                                          "write-through; reports the predicted change against the measured one",
                                          rich_help_panel="measured"),
    validate_load: float = typer.Option(0.5, "--validate-load", help="--validate: slow the trace's arrivals so the engine is busy this "
                                        "share of the time (as the profile predicts)", rich_help_panel="measured"),
    validate_time_scale: Optional[float] = typer.Option(None, "--validate-time-scale", help="--validate: machine seconds per trace "
                                                        "second instead (overrides --validate-load)", rich_help_panel="measured"),
    trials: int = typer.Option(3, "--trials", help="--validate: serve each configuration this many times, in alternation (base, "
                               "what-if, base, ...); each TTFT statistic with its trial range and a bootstrap interval",
                               rich_help_panel="measured"),
    validate_warmup: int = typer.Option(1, "--validate-warmup", help="--validate: discarded runs of the base configuration before the "
                                        "trials (a process's first run measures slow)", rich_help_panel="measured"),
    validate_device_pages: Optional[int] = typer.Option(None, "--validate-device-pages", help="--validate: device pages (default: a tenth "
                                                        "of the slice's distinct pages)", rich_help_panel="measured"),
    validate_host_pages: Optional[int] = typer.Option(None, "--validate-host-pages", help="--validate: host pages (default: a third of "
                                                      "the slice's distinct pages)", rich_help_panel="measured"),
    **flags,
) -> None:
    """Replay a trace through the cache logic at real model sizes (no tensors): hit ratio per tier, link load,
    queueing and TTFT per routing policy, load per node, load vs recompute. With --calibrate, measure an
    engine's costs; with --validate, check the planner against a real engine."""
    from dataclasses import replace

    from kvtier.app.cli_output import check_output_path, emit as _emit
    from kvtier.app.cli_options import build_sections
    from kvtier.config import CacheConfig
    from kvtier.app.plan import PlanConfig, min_host_tb, round_up, run_plan, sweep
    from kvtier.app.plan import compare_routing as compare
    from kvtier.app.plan.routing import ROUTING_POLICIES
    from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace, tenant_scoped

    sections = build_sections({"plan": PlanConfig, "cache": CacheConfig}, {}, flags)
    cfg, cache_cfg = sections["plan"], sections["cache"]
    if isinstance(tenants, bool) or not isinstance(tenants, int) or tenants < 1:
        raise ConfigError(f"--tenants must be a whole number >= 1; got {tenants!r}")
    if tenants > 1 and (calibrate or validate):
        raise ConfigError("--tenants plans a trace; --calibrate and --validate run without tenants: drop --tenants")
    if calibrate and validate:
        raise ConfigError("--calibrate and --validate are two runs: calibrate first, then --validate ENGINE --profile PATH")
    if calibrate:
        from kvtier.app.cli_validate import calibrate as run_calibration

        return run_calibration(calibrate, engine, calibrate_max_tokens, calibrate_reps, cache_cfg.io_backend, as_json)
    if validate:
        from kvtier.app.cli_validate import validate as run_validation

        return run_validation(validate, profile, workload, trace, start, limit, validate_device_pages, validate_host_pages, cache_cfg,
                              validate_load, validate_time_scale, what_if, as_json, trials,
                              validate_warmup)
    sweeps = {
        field: _numbers(flag, text)
        for field, flag, text in (
            ("host_tb", "--sweep-host-tb", sweep_host_tb),
            ("device_gb", "--sweep-device-gb", sweep_device_gb),
            ("storage_tb", "--sweep-storage-tb", sweep_storage_tb),
        )
        if text
    }
    if len(sweeps) > 1:
        raise ConfigError("sweep one tier at a time: give one of --sweep-host-tb, --sweep-device-gb, --sweep-storage-tb")
    check_output_path("--plot", plot_png)
    requests = tenant_scoped(load_mooncake_trace(trace or default_trace_path(), limit), tenants)
    costs = None
    if profile:
        from kvtier.app.plan import plan_costs
        from kvtier.app.plan.profile import load_profile

        costs = plan_costs(cfg, load_profile(profile), profile)
    report = run_plan(requests, cfg, cache_cfg, costs=costs)
    report.tenants = tenants
    if sweeps:
        [(field, values)] = sweeps.items()
    elif plot_png:  # the plot's default sweep: host sizes from the smallest accepted
        low = min_host_tb(requests, cfg)
        field, values = "host_tb", [round_up(low * f) for f in (1.0, 1.5, 2.0, 4.0)]
    # one sweep per routing policy for the plot; the configured policy's is the report's sweep
    policies = ROUTING_POLICIES if plot_png else (cfg.routing,) if sweeps else ()
    curves = {p: sweep(requests, replace(cfg, routing=p), field, values, cache_cfg, costs) for p in policies}
    if sweeps:
        report.sweep = curves[cfg.routing]
    if compare_routing or plot_png:
        report.routing_comparison = compare(requests, cfg, cache_cfg, costs)
    if plot_png:
        from kvtier.app.plan.plot import plot_plan

        loads = {
            row["routing"]: [{"node": j, "prompt_tokens": t} for j, t in enumerate(row["prompt_tokens_per_node"])]
            for row in report.routing_comparison
        }
        plot_plan(plot_png, field, curves, loads)
    if as_json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    from rich.console import Console

    d = report.as_dict()
    sweep_rows = d.pop("sweep")
    routing_rows = d.pop("routing_comparison")
    per_node = d.pop("per_node")
    _emit([{"metric": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in d.items()], False)
    if len(per_node) > 1:
        _emit(per_node, False)
    if sweep_rows:
        _emit(sweep_rows, False)
    if routing_rows:
        short = ("routing", "hit_total", "queue_delay_p99_s", "ttft_p50_s", "ttft_p99_s", "max_over_mean_prompt_tokens")
        _emit([{k: r[k] for k in short} for r in routing_rows], False)
    console = Console()
    for w in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    console.print(
        f"hit ratio {report.hit_ratio['total']:.1%} of an infinite-cache bound {report.infinite_cache_hit_ratio:.1%}; "
        f"TTFT p50 {report.latency['ttft_s']['p50']:.3f} s, p99 {report.latency['ttft_s']['p99']:.3f} s; "
        f"a host hit loads {report.load_vs_recompute['host_hit_speedup']}x faster than recomputing it"
    )
    costs_from = report.cost_model
    console.print(f"times from the measured profile {costs_from['profile']} (engine {costs_from['engine']}, {costs_from['measured_at']})"
                  if costs_from["source"] == "profile" else f"times from nominal figures: {costs_from['note']}")
    if plot_png:
        console.print(f"plot written to {plot_png}")
