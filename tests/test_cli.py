"""The CLI as a user runs it: subprocesses, exit codes, JSON on stdout, one-line errors."""

import json
import subprocess
import sys

from support.cli import SMALL, kvtier


def test_run_end_to_end_small_workload(tmp_path):
    plot = tmp_path / "run.png"
    r = kvtier("run", "--no-progress", "--json", "-", "--plot", str(plot), *SMALL)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 12
    assert report["hit_ratio"]["device"] > 0 and report["hit_ratio"]["host"] > 0 and report["hit_ratio"]["storage"] > 0, report["hit_ratio"]
    assert report["logits_equal"] is True and report["logits_bit_exact"] is True and report["indexer_topk_equal"] is True
    assert report["bytes_moved"]["host_to_device"] > 0 and report["bytes_moved"]["storage_to_host"] > 0
    assert (
        report["tokens_loaded"] + report["tokens_recomputed"] + round(report["hit_ratio"]["device"] * report["tokens"])
        >= report["tokens"] - 1
    )
    assert plot.stat().st_size > 10_000


def test_run_reads_config_file_and_flags_override(tmp_path):
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(
        '[workload]\nsessions = 2\nturns = 2\nsystem_tokens = 64\nuser_tokens = 20\nreply_tokens = 10\n'
        '[cache]\nwrite_policy = "write_back"\n'
    )
    r = kvtier("run", "--no-progress", "--json", "-", "--config", str(cfg), "--workload-turns", "1")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 2  # 2 sessions x 1 turn (flag beat the file)
    assert report["stats"]["backed_up_pages"] == 0  # write_back and nothing evicted


def test_host_budget_error_is_one_line(tmp_path):
    r = kvtier("run", "--no-progress", "--tiers-host-gb", "100000")
    assert r.returncode == 2
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "host pool needs" in lines[0] and "shrink the host pool" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_config_values_are_one_line():
    r = kvtier("run", "--no-progress", "--cache-write-policy", "sometimes")
    assert r.returncode == 2 and "write_policy must be one of" in r.stderr and "Traceback" not in r.stderr


def test_bench_transfer_json_fields():
    r = kvtier("bench", "transfer", "--json", "--pages", "16", "--layers", "2", "--reps", "2")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(x["spec"], x["layout"], x["direction"]) for x in rows} >= {
        ("deepseek-v3.2", "page_first", "load_per_layer"),
        ("llama-3.1-8b", "layer_first", "backup_all_layers"),
    }
    for x in rows:
        assert set(x) >= {"layout", "direction", "spec", "page_bytes", "gbps", "memcpy_gbps", "ratio"} and x["gbps"] > 0 and x["ratio"] > 0


def test_storage_bench_summary_best_and_median():
    """Best rounds give GB/s and ratio; the median is of each round's own ratio, not of the bests."""
    from kvtier.app.bench.storage import summarize

    row = summarize("file", "put", 1_000_000, 4, {"kvtier": [0.002, 0.001, 0.004], "raw": [0.001, 0.002, 0.002]})
    assert (row.gbps, row.raw_gbps, row.ratio) == (4.0, 4.0, 1.0)
    assert row.median_ratio == 0.5  # rounds: 0.5, 2.0, 0.5


def test_bench_storage_json_rows(tmp_path):
    """Small run of ``kvtier bench storage`` on file, a real Redis and a 3-node cluster: one put and one get row per
    backend, throughputs measured (not made up: the ratio is their quotient), and nothing left behind."""
    import os
    import shutil

    if not shutil.which("redis-server"):
        raise AssertionError("redis-server must be installed (.ci/run installs it)")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.app.cli",
            "bench",
            "storage",
            "--backends",
            "file,redis,redis-cluster",
            "--pages",
            "4",
            "--reps",
            "2",
            "--page-size",
            "16",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["backend"], row["op"]) for row in rows] == [(b, op) for b in ("file", "redis", "redis-cluster") for op in ("put", "get")]
    from kvtier.l3.page import PageCodec
    from kvtier.spec import KVSpec

    obj = PageCodec.for_spec(KVSpec.preset("deepseek-v3.2", page_size=16)).object_bytes
    for row in rows:
        assert row["object_bytes"] == obj and row["pages"] == 4
        assert row["gbps"] > 0 and row["raw_gbps"] > 0
        assert abs(row["ratio"] - row["gbps"] / row["raw_gbps"]) < 0.01
        assert row["median_ratio"] > 0
    assert list(tmp_path.iterdir()) == []  # stores and servers' directories removed
