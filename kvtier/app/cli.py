"""The ``kvtier`` command line: ``run``, ``plan``, ``serve``, ``bench {transfer,cache,storage,sglang,plan,service}``, ``spec``."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from kvtier.app.cli_output import check_output_path, emit as _emit
from kvtier.errors import KVTierError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvtier: a tiered, paged KV cache for LLM inference.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print measured ratios as JSON.")
app.add_typer(bench_app, name="bench")


@app.command()
def spec(name: Optional[str] = typer.Argument(None, help="preset name; omit to list presets")) -> None:
    """Show a preset KVSpec's per-token and per-page sizes (a hybrid preset's per KV group)."""
    from kvtier.errors import UnknownNameError
    from kvtier.groups import HYBRID_PRESETS
    from kvtier.spec import PRESETS, KVSpec

    if name is None:
        rows = [{"preset": k, "attention": s.attention, "layers": s.num_layers, "page_bytes": s.page_bytes} for k, s in PRESETS.items()]
        rows += [{"preset": k, "attention": "+".join(g.kind for g in m.groups), "layers": m.num_layers,
                  "page_bytes": sum(g.attention.page_bytes for g in m.groups if g.attention is not None)}
                 for k, m in HYBRID_PRESETS.items()]
        _emit(rows, False)
        return
    if name not in PRESETS and name not in HYBRID_PRESETS:
        raise UnknownNameError("preset", name, [*PRESETS, *HYBRID_PRESETS])
    json.dump(HYBRID_PRESETS[name].describe() if name in HYBRID_PRESETS else KVSpec.preset(name).describe(), sys.stdout, indent=1)
    sys.stdout.write("\n")


@bench_app.command("transfer")
def bench_transfer(
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
    pages: int = typer.Option(256, min=1, max=1 << 20, help="pages per transfer (256 x 64 tokens = a 16k-token request)"),
    layers: int = typer.Option(4, min=1, help="model layers kept (per-layer cost does not depend on depth)"),
    reps: int = typer.Option(12, min=1, help="timed repetitions per case (median reported)"),
) -> None:
    """Page transfer throughput per layout x direction x spec x buffer, vs a contiguous copy."""
    from kvtier.app.bench.transfer import as_json_rows, run_transfer_bench

    _emit(as_json_rows(run_transfer_bench(pages_per_transfer=pages, layers=layers, reps=reps)), as_json)


@bench_app.command("cache")
def bench_cache(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format trace (JSONL); default: the one shipped in the package"),
    limit: Optional[int] = typer.Option(None, help="replay only the first N requests"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    vllm: Optional[bool] = typer.Option(
        None, "--vllm/--no-vllm", help="replay through vLLM's KVCacheManager too (default: when vLLM is installed)"
    ),
    sglang: Optional[bool] = typer.Option(
        None, "--sglang/--no-sglang",
        help="replay through SGLang's prefix caches too: its default UnifiedRadixCache (Rust and Python tree cores) "
             "and the legacy RadixCache (default: when its wheel is found)"
    ),
    sglang_wheel: Optional[str] = typer.Option(None, help="sglang-0.5.23 wheel (default: $KVTIER_SGLANG_WHEEL, else .kvtier/wheels/)"),
    reps: int = typer.Option(3, help="rounds, each system's replay once per round in turn (each system's best round reported)"),
    model: Optional[str] = typer.Option(None, help="a hybrid preset (gpt-oss-120b, gemma-3-27b, qwen3-next-80b-a3b) replayed too, "
                                                   "with its KV groups, beside the full-attention replay"),
) -> None:
    """Prefix bookkeeping throughput (keys + match + insert) on a trace, and its share of a 16k-token load."""
    from kvtier.app.bench.cache import as_json as to_json, run_cache_bench
    from kvtier.app.workloads.mooncake import default_trace_path

    _emit(
        to_json(run_cache_bench(trace or str(default_trace_path()), limit, vllm=vllm, sglang=sglang, sglang_wheel=sglang_wheel, reps=reps,
                                model=model)),
        as_json,
    )


@bench_app.command("storage")
def bench_storage(
    backends: str = typer.Option(
        "file,redis,redis-cluster,mooncake",
        help="comma-separated backends to measure: file, redis, redis-cluster (3 nodes), mooncake; servers are started on 127.0.0.1",
    ),
    pages: int = typer.Option(96, min=1, help="deepseek-v3.2 pages per round (1.25 MB each at 16 tokens a page)"),
    reps: int = typer.Option(20, min=1, help="rounds per op, kvtier and the plain client taking turns (best and median reported)"),
    page_size: int = typer.Option(
        16, min=1, help="tokens per page: 16 gives the 1 MiB-class page objects (1.25 MB), the preset's 64 gives 5.0 MB"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    """L3 put/get throughput per backend, as a ratio to the backend's own client on the same server."""
    from kvtier.app.bench.storage import as_json_rows, run_storage_bench

    _emit(
        as_json_rows(run_storage_bench(_backend_list(backends, ("file", "redis", "redis-cluster", "mooncake")), pages, reps, page_size)),
        as_json,
    )


@bench_app.command("sglang")
def bench_sglang(
    backends: str = typer.Option(
        "file,mooncake",
        help="comma-separated: file (vs SGLang's HiCacheFile), mooncake (vs SGLang's MooncakeStore; a local master is started)",
    ),
    pages: int = typer.Option(128, min=1, help="host pages per round (SGLang's storage batch is 128)"),
    reps: int = typer.Option(10, min=1, help="rounds per op, the two backends taking turns (best and median reported)"),
    layout: str = typer.Option("page_first", help="SGLang host pool layout: page_first, layer_first, page_first_direct"),
    sglang_wheel: Optional[str] = typer.Option(None, help="sglang-0.5.23 wheel (default: $KVTIER_SGLANG_WHEEL, else .kvtier/wheels/)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    """kvtier as SGLang's HiCache storage backend: set/get GB/s through SGLang's host pool and controller, vs SGLang's own backends."""
    from kvtier.app.bench.peers import peer_module
    from kvtier.app.bench.sglang_storage import as_json_rows, run_sglang_bench

    if layout not in ("page_first", "layer_first", "page_first_direct"):
        from kvtier.errors import UnknownNameError

        raise UnknownNameError("SGLang host pool layout", layout, ("page_first", "layer_first", "page_first_direct"))
    names = _backend_list(backends, ("file", "mooncake"))
    wheel = peer_module("sglang_wheel")
    wheel.import_sglang(wheel.find_sglang_wheel(sglang_wheel))
    _emit(as_json_rows(run_sglang_bench(names, pages, reps, layout=layout)), as_json)


@bench_app.command("plan")
def bench_plan(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format trace (JSONL); default: the one shipped in the package"),
    limit: Optional[int] = typer.Option(None, help="replay only the first N requests"),
    reps: int = typer.Option(5, min=1, help="timed repetitions of each replay (median reported)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """kvtier plan's replay speed through the policy core, per configuration and per routing policy."""
    from kvtier.app.bench.plan import as_json as to_json, run_plan_bench
    from kvtier.app.workloads.mooncake import default_trace_path

    _emit(to_json(run_plan_bench(trace or str(default_trace_path()), limit, reps=reps)), as_json)


@bench_app.command("service")
def bench_service(
    prompt_tokens: int = typer.Option(2048, min=64, help="tokens per prompt in the lookup rows (a multiple of the page size, 64)"),
    requests: int = typer.Option(200, min=4, help="requests per lookup row and side (and the flood row's lookups per side)"),
    copy_pages: int = typer.Option(256, min=1, help="pages per host->device copy in the bandwidth row"),
    rounds: int = typer.Option(9, min=1, help="rounds of copies, each side once per round (best round reported)"),
    trace_limit: int = typer.Option(60, min=1, help="trace requests each engine runs in the sharing row"),
    vllm: bool = typer.Option(False, "--vllm", help="also a restarted vLLM engine's TTFT from the service against its own host "
                                                     "tier, a file L3 tier and recompute (vLLM's CPU build; five engine starts)"),
    vllm_prompt_tokens: int = typer.Option(2048, min=2, help="the vLLM row's prompt length in tokens"),
    vllm_prompts: int = typer.Option(3, min=1, help="distinct prompts per vLLM session (each TTFT the median over them)"),
    vllm_model: str = typer.Option("smollm2", help="the vLLM row's model (kvtier.integrations.vllm.session's MODELS)"),
    checksum_pages: int = typer.Option(64, min=1, help="pages (of llama-3.1-8b's, 8 MiB each) the checksum row's region holds"),
    scheduler_waiting: str = typer.Option("1,64,512", help="waiting requests in each scheduler_steps row (comma-separated counts)"),
    soak: Optional[int] = typer.Option(None, "--soak", min=1, help="instead of the rows: N cycles, each killing (SIGKILL or SIGTERM) an "
                                                                  "engine, the service or a writer mid-copy and starting it again, every "
                                                                  "output compared with recompute (kvtier.app.bench.soak)"),
    soak_seed: int = typer.Option(0, "--soak-seed", help="the soak's random seed (which victim, which signal, when)"),
    vllm_soak: Optional[int] = typer.Option(None, "--vllm-soak", min=1, help="instead of the rows: N cycles of `vllm serve` on the "
                                            "service, each killing the server or the service (SIGKILL or SIGTERM) and starting it "
                                            "again, every answer compared with vLLM alone (kvtier.app.bench.vllm_soak)"),
    vllm_soak_model: str = typer.Option("tiny-gemma3-5to1", "--vllm-soak-model", help="the vLLM soak's model: tiny-gemma3-5to1 "
                                        "(five sliding-window layers to one full) or smollm2"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """The node service (kvtier serve) against an in-process host tier: lookup cost, copy bandwidth, two engines sharing, an
    engine's lookups beside a flooding client, and what its page checksums cost against a copy of the same bytes."""
    if soak is not None:
        from kvtier.app.bench.soak import SoakConfig, as_json as soak_json, run_soak

        _emit(soak_json(run_soak(SoakConfig(soak, seed=soak_seed))), as_json)
        return
    if vllm_soak is not None:
        from kvtier.app.bench.vllm_soak import VllmSoakConfig, as_json as vllm_soak_json, run_vllm_soak

        _emit(vllm_soak_json(run_vllm_soak(VllmSoakConfig(vllm_soak, seed=soak_seed, model=vllm_soak_model))), as_json)
        return
    waiting = _counts(scheduler_waiting, "--scheduler-waiting")  # (before the bench's imports: one line, nothing else)
    from kvtier.app.bench.service import as_json as to_json, run_service_bench

    bench = run_service_bench(prompt_tokens, requests, copy_pages, rounds, trace_limit, vllm, vllm_prompt_tokens, vllm_prompts, vllm_model,
                              checksum_pages, waiting)
    _emit(to_json(bench), as_json)


audit_app = typer.Typer(no_args_is_help=True, help="Audits that print measured verdicts as JSON.")
app.add_typer(audit_app, name="audit")


@audit_app.command("timing")
def audit_timing(
    tiers: str = typer.Option(",".join(("device", "host", "service", "file", "redis")),
                              help="the tiers to audit, comma-separated: device, host, service (a kvtier serve it starts), file, "
                                   "redis (a redis-server it starts)"),
    samples: int = typer.Option(250, min=1, help="rounds per tier: each a victim prompt, then a probe, a miss and a control"),
    prompt_tokens: int = typer.Option(128, min=1, help="tokens per prompt (kvtier run's reference model: 32-token pages)"),
    alpha: float = typer.Option(0.01, help="the probes pass when the KS test's p >= alpha (Gu et al.'s 0.01)"),
    control_alpha: float = typer.Option(0.001, help="the audit of a tier is void unless the control's p < this"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar per tier"),
    engine: str = typer.Option("run", "--engine", help="run (kvtier run's reference engine) or vllm (vLLM's CPU engine with "
                                                        "kvtier's connector, a tenant its cache_salt; each tier a fresh engine)"),
    vllm_model: str = typer.Option("tiny-llama", "--vllm-model",
                                   help="--engine vllm's model (kvtier.integrations.vllm.session's MODELS; tiny-llama: a tiny Llama "
                                        "with dummy weights, fast enough for 250 rounds)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Whether one tenant can tell by time to first token that another sent a prompt (Gu et al., ICML 2025), through each
    tier, on kvtier run's engine or vLLM's: two-sample KS tests of a second tenant's probes against fresh misses, and of
    the first tenant's own hits (the control). Exit 1 when a tier fails or is void."""
    names = _backend_list(tiers, ("device", "host", "service", "file", "redis"), "--tiers")
    if engine not in ("run", "vllm"):
        from kvtier.errors import ConfigError

        raise ConfigError(f"--engine {engine!r}: choose run or vllm")
    from kvtier.app.audit import run_timing_audit

    def bar(tier: str):
        if not progress:
            return lambda: None
        from tqdm import tqdm

        t = tqdm(total=samples, desc=f"audit {tier}", leave=False, file=sys.stderr)

        def tick() -> None:
            t.update(1)
            if t.n >= samples:
                t.close()

        return tick

    audit = run_timing_audit(list(names), samples, prompt_tokens, alpha, control_alpha, progress=bar, engine=engine,
                             vllm_model=vllm_model)
    _emit(audit.as_dict() if as_json else [{"tier": t.tier, "verdict": t.verdict, "samples": t.samples,
                                            **{f"{k}_ms": v for k, v in t.median_ms.items()},
                                            "probe_p": t.probe_vs_miss.pvalue, "control_p": t.control_vs_miss.pvalue,
                                            "probe_hit_tokens": t.hit_tokens["probe"]} for t in audit.tiers], as_json)
    if not audit.passed:
        raise typer.Exit(1)


def _counts(text: str, option: str) -> tuple[int, ...]:
    """``option``'s comma-separated positive counts, or a :class:`ConfigError` naming what is wrong."""
    from kvtier.errors import ConfigError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and 0 < int(p) <= 100_000 for p in parts):
        raise ConfigError(f"{option} {text!r}: give counts from 1 to 100000, comma-separated (e.g. 1,64,512)")
    return tuple(dict.fromkeys(int(p) for p in parts))


def _backend_list(backends: str, valid: tuple[str, ...], option: str = "--backends") -> tuple[str, ...]:
    """``option`` (``--backends``): names from ``valid``, comma-separated, at least one, each once."""
    from kvtier.errors import ConfigError, UnknownNameError

    names = tuple(dict.fromkeys(b.strip() for b in backends.split(",") if b.strip()))
    if not names:
        raise ConfigError(f"{option} {backends!r} names none; give one or more of {', '.join(valid)}, comma-separated")
    for b in names:
        if b not in valid:
            raise UnknownNameError(f"{option} entry", b, valid)
    return names


def _run_sections() -> dict[str, type]:
    from kvtier.config import TierConfig
    from kvtier.config import CacheConfig, StorageConfig
    from kvtier.app.runner import WorkloadConfig

    return {"workload": WorkloadConfig, "tiers": TierConfig, "cache": CacheConfig, "storage": StorageConfig}


def run(
    config: Optional[str] = typer.Option(
        None, "--config", help="JSON or TOML file with one table per section: workload, tiers, cache, storage"
    ),
    as_json: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this path ('-' for stdout)"),
    plot: Optional[str] = typer.Option(None, "--plot", help="draw hit ratio and TTFT over the run to this PNG"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    model: str = typer.Option("dsa", "--model", help="dsa (the MLA + DSA reference model) or hybrid (its variant with sliding-window "
                                                      "and linear-attention state layers beside the MLA + DSA ones)"),
    **flags,
) -> None:
    """Replay a workload through the reference MLA+DSA model with kvtier and with recompute; report hits, bytes, TTFT, equality."""
    from kvtier.app.cli_options import build_sections, load_config_file
    from kvtier.app.runner import RunConfig, plot_report, run_workload

    sections = build_sections(_run_sections(), load_config_file(config), flags)
    for what, path in (("--json", as_json if as_json != "-" else None), ("--plot", plot)):
        check_output_path(what, path)  # before the run: minutes of work must not end in "cannot write"
    report = run_workload(RunConfig(**sections, model_kind=model), progress=progress)
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
    t.add_row(
        "TTFT p50 kvtier / recompute",
        f"{r.ttft_ratio_p50:.3f} (per request, interleaved: p25 {q['p25']:.3f}, p50 {q['p50']:.3f}, p75 {q['p75']:.3f})",
    )
    t.add_row(
        "logits equal to recompute",
        f"{r.logits_equal} (bit-exact: {r.logits_bit_exact}, max |diff| {r.max_abs_logit_diff:g}, tol {r.logit_tolerance:g})",
    )
    t.add_row("DSA indexer top-k equal", str(r.indexer_topk_equal))
    for name, g in (r.groups or {}).items():
        if not isinstance(g, dict) or "bytes" not in g or name == "full":
            continue
        apart = f"{g['filled']} filled, {g['load_failed']} in failed loads"
        if "snapshots_loaded" in g:
            t.add_row(f"group {name} (state)", f"{g['snapshots_loaded']} snapshots loaded ({g['snapshots_from_l3']} from L3); {apart}")
        else:
            t.add_row(f"group {name} (window)",
                      f"{g['pages_loaded']} pages loaded ({g['pages_from_l3']} from L3), {g['pages_skipped']} skipped; {apart}")
    if r.groups:
        t.add_row("bytes per loaded page", f"{r.groups['bytes_per_loaded_page']} ({r.groups['vs_full_attention_twin']:.2f} of a "
                                           "full-attention model of the same size)")
    c.print(t)


def _register_run() -> None:
    import inspect

    from kvtier.app.cli_options import section_parameters

    sig = inspect.signature(run)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD] + section_parameters(_run_sections())
    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    app.command("run")(run)
    from kvtier.config import CacheConfig
    from kvtier.app.cli_plan import plan
    from kvtier.app.plan import PlanConfig

    psig = inspect.signature(plan)
    pparams = [p for p in psig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD] + section_parameters(
        {"plan": PlanConfig, "cache": CacheConfig}
    )
    plan.__signature__ = psig.replace(parameters=pparams)  # type: ignore[attr-defined]
    app.command("plan")(plan)
    from kvtier.app.cli_serve import serve

    app.command("serve")(serve)


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
