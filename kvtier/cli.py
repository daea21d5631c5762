"""The ``kvtier`` command line: ``run``, ``plan``, ``bench {transfer,cache,storage}``, ``spec``."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from kvtier.errors import KVTierError

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
    from kvtier.bench.transfer import as_json_rows, run_transfer_bench

    _emit(as_json_rows(run_transfer_bench(pages_per_transfer=pages, layers=layers, reps=reps)), as_json)


@bench_app.command("cache")
def bench_cache(
    trace: Optional[str] = typer.Option(None, help="Mooncake-format trace (JSONL); default: the shipped shared/traces one"),
    limit: Optional[int] = typer.Option(None, help="replay only the first N requests"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Prefix bookkeeping throughput (keys + match + insert) on a trace, and its share of a 16k-token load."""
    from kvtier.bench.cache import as_json as to_json, run_cache_bench
    from kvtier.workloads.mooncake import default_trace_path

    _emit(to_json(run_cache_bench(trace or str(default_trace_path()), limit)), as_json)


@bench_app.command("storage")
def bench_storage(
    backends: str = typer.Option("file,redis,mooncake", help="comma-separated backends to measure (servers are started on 127.0.0.1)"),
    pages: int = typer.Option(24, help="deepseek-v3.2 pages per batch (about 5 MB each)"),
    reps: int = typer.Option(3, help="repetitions (best reported)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    """L3 put/get throughput per backend, as a ratio to the backend's own client on the same server."""
    from kvtier.bench.storage import as_json_rows, run_storage_bench

    _emit(as_json_rows(run_storage_bench(tuple(b for b in backends.split(",") if b), pages, reps)), as_json)


def main() -> None:
    try:
        app()
    except KVTierError as e:
        typer.secho(f"kvtier: error: {e}", err=True, fg="red")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
