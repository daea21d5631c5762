"""Docs that run: every command docs/ shows is run by a test (named here, the test checked to exist and
to name the command's program, options and JSON keys) or is an illustration that says why the suite
cannot run it; every option a page names exists on its command line; cli.md names every command and
option; and the deploy page's systemd units run what the suite runs. tests/test_readme.py does the same
for the README. How commands are found: tests/support/doc_commands.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from support.cli import SMALL, kvtier
from support.doc_commands import (ROOT, chain_problems, chain_source, commands_in, distinctive, exec_argvs, fenced_blocks,
                                  flags, json_args, kvtier_commands, kvtier_path, options_of, synopses_in, systemd_units,
                                  typer_options, unknown_flags, words)
from support.service import peer_report, scrape_metrics, start_peer, start_service, stop, tell, wait_until

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
DEPLOY = (DOCS / "deploy.md").read_text()

# ---- who runs what ------------------------------------------------------------------------------------------
#: a chain of code that runs a command: the test first, then each helper the one before it names
SERVE = ("tests/test_service.py::test_sigterm_removes_the_socket_and_the_region_which_only_its_user_can_open",
         "tests/support/service.py::running_service", "tests/support/service.py::start_service")
STATUS = ("tests/test_docs_commands.py::test_the_deploy_pages_service_command_serves_the_status_and_metrics_the_page_names",)
VLLM_SERVE = ("tests/test_vllm_connector.py::test_vllm_serve_over_http_restart_hits_and_metrics",
              "tests/test_vllm_connector.py::_serve_twice_over_http", "kvtier/app/devservers.py::VllmServer.start")
RUN_HYBRID = ("tests/test_hybrid_run.py::test_kvtier_run_model_hybrid_is_bit_exact_with_hits_from_every_tier",)
SOAK = ("tests/test_service_soak.py::test_fifty_crash_cycles_give_no_wrong_output_no_stuck_lease_and_no_failed_restart",)
VLLM_SOAK = ("tests/test_vllm_hybrid.py::test_vllm_serve_of_gemma3s_five_to_one_layout_on_the_node_service_through_two_crashes_"
             "answers_as_vllm_alone",)
AUDIT = ("tests/test_audit.py::test_the_command_prints_its_verdicts_as_json_and_exits_1_unless_every_tier_passes",)
PLAN_HYBRID = ("tests/test_docs_commands.py::test_kvtier_plan_of_a_hybrid_preset_with_its_window_pages_in_a_pool_of_their_own",)

#: every command docs/ shows that a test runs -> that code (a file alone: it holds the command as it is written)
RUN_BY: dict[str, tuple[str, ...]] = {
    "./run.sh": ("tests/test_readme.py::test_run_sh_runs_the_main_job_and_reports_it_as_the_readme_shows",),
    "./run.sh test": (".ci/run",),
    "./run.sh test -q": (".ci/run",),
    ".venv/bin/ruff check kvtier peers tests examples": ("tests/test_lint.py::test_ruff_check_passes_on_the_whole_project",),
    "python examples/vllm_restart.py": ("tests/test_examples.py::test_vllm_restart_example_hits_l3_after_the_restart",),
    ".venv/bin/python examples/vllm_restart.py": ("tests/test_examples.py::test_vllm_restart_example_hits_l3_after_the_restart",),
    "python -m kvtier.app.bench.calls": (
        "tests/test_core_polls.py::test_the_call_counts_of_a_host_hit_a_hybrid_one_and_bench_caches_request_are_reported_per_file",),
    "python -m kvtier.app.bench.gpu_check": ("tests/test_gpu_check.py::test_gpu_check_on_cpu_round_trips_bit_exact_and_measures",),
    "python -m kvtier.integrations.vllm.session": ("tests/test_vllm_connector.py::test_chat_turn_two_hits_the_previous_answer",
                                                   "tests/test_vllm_connector.py::run_engine",
                                                   "kvtier/integrations/vllm/session.py::run_in_subprocess"),
    # vLLM's own server, through kvtier.app.vllm_cli on its CPU build
    "vllm serve": VLLM_SERVE,
    "python -m kvtier.app.vllm_cli": VLLM_SERVE,
    "python -m kvtier.app.vllm_cli serve": VLLM_SERVE,
    "python -m kvtier.app.vllm_cli serve MODEL --block-size 32 --kv-transfer-config '...'": VLLM_SERVE,
    "kvtier run": ("tests/test_cli.py::test_run_end_to_end_small_workload",),
    "kvtier run --json -": ("tests/test_cli.py::test_run_end_to_end_small_workload",),
    "kvtier run --model hybrid": RUN_HYBRID,
    "kvtier run --model hybrid --json -": RUN_HYBRID,
    "kvtier run --tiers-service PATH": (
        "tests/test_service.py::test_kvtier_run_through_the_service_twice_the_second_engine_starts_with_the_first_ones_host_tier",),
    "kvtier run --model hybrid --tiers-service PATH": (
        "tests/test_service_hybrid.py::test_kvtier_run_hybrid_through_a_service_killed_and_restarted_keeps_its_window_pages_and_snapshots",),
    "kvtier run --workload-kind trace": ("tests/test_docs_commands.py::test_kvtier_run_replays_the_shipped_trace",),
    "kvtier run --workload-tenants 4 --workload-share-system-prompts": (
        "tests/test_shared_prefixes.py::test_kvtier_run_with_shared_system_prompts_computes_each_once_for_every_tenant",),
    "kvtier plan --json --cache-min-hit-tokens K": ("tests/test_min_hit_tokens.py::test_kvtier_plan_says_what_a_minimum_costs_in_hits_on_"
                                                    "the_trace",),
    "kvtier run --workload-tenants N": ("tests/test_tenants.py::test_kvtier_run_replays_a_multi_tenant_chat_whose_sessions_share_"
                                        "their_system_prompt_only_within_a_tenant",),
    "kvtier plan --tenants N": ("tests/test_tenants.py::test_kvtier_plan_spreads_the_trace_over_tenants_that_share_no_block",),
    "kvtier plan --json --tenants N": ("tests/test_tenants.py::test_kvtier_plan_spreads_the_trace_over_tenants_that_share_no_block",),
    "kvtier plan": ("tests/test_plan.py::test_plan_cli_json",),
    "kvtier plan --json": ("tests/test_plan.py::test_plan_cli_json",),
    "kvtier plan --plan-nodes 16 --compare-routing --json": (
        "tests/test_docs_commands.py::test_kvtier_plan_compares_the_routing_policies_on_16_nodes",),
    "kvtier plan --plan-spec NAME --json": PLAN_HYBRID,
    "kvtier plan --plan-spec <hybrid preset>": PLAN_HYBRID,
    "kvtier plan --plan-spec gpt-oss-120b --plan-storage-tb 0 --plan-host-tb H --plan-window-pool POOL --json": PLAN_HYBRID,
    "kvtier plan --calibrate": ("tests/test_plan_validate.py::test_validate_run_engine_serves_exactly_what_the_planner_predicts",
                                "tests/test_plan_validate.py::run_profile"),
    "kvtier plan --calibrate P.json --engine run": (
        "tests/test_plan_validate.py::test_validate_run_engine_serves_exactly_what_the_planner_predicts",
        "tests/test_plan_validate.py::run_profile"),
    "kvtier plan --validate ENGINE --profile P.json": (
        "tests/test_plan_validate.py::test_validate_run_engine_serves_exactly_what_the_planner_predicts",),
    "kvtier bench": ("tests/test_cli.py::test_bench_transfer_json_fields",),
    "kvtier bench transfer --json": ("tests/test_cli.py::test_bench_transfer_json_fields",),
    "kvtier bench cache --json": ("tests/test_bench_cache.py::test_bench_cache_hit_ratio_equals_independent_replay",),
    "kvtier bench cache --model NAME --no-vllm --no-sglang --json": (
        "tests/test_docs_commands.py::test_kvtier_bench_cache_replays_a_hybrid_preset_beside_full_attention",),
    "kvtier bench storage --json": ("tests/test_cli.py::test_bench_storage_json_rows",),
    "kvtier bench storage --page-size 64 --pages 24 --json": ("tests/test_cli.py::test_bench_storage_json_rows",),
    "kvtier bench sglang --json": ("tests/test_sglang_storage.py::test_bench_sglang_prints_both_sides_as_json",),
    "kvtier bench sglang --reps 7 --json": ("tests/test_sglang_storage.py::test_bench_sglang_prints_both_sides_as_json",),
    "kvtier bench plan --json": ("tests/test_plan.py::test_bench_plan_cli_json",),
    "kvtier bench plan --json --reps 3": ("tests/test_plan.py::test_bench_plan_cli_json",),
    "kvtier bench service": ("tests/test_bench_service.py::test_bench_service_prints_every_row_with_both_sides_measured_in_the_run",),
    "kvtier bench service --json": (
        "tests/test_bench_service.py::test_bench_service_prints_every_row_with_both_sides_measured_in_the_run",),
    "kvtier bench service --json --vllm": (
        "tests/test_bench_service.py::test_bench_service_vllm_row_times_a_restarted_engine_served_from_the_service",),
    "kvtier bench service --json [--vllm]": (
        "tests/test_bench_service.py::test_bench_service_vllm_row_times_a_restarted_engine_served_from_the_service",),
    "kvtier audit timing --engine vllm --prompt-tokens 512 --json": (
        "tests/test_audit.py::test_vllms_engine_with_the_connector_passes_the_audit_through_kvtiers_host_tier",),
    "kvtier audit timing": AUDIT,
    "kvtier audit timing --json": AUDIT,
    "kvtier bench service --soak N": SOAK,
    "kvtier bench service --vllm-soak N": VLLM_SOAK,
    "kvtier bench service --vllm-soak 20 --json": VLLM_SOAK,
    "kvtier bench service --soak 1000 --json": SOAK,
    "kvtier serve": SERVE,
    "kvtier serve --metrics-port PORT": ("tests/test_service_ops.py::test_metrics_scraped_over_http_are_what_happened_with_real_engines_"
                                         "attached", *SERVE[1:]),
    "kvtier serve --status": STATUS,
    "kvtier serve --status --socket /run/kvtier/node.sock": STATUS,
    "kvtier serve --status --service-uid UID": STATUS,
    "kvtier serve --status --socket /run/kvtier/node.sock --service-uid UID": STATUS,
    "kvtier serve --socket": SERVE,
    "kvtier serve --storage-url": ("tests/test_sglang_service_l3.py::test_the_service_stores_and_finds_the_objects_sglangs_own_l3_writes",
                                   "tests/support/service.py::start_service"),
    "kvtier spec": ("tests/test_readme.py::test_kvtier_spec_lists_every_preset_the_models_table_names",),
    "kvtier spec NAME": ("tests/test_groups.py::test_kvtier_spec_shows_a_hybrid_preset_per_group",),
}

PIP = "installs from a package index, which the suite does not reach (run.sh installs what the suite needs before it runs)"
SYSTEMD = "systemd, which the suite does not run; the units' commands and options are checked here (test_the_deploy_page_*)"
VLLM_TTFT = ("a benchmark of minutes (three vLLM engine processes, 2,048-token prompts; its dated figure is in benchmarks.md); "
             "its options are checked against its --help here")
#: every command docs/ shows that no test runs -> why
ILLUSTRATION: dict[str, str] = {
    "./run.sh test --co -q": "installs the extras and the demo model into .venv from package indexes; CI's clean clone runs that "
                             "install through ./run.sh test -q (.ci/run)",
    '.venv/bin/python -m pytest -m "not integration" -q': "runs the suite itself (its quick subset), not a test in it",
    ".venv/bin/python -m pytest tests/test_radix_lru.py -q": "runs one file of the suite itself",
    "KVTIER_SOAK_SEEDS=100 KVTIER_SOAK_STEPS=1200 .venv/bin/python -m pytest -q tests/test_core_hybrid_stateful.py "
    "tests/test_engine_device_hybrid_stateful.py": "runs two files of the suite itself, long (100 seeds of 1,200 steps: hours on "
                                                   "this VM); the suite runs the same state machines on their short settings",
    ".venv/bin/mkdocs serve": "serves the pages on a local port until Ctrl-C; the suite builds the same site with mkdocs build "
                              "--strict (tests/test_readme.py)",
    ".venv/bin/python examples/vllm_restart.py --storage-url redis://127.0.0.1:6379/0":
        "needs a Redis server on 127.0.0.1:6379, which the suite does not start (its Redis servers listen on free ports); the "
        "script on its default file store is run by tests/test_examples.py",
    "python -m kvtier.app.bench.vllm_ttft --prompt-tokens 2048": VLLM_TTFT,
    "python -m kvtier.app.bench.vllm_ttft --prompt-tokens 2048 --model small-gemma3 --chat-turns 0": VLLM_TTFT,
    "python -m sglang.launch_server --model-path ... --enable-hierarchical-cache --hicache-storage-backend dynamic "
    "--hicache-storage-backend-extra-config '...'":
        "needs a GPU: sglang.launch_server does not start on the CPU machines the suite runs on (known-gaps.md); kvtier's backend "
        "runs inside SGLang's cache stack in tests/test_sglang_stack.py, and this extra config is checked against its options here",
    "pip install": PIP,
    "pip install -e .": PIP,
    "pip install -e '.[vllm]'": PIP,
    "pip install 'kvtier[gpu]'": PIP,
    "pip install 'kvtier[redis]'": PIP,
    "pip install kvtier": PIP,
    "systemctl daemon-reload": SYSTEMD,
    "systemctl enable --now kvtier.service kvtier-vllm@0.service kvtier-vllm@1.service": SYSTEMD,
    "journalctl -u kvtier.service -u kvtier-vllm@0.service -u kvtier-vllm@1.service -f": SYSTEMD,
}


@cache
def docs_commands() -> dict[str, tuple[str, str]]:
    """key -> (the first page that shows it, the command as that page shows it)."""
    out: dict[str, tuple[str, str]] = {}
    for page in PAGES:
        for k, cmd in commands_in(page.read_text()).items():
            out.setdefault(k, (page.name, cmd))
    return out


def all_shown(key: str) -> list[str]:
    """Every form of ``key`` the pages show (a long quoted argument may differ between pages)."""
    return [cmd for page in PAGES for k, cmd in commands_in(page.read_text()).items() if k == key]


# ---- the pages' commands ----------------------------------------------------------------------------------
def test_every_fenced_block_names_its_language_so_no_command_hides_in_an_untagged_one():
    untagged = [f"{page.name}:{line}" for page in PAGES for lang, _, line in fenced_blocks(page.read_text()) if not lang]
    assert not untagged, f"tag these blocks (bash for commands, text for output and synopses): {untagged}"


def test_every_command_the_docs_show_is_run_by_a_test_or_is_an_illustration_that_says_why():
    shown = docs_commands()
    assert len(shown) > 60 and "kvtier serve --status --socket /run/kvtier/node.sock" in shown  # (the pages were read)
    both = sorted(RUN_BY.keys() & ILLUSTRATION.keys())
    assert not both, f"run by a test or an illustration, not both: {both}"
    unknown = [f"{page}: {k}" for k, (page, _) in shown.items() if k not in RUN_BY and k not in ILLUSTRATION]
    assert not unknown, "docs commands no test runs: add the test to RUN_BY, or the reason it cannot run to ILLUSTRATION:\n" + \
        "\n".join(unknown)
    stale = sorted((RUN_BY.keys() | ILLUSTRATION.keys()) - shown.keys())
    assert not stale, f"entries no page shows any more (drop them): {stale}"


@pytest.mark.parametrize("key", sorted(RUN_BY))
def test_the_code_named_for_a_command_exists_and_names_its_program_options_and_json_keys(key):
    chain = RUN_BY[key]
    problems = chain_problems(chain)
    assert not problems, problems
    if "::" not in chain[0]:  # a script that holds the command as written
        text = (ROOT / chain[0]).read_text()
        assert all(cmd in text for cmd in all_shown(key)), f"{chain[0]} does not run {key!r}"
        return
    source = chain_source(chain)
    for cmd in all_shown(key) or [key]:
        missing = [what for what, pattern in distinctive(cmd) if not re.search(pattern, source)]
        assert not missing, f"{key!r}: {' -> '.join(chain)} never names {missing}"


def test_the_check_finds_a_command_that_a_test_does_not_run():
    """(The check above is not vacuous: a test that runs another subcommand, or leaves out an option, fails it.)"""
    source = chain_source(("tests/test_cli.py::test_run_end_to_end_small_workload",))
    assert [w for w, p in distinctive("kvtier plan --json") if not re.search(p, source)] == ["plan"]
    assert [w for w, p in distinctive("kvtier run --tiers-service PATH") if not re.search(p, source)] == ["--tiers-service"]
    assert chain_problems(("tests/test_cli.py::test_run_end_to_end_small_workload", "tests/support/service.py::start_service")) == [
        "tests/support/service.py::start_service: the link before it does not name start_service"]


# ---- options ----------------------------------------------------------------------------------------------------
def kvtier_lines() -> list[tuple[str, str]]:
    """(page, command or synopsis) of every ``kvtier ...`` the pages show, the deploy page's units included."""
    out = [(page.name, cmd) for page in PAGES for cmd in commands_in(page.read_text()).values() if words(cmd)[0] == "kvtier"]
    out += [(page.name, s) for page in PAGES for s in synopses_in(page.read_text())]
    for name, unit in systemd_units(DEPLOY).items():
        for value in (v for k, vs in unit.items() if k.startswith("Exec") for v in vs):
            out += [(f"deploy.md {name}", "kvtier " + " ".join(argv[1:])) for argv in exec_argvs(value) if Path(argv[0]).name == "kvtier"]
    return out


def test_every_kvtier_option_the_docs_name_is_one_its_command_takes():
    lines = kvtier_lines()
    assert len(lines) > 40 and any(p.startswith("deploy.md kvtier.service") for p, _ in lines)
    commands = kvtier_commands()
    wrong = [f"{page}: {cmd!r} -> {unknown_flags(cmd, options_of(commands[kvtier_path(cmd)]))}" for page, cmd in lines
             if kvtier_path(cmd) and unknown_flags(cmd, options_of(commands[kvtier_path(cmd)]))]
    assert not wrong, "options these commands do not take (see kvtier CMD --help):\n" + "\n".join(wrong)


def test_cli_md_names_every_command_and_every_option():
    """The command line's page: a synopsis line per command, naming each of its options (or its family, --cache-*)."""
    synopses = [s for s in synopses_in((DOCS / "cli.md").read_text())]
    by_path: dict[tuple[str, ...], list[str]] = {}
    for s in synopses:
        by_path.setdefault(kvtier_path(s), []).append(s)
    commands = kvtier_commands()
    leaves = {path for path, cmd in commands.items() if path and not getattr(cmd, "commands", None)}
    assert leaves - by_path.keys() == set(), f"commands cli.md's synopsis leaves out: {sorted(leaves - by_path.keys())}"
    for path in sorted(leaves):
        named = [f for s in by_path[path] for f in flags(s)]
        cmd = commands[path]
        left_out = sorted(o for p in cmd.params for o in p.opts if o.startswith("--") and o not in named
                          and not any(f.endswith("*") and o.startswith(f[:-1]) for f in named))
        assert not left_out, f"kvtier {' '.join(path)}: cli.md's synopsis leaves out {left_out}"


def python_lines() -> list[tuple[str, str, str]]:
    """(page, command, its script or module) of every ``python`` command of ours the pages show."""
    out = []
    for page in PAGES:
        for cmd in commands_in(page.read_text()).values():
            w = words(cmd)
            if not re.fullmatch(r"(\S*/)?python3?", w[0]):
                continue
            target = w[2] if w[1] == "-m" else w[1]
            if target.startswith("kvtier.") or target.startswith("examples/"):
                out.append((page.name, cmd, target))
    return out


def test_every_option_of_our_python_scripts_and_modules_the_docs_name_is_one_they_take():
    lines = python_lines()
    assert {t for _, _, t in lines} >= {"kvtier.app.bench.vllm_ttft", "examples/vllm_restart.py", "kvtier.app.bench.gpu_check"}
    wrong = []
    for page, cmd, target in lines:
        if target == "kvtier.app.vllm_cli":
            continue  # vLLM's own options: the next test
        bad = unknown_flags(cmd, typer_options(target))
        if bad:
            wrong.append(f"{page}: {cmd!r} -> {bad}")
    assert not wrong, "\n".join(wrong)


def vllm_serve_lines() -> list[tuple[str, str]]:
    """(where, command) of every vLLM server command the pages show with options: the vLLM page's, the deploy units'."""
    out = []
    for page in PAGES:
        for cmd in commands_in(page.read_text()).values():
            w = words(cmd)
            if flags(cmd) and (w[:2] == ["vllm", "serve"] or w[1:4] == ["-m", "kvtier.app.vllm_cli", "serve"]):
                out.append((page.name, cmd))
    for name, unit in systemd_units(DEPLOY).items():
        for argv in (a for v in unit.get("ExecStart", []) for a in exec_argvs(v)):
            if Path(argv[0]).name == "vllm":
                out.append((f"deploy.md {name}", " ".join(argv)))
    return out


def test_every_vllm_serve_option_the_docs_name_is_one_vllm_serve_takes():
    """vLLM's ``serve --help=all`` on its CPU build (one vLLM import: about 15 s)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (the vllm extra)")
    lines = vllm_serve_lines()
    assert {where for where, _ in lines} >= {"vllm.md", "deploy.md kvtier-vllm@.service"}
    r = subprocess.run([sys.executable, "-m", "kvtier.app.vllm_cli", "serve", "--help=all"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", r.stdout))
    assert {"--kv-transfer-config", "--block-size", "--port"} <= known
    wrong = [f"{where}: {bad}" for where, cmd in lines for bad in [unknown_flags(cmd, known)] if bad]
    assert not wrong, wrong


def test_every_connector_config_the_docs_pass_is_one_the_backends_accept():
    """The JSON a page passes to vLLM (``--kv-transfer-config``) or SGLang (its storage backend's extra config)."""
    from kvtier.integrations.sglang.options import SGLangStorageOptions

    configs = [(page.name, cmd, obj) for page in PAGES for cmd in commands_in(page.read_text()).values() for obj in json_args(cmd)]
    for v in units()["kvtier-vllm@.service"]["ExecStart"]:
        (argv,) = exec_argvs(v)
        configs.append(("deploy.md", "--kv-transfer-config", json.loads(option(argv, "--kv-transfer-config"))))
    kinds = set()
    for page, cmd, obj in configs:
        if "--kv-transfer-config" in cmd:
            kinds.add("vllm")
            check_vllm_config(obj)
        elif "--hicache-storage-backend-extra-config" in cmd:
            kinds.add("sglang")
            assert (obj["module_path"], obj["class_name"]) == ("kvtier.integrations.sglang.backend", "KvtierStorage"), page
            assert defines("kvtier.integrations.sglang.backend", "KvtierStorage")
            SGLangStorageOptions.from_extra_config(obj)
        else:
            raise AssertionError(f"{page}: a JSON argument of {cmd!r} this test does not know")
    assert kinds == {"vllm", "sglang"}


def defines(module: str, cls: str) -> bool:
    """``module``'s file defines class ``cls`` (read, not imported: the connector imports vLLM)."""
    return re.search(rf"^class {cls}\b", (ROOT / (module.replace(".", "/") + ".py")).read_text(), re.M) is not None


def check_vllm_config(obj: dict):
    from kvtier.integrations.vllm.options import ConnectorOptions

    assert obj["kv_connector"] == "KVTierConnector" and defines(obj["kv_connector_module_path"], "KVTierConnector")
    assert obj["kv_role"] == "kv_both"
    return ConnectorOptions.from_extra_config(obj["kv_connector_extra_config"])


# ---- the index ------------------------------------------------------------------------------------------------
def test_the_index_links_every_page():
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    assert {p.name for p in PAGES} - {"index.md"} - linked == set()


# ---- the deploy page ----------------------------------------------------------------------------------------------
def units() -> dict[str, dict[str, list[str]]]:
    return systemd_units(DEPLOY)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def service_argv() -> list[str]:
    (argv,) = exec_argvs(units()["kvtier.service"]["ExecStart"][0])
    assert Path(argv[0]).name == "kvtier" and argv[1] == "serve"
    return argv


def test_the_deploy_page_shows_a_service_and_an_engine_unit():
    assert set(units()) == {"kvtier.service", "kvtier-vllm@.service"}
    assert "kvtier-vllm@0.service kvtier-vllm@1.service" in DEPLOY  # two engines of the template


def test_the_deploy_pages_engines_attach_to_the_services_socket_with_a_config_the_connector_accepts():
    socket = option(service_argv(), "--socket")
    (argv,) = exec_argvs(units()["kvtier-vllm@.service"]["ExecStart"][0])
    assert Path(argv[0]).name == "vllm" and argv[1] == "serve"
    opts = check_vllm_config(json.loads(option(argv, "--kv-transfer-config")))
    assert opts.tiers.service == socket and opts.storage.url is None  # the service's store is the engines' L3
    assert opts.tiers.service_timeout_s > 10  # the first attach waits while the service makes its region


def test_the_deploy_pages_units_do_what_the_page_says():
    svc, engine = units()["kvtier.service"], units()["kvtier-vllm@.service"]
    argv = service_argv()
    # the socket's directory: systemd's, private (kvtier serve refuses one open to others; systemd's default mode is 0755)
    assert svc["RuntimeDirectory"] == ["kvtier"] and svc["RuntimeDirectoryMode"] == ["0700"]
    assert Path(option(argv, "--socket")).parent == Path("/run/kvtier")
    # the store below the region: a directory systemd makes for the service
    assert option(argv, "--storage-url") == "file:///var/cache/" + svc["CacheDirectory"][0] + "/l3"
    # stopping: longer than the L3 drain; started: only once --status answers on the socket
    assert int(svc["TimeoutStopSec"][0]) > float(option(argv, "--drain-timeout-s"))
    post = [a for v in svc["ExecStartPost"] for a in exec_argvs(v) if Path(a[0]).name == "kvtier"]
    assert post and post[0][1:] == ["serve", "--status", "--socket", option(argv, "--socket")]
    # the engines: the same user, ordered after the service, wanting it but not bound to it, restarted on failure
    assert engine["User"] == svc["User"] and engine["Group"] == svc["Group"]
    assert engine["After"] == engine["Wants"] == ["kvtier.service"] and not {"Requires", "BindsTo", "Requisite"} & engine.keys()
    assert engine["Restart"] == svc["Restart"] == ["on-failure"]
    assert all(int(u["LimitNOFILE"][0]) >= 65536 for u in (svc, engine))


def test_the_deploy_pages_service_command_serves_the_status_and_metrics_the_page_names(tmp_path):
    """The service unit's ``kvtier serve`` with its own options (the socket, size, store and metrics port made
    local), its ``ExecStartPost`` readiness check, and what the page says to watch: ``kvtier serve --status``'s
    fields and every ``kvtier_service_*`` metric the page names, scraped with an engine attached that
    computed a prompt (its pages published and saved to the store)."""
    argv = service_argv()[2:]
    local = {"--socket": None, "--host-gb": None, "--storage-url": f"file://{tmp_path / 'l3'}", "--metrics-port": "0"}
    rest, i = [], 0
    while i < len(argv):
        if argv[i] in local:
            if local[argv[i]] is not None:
                rest += [argv[i], local[argv[i]]]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock, 0.01, *rest)
    try:
        url = re.search(r"metrics on (http://\S+/metrics)", svc.banner).group(1)
        r = kvtier("serve", "--status", "--socket", sock)  # the unit's ExecStartPost: it answers before any engine attached
        assert r.returncode == 0 and json.loads(r.stdout)["clients"] == 0, r.stderr
        # a member of --allow-group's group names the service's uid; a service of another uid than the one named is refused
        r = kvtier("serve", "--status", "--socket", sock, "--service-uid", str(os.getuid()))
        assert r.returncode == 0 and json.loads(r.stdout)["clients"] == 0, r.stderr
        r = kvtier("serve", "--status", "--socket", sock, "--service-uid", str(os.getuid() + 1))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and f"of uid {os.getuid() + 1} " in r.stderr, r.stderr
        peer = start_peer("compute", sock)
        try:
            pages = peer_report(peer)["backed_up"]
            wait_until(lambda: json.loads(kvtier("serve", "--status", "--socket", sock).stdout)["l3"]["saved_pages"] == pages, 60)
            r = kvtier("serve", "--status", "--socket", sock)  # what the page shows to watch
            assert r.returncode == 0, r.stderr
            status = json.loads(r.stdout)
            named = set(re.findall(r"`(\w+)`", DEPLOY[DEPLOY.index("It prints JSON") : DEPLOY.index("`--metrics-port 9400` serves")]))
            fields = set(status) | set(status["l3"]) | {"region_problem"}  # (region_problem: only when the region is damaged)
            assert named - fields == set(), f"the page names --status fields it has not: {sorted(named - fields)}"
            assert status["clients"] == 1 and status["num_pages"] > 0 and status["l3"]["saved_pages"] == pages
            samples = {name for name, _labels in scrape_metrics(url)}
            shown = set(re.findall(r"`(kvtier_service_\w+)", DEPLOY))
            assert len(shown) > 20 and shown - samples == set(), f"metrics the page names that the service does not serve: " \
                                                                 f"{sorted(shown - samples)}"
        finally:
            tell(peer, "")
            peer.wait(60)
    finally:
        assert stop(svc.proc) == 0


# ---- commands the pages show that no other test ran -------------------------------------------------------------
def report(r: subprocess.CompletedProcess) -> dict:
    """The JSON a command printed, which exited 0."""
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_kvtier_plan_compares_the_routing_policies_on_16_nodes():
    rep = report(kvtier("plan", "--limit", "300", "--plan-nodes", "16", "--compare-routing", "--json"))
    assert rep["nodes"] == 16 and len(rep["per_node"]) == 16
    assert [row["routing"] for row in rep["routing_comparison"]] == ["round_robin", "affinity", "kv_aware"]


def test_kvtier_plan_of_a_hybrid_preset_with_its_window_pages_in_a_pool_of_their_own():
    """``kvtier plan --plan-spec gpt-oss-120b --plan-storage-tb 0 --plan-host-tb H --plan-window-pool POOL --json``
    (cli.md's table), both pools: the report's groups, no L3."""
    reports = {pool: report(kvtier("plan", "--limit", "300", "--plan-spec", "gpt-oss-120b", "--plan-storage-tb", "0", "--plan-host-tb",
                                   "0.5", "--plan-window-pool", pool, "--json")) for pool in ("shared", "own")}
    for pool, rep in reports.items():
        assert rep["capacity_blocks"]["storage_shared"] == 0 and rep["hit_ratio"]["storage"] == 0, pool
        assert "groups" in rep and rep["hit_ratio"]["total"] > 0, pool


def test_kvtier_bench_cache_replays_a_hybrid_preset_beside_full_attention():
    rep = report(kvtier("bench", "cache", "--model", "gpt-oss-120b", "--no-vllm", "--no-sglang", "--limit", "20", "--reps", "1",
                        "--json"))
    assert rep["requests"] == 20
    assert rep["hybrid"]["model"] == "gpt-oss-120b" and rep["hybrid"]["cost_over_full"] > 0 and rep["hybrid"]["pages_per_s"] > 0


def test_kvtier_run_replays_the_shipped_trace():
    rep = report(kvtier("run", "--workload-kind", "trace", "--workload-limit", "2", "--workload-scale", "0.005", "--no-progress", "--json",
                        "-", *SMALL[SMALL.index("--tiers-device-pages"):]))
    assert rep["requests"] == 2 and rep["logits_equal"] is True and rep["tokens"] > 0
