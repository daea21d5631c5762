"""The README is a front page that stays true: short, its links resolve, the docs build strictly, and
every command it shows is run by a test (named here, and checked to exist)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: every command the README shows -> (the file that runs it, the test function there; None: the file itself runs it)
RUN_BY = {
    "./run.sh": ("tests/test_readme.py", "test_run_sh_runs_the_main_job_and_reports_it_as_the_readme_shows"),
    "./run.sh --no-progress": ("tests/test_readme.py", "test_run_sh_runs_the_main_job_and_reports_it_as_the_readme_shows"),
    "./run.sh --json out.json --plot out.png": ("tests/test_readme.py", "test_run_sh_runs_the_main_job_and_reports_it_as_the_readme_shows"),
    "kvtier run": ("tests/test_cli.py", "test_run_end_to_end_small_workload"),
    "kvtier spec": ("tests/test_readme.py", "test_kvtier_spec_lists_every_preset_the_models_table_names"),
    "./run.sh test": (".ci/run", None),  # CI runs the README's test command on a clean clone at every stop
    "python examples/library_quickstart.py": ("tests/test_examples.py", "test_library_quickstart_runs_and_restores_bytes"),
    "python examples/vllm_restart.py": ("tests/test_examples.py", "test_vllm_restart_example_hits_l3_after_the_restart"),
    "kvtier bench cache --json": ("tests/test_bench_cache.py", "test_bench_cache_replays_through_sglangs_trees_in_the_same_run"),
    "kvtier bench sglang --json": ("tests/test_sglang_storage.py", "test_bench_sglang_prints_both_sides_as_json"),
    "kvtier plan --json": ("tests/test_fresh_clone.py", "test_plan_from_a_fresh_clone"),
    "kvtier audit timing --engine vllm --prompt-tokens 512 --json": ("tests/test_audit.py",
                                                                      "test_vllms_engine_with_the_connector_passes_the_audit_through_"
                                                                      "kvtiers_host_tier"),
    "kvtier audit timing --json": ("tests/test_audit.py",
                                   "test_the_command_prints_its_verdicts_as_json_and_exits_1_unless_every_tier_passes"),
    "kvtier bench service --json": ("tests/test_bench_service.py",
                                    "test_bench_service_prints_every_row_with_both_sides_measured_in_the_run"),
    "kvtier bench service --soak 1000 --json": ("tests/test_service_soak.py",
                                                "test_fifty_crash_cycles_give_no_wrong_output_no_stuck_lease_and_no_failed_restart"),
    "kvtier bench service --vllm-soak 20 --json": ("tests/test_vllm_hybrid.py", "test_vllm_serve_of_gemma3s_five_to_one_layout_on_the_"
                                                   "node_service_through_two_crashes_answers_as_vllm_alone"),
    "kvtier bench service --json --vllm": ("tests/test_bench_service.py",
                                           "test_bench_service_vllm_row_times_a_restarted_engine_served_from_the_service"),
    "kvtier plan --validate run --profile P.json --workload chat --json": ("tests/test_plan_validate.py",
                                                                            "test_validate_run_engine_serves_exactly_what_the_planner_predicts"),
    # the service is started as `kvtier serve --host-gb GB --socket PATH` (tests/support/service.py) by each of these tests
    "kvtier serve": ("tests/test_service.py", "test_a_prefix_one_engine_computed_is_a_host_hit_for_another_bit_exact"),
    "kvtier serve --host-gb 8": ("tests/test_service.py", "test_a_prefix_one_engine_computed_is_a_host_hit_for_another_bit_exact"),
    "kvtier run --tiers-service PATH": ("tests/test_service.py",
                                        "test_kvtier_run_through_the_service_twice_the_second_engine_starts_with_the_first_ones_host_tier"),
}


def readme_commands() -> set[str]:
    """Shell commands in the README: lines of its bash blocks (comments stripped), and inline code
    that starts like a command (``./run.sh``, ``python ...``, ``kvtier ...``)."""
    out = set()
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            cmd = line.split("#", 1)[0].strip()
            if cmd:
                out.add(cmd)
    for code in re.findall(r"`([^`\n]+)`", README):
        if re.match(r"(\./run\.sh|python |kvtier )", code) and not code.startswith("kvtier run --model") and "-m \"not" not in code:
            out.add(code.strip())
    return out


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) < 300, "the README is a front page: move the details into docs/"
    for section in ("## Quick start", "## As a library", "## With vLLM", "## With SGLang", "## Supported models", "## Documentation"):
        assert section in README


def test_every_link_in_the_readme_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert links, "the README links its docs pages"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, missing


def test_every_command_the_readme_shows_is_run_by_a_test():
    commands = readme_commands()
    unknown = sorted(commands - RUN_BY.keys())
    assert not unknown, f"README commands no test runs (add the test and list it in RUN_BY): {unknown}"
    for cmd in commands:
        path, test = RUN_BY[cmd]
        source = (ROOT / path).read_text()
        if test is None:
            assert cmd in source, f"{path} does not run {cmd!r}"
            continue
        names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert test in names, f"{cmd!r}: {path} has no test {test}"


def test_the_docs_build_strictly(tmp_path):
    """MkDocs (the docs extra): every page in the nav, no broken link or anchor (``--strict``)."""
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (site / "index.html").is_file() and (site / "vllm" / "index.html").is_file()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    nav = set(re.findall(r":\s*(\S+\.md)", (ROOT / "mkdocs.yml").read_text()))
    assert pages == nav, f"pages not in the nav: {sorted(pages - nav)}; nav entries with no page: {sorted(nav - pages)}"


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_run_sh_runs_the_main_job_and_reports_it_as_the_readme_shows(tmp_path):
    """``./run.sh`` in this clone, its venv active (run.sh installs into it, here a no-op but for the editable
    install): the main job's report, with kvtier's logits equal to recompute's and hits in every tier."""
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    env = {**os.environ, "VIRTUAL_ENV": str(Path(sys.executable).parent.parent)}
    r = subprocess.run(["./run.sh", "--no-progress", "--json", str(out), "--plot", str(plot)], cwd=ROOT, capture_output=True, text=True,
                       timeout=840, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TTFT p50 kvtier / recompute" in r.stdout and "logits equal to recompute" in r.stdout
    report = json.loads(out.read_text())
    assert report["logits_equal"] and report["indexer_topk_equal"]
    assert all(report["hit_ratio"][tier] > 0 for tier in ("device", "host", "storage"))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvtier_spec_lists_every_preset_the_models_table_names():
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "spec"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    table = README[README.index("## Supported models") : README.index("## Benchmarks")]
    named = set(re.findall(r"`([a-z0-9.-]+-[a-z0-9.-]+)`", table.split("\n\n")[1]))
    assert named >= {"llama-3.1-8b", "deepseek-v3.2", "gpt-oss-120b", "qwen3-next-80b-a3b"}
    assert all(name in r.stdout for name in named), sorted(n for n in named if n not in r.stdout)
