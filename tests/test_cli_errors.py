"""Every bad input a careless user types gives one readable line on stderr naming the bad value,
exit 2, no traceback, and creates nothing outside the paths given (hardening issue, items 12-14)."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from kvtier.app.devservers import free_port

from support.plan_profiles import profile_of

RUN = ["run", "--no-progress"]
RECORD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def _trace(tmp: Path, name: str, records: list) -> str:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(id, argv, text the one error line must contain). Paths live under ``tmp``."""
    afile = tmp / "a-file"
    afile.write_text("not a directory")
    string_section = tmp / "string-section.json"
    string_section.write_text(json.dumps({"tiers": "big"}))
    dead = free_port()
    trace = lambda name, recs: ["--workload-kind", "trace", "--workload-trace", _trace(tmp, name, recs)]  # noqa: E731
    return [
        # 12: tracebacks before
        ("file-max-gb", [*RUN, "--storage-url", f"file://{tmp}/store?max_gb=lots"], "max_gb='lots'"),
        ("redis-port", [*RUN, "--storage-url", "redis://127.0.0.1:notaport/0"], "notaport"),
        ("redis-db", [*RUN, "--storage-url", f"redis://127.0.0.1:{dead}/abc"], "'abc'"),
        ("redis-timeout", [*RUN, "--storage-url", f"redis://127.0.0.1:{dead}/0?timeout=fast"], "timeout='fast'"),
        ("missing-trace", [*RUN, "--workload-kind", "trace", "--workload-trace", f"{tmp}/absent.jsonl"], "absent.jsonl"),
        ("hash-ids-strings", [*RUN, *trace("s.jsonl", [{**RECORD, "hash_ids": ["a", "b"]}])], "hash_ids"),
        ("hash-ids-huge", [*RUN, *trace("h.jsonl", [{**RECORD, "hash_ids": [2**70, 1]}])], str(2**70)),
        ("input-length-negative", [*RUN, *trace("n.jsonl", [{**RECORD, "input_length": -5}])], "-5"),
        ("empty-trace", [*RUN, *trace("e.jsonl", [])], "no requests"),
        ("sessions-0", [*RUN, "--workload-sessions", "0"], "sessions"),
        ("tenants-0", [*RUN, "--workload-tenants", "0"], "tenants"),
        ("device-cuda", [*RUN, "--tiers-device", "cuda"], "'cuda'"),
        ("device-tpu", [*RUN, "--tiers-device", "tpu"], "'tpu'"),
        ("host-gb-nan", [*RUN, "--tiers-host-gb", "nan"], "nan"),
        ("host-gb-inf", [*RUN, "--tiers-host-gb", "inf"], "inf"),
        ("host-gb-string", [*RUN, "--tiers-host-gb", "lots"], "'lots'"),
        ("store-root-is-a-file", [*RUN, "--storage-url", f"file://{afile}"], str(afile)),
        ("config-section-string", [*RUN, "--config", str(string_section)], "'big'"),
        ("json-unwritable", [*RUN, "--json", f"{tmp}/no/such/dir/out.json"], "out.json"),
        ("plan-pcie-0", ["plan", "--json", "--limit", "20", "--plan-pcie-gbps", "0"], "pcie_gbps"),
        ("plan-tflops-0", ["plan", "--json", "--limit", "20", "--plan-prefill-tflops", "0"], "prefill_tflops"),
        ("plan-tenants-0", ["plan", "--json", "--limit", "20", "--tenants", "0"], "--tenants must be a whole number >= 1; got 0"),
        ("plan-tenants-validate", ["plan", "--tenants", "2", "--validate", "run"], "--tenants plans a trace; --calibrate and --validate"),
        ("plan-missing-trace", ["plan", "--trace", f"{tmp}/absent.jsonl"], "absent.jsonl"),
        # 13: accepted though wrong before
        ("host-gb-negative", [*RUN, "--tiers-host-gb", "-1"], "-1"),
        ("file-relative", [*RUN, "--storage-url", "file://relative/dir"], "'relative'"),
        ("redis-unreachable", [*RUN, "--storage-url", f"redis://127.0.0.1:{dead}/0?timeout=0.5"], f"127.0.0.1:{dead}"),
        ("plan-device-0", ["plan", "--json", "--limit", "20", "--plan-device-gb", "0"], "device_gb"),
        ("plan-network-negative", ["plan", "--json", "--limit", "20", "--plan-network-gbps", "-3"], "-3"),
        ("plan-flops-negative", ["plan", "--json", "--limit", "20", "--plan-prefill-tflops", "-5"], "-5"),
        ("plan-limit-0", ["plan", "--json", "--limit", "0"], "0"),
        ("plan-limit-negative", ["plan", "--json", "--limit", "-1"], "-1"),
        ("plan-routing-unknown", ["plan", "--json", "--limit", "20", "--plan-routing", "nearest"], "nearest"),
        ("plan-min-match-2", ["plan", "--json", "--limit", "20", "--plan-kv-min-match", "2"], "kv_min_match"),
        ("plan-speedup-0", ["plan", "--json", "--limit", "20", "--plan-arrival-speedup", "0"], "arrival_speedup"),
        ("bench-cache-reps-0", ["bench", "cache", "--json", "--limit", "20", "--reps", "0"], "--reps 0"),
        # 14: a device pool larger than memory
        ("device-pages-huge", [*RUN, "--tiers-device-pages", "1000000000"], "device pool needs"),
        # second hardening round, 12: memory blow-ups refused before allocating
        ("plan-nodes-huge", ["plan", "--json", "--limit", "20", "--plan-nodes", "100000"], "nodes"),
        ("plan-nodes-2**63", ["plan", "--json", "--limit", "20", "--plan-nodes", str(2**63)], "nodes"),
        ("plan-trace-dev-zero", ["plan", "--trace", "/dev/zero"], "longer than"),
        ("bench-cache-trace-dev-zero", ["bench", "cache", "--no-vllm", "--no-sglang", "--trace", "/dev/zero"], "longer than"),
        # 13: every bench subcommand's bad numbers and names
        ("plan-host-tb-1e300", ["plan", "--json", "--limit", "20", "--plan-host-tb", "1e300"], "host_tb"),
        ("bench-transfer-pages-0", ["bench", "transfer", "--pages", "0"], "--pages"),
        ("bench-transfer-pages-negative", ["bench", "transfer", "--pages", "-1"], "--pages"),
        ("bench-transfer-pages-1e9", ["bench", "transfer", "--pages", "1e9"], "1e9"),
        ("bench-transfer-reps-0", ["bench", "transfer", "--reps", "0"], "--reps"),
        ("bench-service-scheduler-waiting", ["bench", "service", "--scheduler-waiting", "1,many"], "--scheduler-waiting '1,many'"),
        ("bench-service-scheduler-waiting-0", ["bench", "service", "--scheduler-waiting", "0"], "counts from 1 to 100000"),
        ("bench-service-vllm-soak-model", ["bench", "service", "--vllm-soak", "1", "--vllm-soak-model", "gpt-7"],
         "--vllm-soak-model 'gpt-7': choose one of tiny-gemma3-5to1, smollm2"),
        ("bench-storage-backend-unknown", ["bench", "storage", "--backends", "nosuch"], "nosuch"),
        ("bench-storage-backends-empty", ["bench", "storage", "--backends", ","], "names none"),
        ("bench-storage-pages-0", ["bench", "storage", "--pages", "0"], "--pages"),
        ("bench-storage-reps-0", ["bench", "storage", "--reps", "0"], "--reps"),
        ("bench-storage-page-size-0", ["bench", "storage", "--page-size", "0"], "--page-size"),
        ("bench-sglang-reps-0", ["bench", "sglang", "--reps", "0"], "--reps"),
        ("audit-tiers-unknown", ["audit", "timing", "--tiers", "device,gpu"], "'gpu'"),
        ("audit-tiers-empty", ["audit", "timing", "--tiers", ","], "--tiers ',' names none"),
        ("audit-samples-few", ["audit", "timing", "--samples", "3"], "at least 8"),
        ("audit-prompt-one-page", ["audit", "timing", "--prompt-tokens", "32"], "more than one page"),
        ("audit-alpha-2", ["audit", "timing", "--alpha", "2"], "between 0 and 1"),
        ("audit-engine", ["audit", "timing", "--engine", "tgi"], "--engine 'tgi': choose run or vllm"),
        ("audit-vllm-model", ["audit", "timing", "--engine", "vllm", "--vllm-model", "gpt-7"], "--vllm-model 'gpt-7': choose one of"),
        ("bench-sglang-pages-0", ["bench", "sglang", "--pages", "0"], "--pages"),
        ("bench-sglang-backend-unknown", ["bench", "sglang", "--backends", "redis"], "'redis'"),
        ("bench-plan-reps-0", ["bench", "plan", "--reps", "0"], "--reps"),
        # third hardening round, 7: a name list that leaves nothing out, an option that would do nothing
        ("spec-unknown", ["spec", "gpt-oss"], "gpt-oss-120b"),
        ("plan-window-pool-own-no-window", ["plan", "--json", "--limit", "20", "--plan-window-pool", "own"], "no sliding-window group"),
        ("plan-window-pool-own-state-model", ["plan", "--json", "--limit", "20", "--plan-spec", "qwen3-next-80b-a3b",
                                              "--plan-window-pool", "own"], "'qwen3-next-80b-a3b' has no sliding-window group"),
        # the planner's measured costs: a missing or corrupt profile, one of another model, a slice past the trace's end
        *profile_cases(tmp),
        *serve_cases(tmp),
    ]


def serve_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """``kvtier serve``'s operations options (issue 46): each refused before its socket's directory is made."""
    serve = ["serve", "--host-gb", "0.01", "--socket", f"{tmp}/run/node.sock"]
    return [
        ("serve-metrics-port-70000", [*serve, "--metrics-port", "70000"], "metrics_port must be an integer >= 0, <= 65535; got 70000"),
        ("serve-metrics-port-string", [*serve, "--metrics-port", "lots"], "'lots'"),
        ("serve-metrics-host-unknown", [*serve, "--metrics-port", "0", "--metrics-host", "no.such.host.invalid"],
         "--metrics-host no.such.host.invalid: cannot serve metrics there"),
        ("serve-allow-group-unknown", [*serve, "--allow-group", "no-such-group-kvtier"],
         "--allow-group no-such-group-kvtier: no such group"),
        ("serve-allow-group-huge", [*serve, "--allow-group", str(2**32)], f"--allow-group {2**32}: not a gid"),
    ]


def profile_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """``kvtier plan --profile`` / ``--calibrate`` / ``--validate``: each fails before any engine starts."""
    run, hybrid, corrupt = tmp / "run-profile.json", tmp / "hybrid-profile.json", tmp / "corrupt-profile.json"
    profile_of("run").save(run)
    profile_of("run-hybrid").save(hybrid)
    corrupt.write_text('{"format": "kvtier-plan-profile", "version": 1, "engine": "run"')
    validate = ["plan", "--json", "--validate", "run", "--profile", str(run)]
    return [
        ("plan-profile-missing", ["plan", "--json", "--limit", "20", "--profile", f"{tmp}/absent-profile.json"], "absent-profile.json"),
        ("plan-profile-corrupt", ["plan", "--json", "--limit", "20", "--profile", str(corrupt)], "is not JSON"),
        ("plan-profile-other-model", ["plan", "--json", "--limit", "20", "--profile", str(run)], "'reference-dsa', not 'deepseek-v3.2'"),
        ("validate-profile-other-model", ["plan", "--json", "--validate", "run", "--profile", str(hybrid), "--limit", "20"],
         "measured with model 'reference-hybrid', not 'reference-dsa'"),
        ("validate-profile-corrupt", ["plan", "--json", "--validate", "run", "--profile", str(corrupt)], "corrupt-profile.json"),
        ("validate-slice-past-end", [*validate, "--limit", "5000"], "runs past the end"),
        ("validate-slice-start-past-end", [*validate, "--start", "3990", "--limit", "10"], "give --limit 3 or less"),
        ("validate-no-profile", ["plan", "--json", "--validate", "run", "--limit", "20"], "give --profile PATH"),
        ("validate-engine-unknown", ["plan", "--json", "--validate", "sglang", "--profile", str(run)], "'sglang'"),
        ("validate-what-if-unknown", [*validate, "--limit", "20", "--what-if", "double-host"], "double-host"),
        ("validate-vllm-write-back", ["plan", "--json", "--validate", "vllm", "--profile", str(run), "--limit", "20",
                                      "--cache-write-policy", "write_back"], "write_through"),
        ("validate-load-2", [*validate, "--limit", "20", "--validate-load", "2"], "--validate-load"),
        ("calibrate-unwritable", ["plan", "--json", "--calibrate", f"{tmp}/no/such/dir/p.json"], "p.json"),
        ("calibrate-grid-too-small", ["plan", "--json", "--calibrate", f"{tmp}/p.json", "--calibrate-max-tokens", "40"],
         "--calibrate-max-tokens 40"),
    ]




def test_every_bad_input_is_one_line_exit_2(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    table = cases(inputs)
    root_before = set(os.listdir("/"))
    inputs_before = {p.name for p in inputs.iterdir()}
    def check(case) -> str | None:
        name, argv, needle = case
        r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", *argv], cwd=work, capture_output=True, text=True, timeout=120)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        ok = r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr and not r.stdout.strip()
        return None if ok else f"{name}: rc={r.returncode} stderr={r.stderr[-400:]!r} stdout={r.stdout[-200:]!r}"

    with ThreadPoolExecutor(3) as pool:  # each case is a fresh interpreter importing torch: overlap them
        failures = [f for f in pool.map(check, table) if f]
    assert not failures, "\n".join(failures)
    assert len(table) == 58 + 14 + 5 + 2 + 7 + 1  # (+7: kvtier audit timing; +1: the vLLM soak's model)
    # nothing created outside the paths given: not in the working directory, not at the filesystem root
    assert list(work.iterdir()) == []
    assert set(os.listdir("/")) == root_before and not Path("/relative").exists()
    assert {p.name for p in inputs.iterdir()} == inputs_before  # no store created beside the bad inputs
