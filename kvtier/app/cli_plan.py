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
    **flags,
) -> None:
    """Replay a trace through the cache logic at real model sizes (no tensors): hit ratio per tier, link load,
    queueing and TTFT per routing policy, load per node, load vs recompute."""
    from dataclasses import replace

    from kvtier.app.cli_output import check_output_path, emit as _emit
    from kvtier.app.cli_options import build_sections
    from kvtier.config import CacheConfig
    from kvtier.app.plan import PlanConfig, min_host_tb, round_up, run_plan, sweep
    from kvtier.app.plan import compare_routing as compare
    from kvtier.app.plan.routing import ROUTING_POLICIES
    from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace

    sections = build_sections({"plan": PlanConfig, "cache": CacheConfig}, {}, flags)
    cfg, cache_cfg = sections["plan"], sections["cache"]
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
    requests = load_mooncake_trace(trace or default_trace_path(), limit)
    report = run_plan(requests, cfg, cache_cfg)
    if sweeps:
        [(field, values)] = sweeps.items()
    elif plot_png:  # the plot's default sweep: host sizes from the smallest accepted
        low = min_host_tb(requests, cfg)
        field, values = "host_tb", [round_up(low * f) for f in (1.0, 1.5, 2.0, 4.0)]
    # one sweep per routing policy for the plot; the configured policy's is the report's sweep
    policies = ROUTING_POLICIES if plot_png else (cfg.routing,) if sweeps else ()
    curves = {p: sweep(requests, replace(cfg, routing=p), field, values, cache_cfg) for p in policies}
    if sweeps:
        report.sweep = curves[cfg.routing]
    if compare_routing or plot_png:
        report.routing_comparison = compare(requests, cfg, cache_cfg)
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
    if plot_png:
        console.print(f"plot written to {plot_png}")
