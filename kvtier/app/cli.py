"""The ``kvtier`` command line: ``run``, ``plan``, ``bench {transfer,cache,storage,sglang,plan}``, ``spec``."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from kvtier.errors import ConfigError, KVTierError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvtier: a tiered, paged KV cache for LLM inference.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print measured ratios as JSON.")
app.add_typer(bench_app, name="bench")


def _emit(rows: object, as_json: bool) -> None:
    if as_json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    rows_list = rows if isinstance(rows, list) else [rows]
    table = Table()
    for key in rows_list[0]:
        table.add_column(key)
    for row in rows_list:
        table.add_row(*(str(v) for v in row.values()))
    Console().print(table)


@app.command()
def spec(name: Optional[str] = typer.Argument(None, help="preset name; omit to list presets")) -> None:
    """Show a preset KVSpec's per-token and per-page sizes."""
    from kvtier.spec import PRESETS, KVSpec

    if name is None:
        _emit([{"preset": k, "attention": s.attention, "layers": s.num_layers, "page_bytes": s.page_bytes} for k, s in PRESETS.items()], False)
        return
    json.dump(KVSpec.preset(name).describe(), sys.stdout, indent=1)
    sys.stdout.write("\n")


@bench_app.command("transfer")
def bench_transfer(
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
    pages: int = typer.Option(256, help="pages per transfer (256 x 64 tokens = a 16k-token request)"),
    layers: int = typer.Option(4, help="model layers kept (per-layer cost does not depend on depth)"),
    reps: int = typer.Option(12, help="timed repetitions per case (median reported)"),
) -> None:
    """Page transfer throughput per layout x direction x spec x buffer, vs a contiguous copy."""
    from kvtier.app.bench.transfer import as_json_rows, run_transfer_bench

    _emit(as_json_rows(run_transfer_bench(pages_per_transfer=pages, layers=layers, reps=reps)), as_json)


@bench_app.command("cache")
def bench_cache(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format trace (JSONL); default: the one shipped in the package"),
    limit: Optional[int] = typer.Option(None, help="replay only the first N requests"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    vllm: Optional[bool] = typer.Option(None, "--vllm/--no-vllm", help="replay through vLLM's KVCacheManager too (default: when vLLM is installed)"),
    sglang: Optional[bool] = typer.Option(None, "--sglang/--no-sglang", help="replay through SGLang's RadixCache too (default: when its wheel is found)"),
    sglang_wheel: Optional[str] = typer.Option(None, help="sglang-0.5.23 wheel (default: $KVTIER_SGLANG_WHEEL, else .kvtier/wheels/)"),
) -> None:
    """Prefix bookkeeping throughput (keys + match + insert) on a trace, and its share of a 16k-token load."""
    from kvtier.app.bench.cache import as_json as to_json, run_cache_bench
    from kvtier.app.workloads.mooncake import default_trace_path

    _emit(to_json(run_cache_bench(trace or str(default_trace_path()), limit, vllm=vllm, sglang=sglang, sglang_wheel=sglang_wheel)), as_json)


@bench_app.command("storage")
def bench_storage(
    backends: str = typer.Option("file,redis,redis-cluster,mooncake", help="comma-separated backends to measure: file, redis, redis-cluster (3 nodes), mooncake; servers are started on 127.0.0.1"),
    pages: int = typer.Option(96, help="deepseek-v3.2 pages per round (1.25 MB each at 16 tokens a page)"),
    reps: int = typer.Option(20, help="rounds per op, kvtier and the plain client taking turns (best and median reported)"),
    page_size: int = typer.Option(16, help="tokens per page: 16 gives the 1 MiB-class page objects (1.25 MB), the preset's 64 gives 5.0 MB"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    """L3 put/get throughput per backend, as a ratio to the backend's own client on the same server."""
    from kvtier.app.bench.storage import as_json_rows, run_storage_bench

    _emit(as_json_rows(run_storage_bench(tuple(b for b in backends.split(",") if b), pages, reps, page_size)), as_json)


@bench_app.command("sglang")
def bench_sglang(
    backends: str = typer.Option("file,mooncake", help="comma-separated: file (vs SGLang's HiCacheFile), mooncake (vs SGLang's MooncakeStore; a local master is started)"),
    pages: int = typer.Option(128, help="host pages per round (SGLang's storage batch is 128)"),
    reps: int = typer.Option(10, help="rounds per op, the two backends taking turns (best and median reported)"),
    layout: str = typer.Option("page_first", help="SGLang host pool layout: page_first, layer_first, page_first_direct"),
    sglang_wheel: Optional[str] = typer.Option(None, help="sglang-0.5.23 wheel (default: $KVTIER_SGLANG_WHEEL, else .kvtier/wheels/)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    """kvtier as SGLang's HiCache storage backend: set/get GB/s through SGLang's host pool and controller, vs SGLang's own backends."""
    from kvtier.app.bench.sglang_storage import as_json_rows, run_sglang_bench
    from kvtier.app.sglang_wheel import find_sglang_wheel, import_sglang

    if layout not in ("page_first", "layer_first", "page_first_direct"):
        from kvtier.errors import UnknownNameError

        raise UnknownNameError("SGLang host pool layout", layout, ("page_first", "layer_first", "page_first_direct"))
    import_sglang(find_sglang_wheel(sglang_wheel))
    _emit(as_json_rows(run_sglang_bench(tuple(b for b in backends.split(",") if b), pages, reps, layout=layout)), as_json)


@bench_app.command("plan")
def bench_plan(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format trace (JSONL); default: the one shipped in the package"),
    limit: Optional[int] = typer.Option(None, help="replay only the first N requests"),
    reps: int = typer.Option(5, help="timed repetitions of the fast replay (median reported; the cache replay gets half)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """kvtier plan's replay speed: the fast LRU model vs the policy core on the same trace, and that both agree."""
    from kvtier.app.bench.plan import as_json as to_json, run_plan_bench
    from kvtier.app.workloads.mooncake import default_trace_path

    _emit(to_json(run_plan_bench(trace or str(default_trace_path()), limit, reps=reps)), as_json)


def _run_sections() -> dict[str, type]:
    from kvtier.config import TierConfig
    from kvtier.config import CacheConfig, StorageConfig
    from kvtier.app.runner import WorkloadConfig

    return {"workload": WorkloadConfig, "tiers": TierConfig, "cache": CacheConfig, "storage": StorageConfig}


def run(
    config: Optional[str] = typer.Option(None, "--config", help="JSON or TOML file with one table per section: workload, tiers, cache, storage"),
    as_json: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this path ('-' for stdout)"),
    plot: Optional[str] = typer.Option(None, "--plot", help="draw hit ratio and TTFT over the run to this PNG"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    **flags,
) -> None:
    """Replay a workload through the reference MLA+DSA model with kvtier and with recompute; report hits, bytes, TTFT, equality."""
    from kvtier.app.cli_options import build_sections, load_config_file
    from kvtier.app.runner import RunConfig, plot_report, run_workload

    sections = build_sections(_run_sections(), load_config_file(config), flags)
    for what, path in (("--json", as_json if as_json != "-" else None), ("--plot", plot)):
        check_output_path(what, path)  # before the run: minutes of work must not end in "cannot write"
    report = run_workload(RunConfig(**sections), progress=progress)
    if as_json == "-":
        json.dump(report.as_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        if as_json:
            with open(as_json, "w") as f:
                json.dump(report.as_dict(), f, indent=1)
        _print_run_report(report)
    if plot:
        plot_report(report, plot)


def check_output_path(what: str, path: str | None) -> None:
    """``path`` can be written: its directory exists and is writable, and it is not a directory."""
    import os

    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory; give a file path")
    if not os.path.isdir(parent):
        raise ConfigError(f"{what} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{what} {path!r} is not writable; choose another path")


def _print_run_report(r) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title=f"kvtier run: {r.requests} requests, {r.tokens} prompt tokens")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for tier, v in r.hit_ratio.items():
        t.add_row(f"prefix hit ratio ({tier})", f"{v:.1%}")
    t.add_row("tokens loaded / recomputed", f"{r.tokens_loaded} / {r.tokens_recomputed}")
    for k, v in r.bytes_moved.items():
        t.add_row(f"bytes {k.replace('_', ' ')}", f"{v / 1e6:.2f} MB at {r.gbps[k]:.2f} GB/s")
    for run_name, p in r.ttft_s.items():
        t.add_row(f"TTFT {run_name} p50/p90/p99", f"{p['p50'] * 1e3:.1f} / {p['p90'] * 1e3:.1f} / {p['p99'] * 1e3:.1f} ms")
    q = r.ttft_ratio_spread
    t.add_row("TTFT p50 kvtier / recompute", f"{r.ttft_ratio_p50:.3f} (per request, interleaved: p25 {q['p25']:.3f}, p50 {q['p50']:.3f}, p75 {q['p75']:.3f})")
    t.add_row("logits equal to recompute", f"{r.logits_equal} (bit-exact: {r.logits_bit_exact}, max |diff| {r.max_abs_logit_diff:g}, tol {r.logit_tolerance:g})")
    t.add_row("DSA indexer top-k equal", str(r.indexer_topk_equal))
    c.print(t)


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
    sweep_host_tb: Optional[str] = typer.Option(None, "--sweep-host-tb", help="comma-separated host sizes (TB per node): hit ratio for each"),
    sweep_device_gb: Optional[str] = typer.Option(None, "--sweep-device-gb", help="comma-separated device sizes (GB per node)"),
    sweep_storage_tb: Optional[str] = typer.Option(None, "--sweep-storage-tb", help="comma-separated L3 sizes (TB per node)"),
    compare_routing: bool = typer.Option(False, "--compare-routing", help="also plan every routing policy: hit ratio, TTFT, load balance"),
    plot_png: Optional[str] = typer.Option(None, "--plot", help="write a PNG: hit ratio vs capacity per routing policy (the sweep "
                                           "given, else host sizes from the smallest accepted), and prompt tokens per node"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    **flags,
) -> None:
    """Replay a trace through the cache logic at real model sizes (no tensors): hit ratio per tier, link load,
    queueing and TTFT per routing policy, load per node, load vs recompute."""
    from dataclasses import replace

    from kvtier.app.cli_options import build_sections
    from kvtier.config import CacheConfig
    from kvtier.app.plan import PlanConfig, min_host_tb, round_up, run_plan, sweep
    from kvtier.app.plan import compare_routing as compare
    from kvtier.app.plan.routing import ROUTING_POLICIES
    from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace

    sections = build_sections({"plan": PlanConfig, "cache": CacheConfig}, {}, flags)
    cfg, cache_cfg = sections["plan"], sections["cache"]
    sweeps = {field: _numbers(flag, text) for field, flag, text in (("host_tb", "--sweep-host-tb", sweep_host_tb),
                                                                   ("device_gb", "--sweep-device-gb", sweep_device_gb),
                                                                   ("storage_tb", "--sweep-storage-tb", sweep_storage_tb)) if text}
    if len(sweeps) > 1:
        raise ConfigError("sweep one tier at a time: give one of --sweep-host-tb, --sweep-device-gb, --sweep-storage-tb")
    check_output_path("--plot", plot_png)
    requests = load_mooncake_trace(trace or default_trace_path(), limit)
    report = run_plan(requests, cfg, cache_cfg)
    if sweeps:
        [(field, values)] = sweeps.items()
        report.sweep = sweep(requests, cfg, field, values, cache_cfg)
    if compare_routing or plot_png:
        report.routing_comparison = compare(requests, cfg, cache_cfg)
    if plot_png:
        from kvtier.app.plan.plot import plot_plan

        if sweeps:
            [(field, values)] = sweeps.items()
        else:
            low = min_host_tb(requests, cfg)
            field, values = "host_tb", [round_up(low * f) for f in (1.0, 1.5, 2.0, 4.0)]
        curves = {p: sweep(requests, replace(cfg, routing=p), field, values, cache_cfg) for p in ROUTING_POLICIES}
        loads = {row["routing"]: [{"node": j, "prompt_tokens": t} for j, t in enumerate(row["prompt_tokens_per_node"])]
                 for row in report.routing_comparison}
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
    console.print(f"hit ratio {report.hit_ratio['total']:.1%} of an infinite-cache bound {report.infinite_cache_hit_ratio:.1%}; "
                  f"TTFT p50 {report.latency['ttft_s']['p50']:.3f} s, p99 {report.latency['ttft_s']['p99']:.3f} s; "
                  f"a host hit loads {report.load_vs_recompute['host_hit_speedup']}x faster than recomputing it")
    if plot_png:
        console.print(f"plot written to {plot_png}")


def _register_run() -> None:
    import inspect

    from kvtier.app.cli_options import section_parameters

    sig = inspect.signature(run)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD] + section_parameters(_run_sections())
    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    app.command("run")(run)
    from kvtier.config import CacheConfig
    from kvtier.app.plan import PlanConfig

    psig = inspect.signature(plan)
    pparams = [p for p in psig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD] + section_parameters({"plan": PlanConfig, "cache": CacheConfig})
    plan.__signature__ = psig.replace(parameters=pparams)  # type: ignore[attr-defined]
    app.command("plan")(plan)


_register_run()


def _fail(message: str) -> None:
    """The command line's one way to fail: one line on stderr, exit 2, no traceback."""
    typer.secho(f"kvtier: error: {message}", err=True, fg="red")
    raise SystemExit(2)


def _given_value(param) -> str | None:
    """What the user typed for ``param`` (``--flag value`` or ``--flag=value``), to name it in the error."""
    opts = getattr(param, "opts", None) or []
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        for opt in opts:
            if arg == opt and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(opt + "="):
                return arg[len(opt) + 1 :]
    return None


def main() -> None:
    from typer.exceptions import TyperException  # base of typer's (vendored click's) usage errors

    try:
        result = app(standalone_mode=False)
    except KVTierError as e:
        _fail(str(e).replace("\n", " "))
    except TyperException as e:  # a flag's value is not of its type, an unknown flag, no command, ...
        if type(e).__name__ == "NoArgsIsHelpError" and getattr(e, "ctx", None) is not None:
            typer.echo(e.ctx.get_help())
            raise SystemExit(0) from None
        message = " ".join((e.format_message() if hasattr(e, "format_message") else str(e)).split())
        given = _given_value(getattr(e, "param", None))
        _fail(message + (f" (got {given!r})" if given is not None else "") + "; see --help")
    except (typer.Abort, KeyboardInterrupt):
        _fail("aborted")
    if isinstance(result, int) and result:  # typer.Exit(code) in non-standalone mode
        raise SystemExit(result)


if __name__ == "__main__":
    main()
