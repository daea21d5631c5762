"""The node service's crash soak (issue 54, item 7), its short version: ``kvtier bench service --soak 50``.
Two engines (the MLA+DSA reference model) and a raw writer on one service, two hybrid engines (sliding-window and
linear-attention layers beside MLA+DSA: their window pages and snapshots in the region too) on another; each cycle
SIGKILLs or SIGTERMs one of them -- an engine, a service, or the writer mid-copy -- and starts it again. Every engine output
equals recompute, every page the writer reads back is what it wrote, no lease is left once every client
exited, every restart comes back, and the restarted services kept host pages (verified)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.service import ENV, ROOT

CYCLES = 50


@pytest.mark.timeout(900)
def test_fifty_crash_cycles_give_no_wrong_output_no_stuck_lease_and_no_failed_restart():
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "bench", "service", "--soak", str(CYCLES), "--json"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stderr[-3000:]
    soak = json.loads(r.stdout)["soak"]
    assert soak["cycles"] == CYCLES and sum(soak["kills"].values()) == CYCLES
    # (seed 0: every victim, both signals)
    assert all(n > 0 for n in soak["kills"].values()) and all(n > 0 for n in soak["signals"].values()), soak
    assert (soak["wrong_outputs"], soak["writer_wrong_pages"], soak["stuck_leases"]) == (0, 0, 0), soak
    assert (soak["failed_restarts"], soak["crashed"]) == (0, 0), soak
    # what was checked is not nothing: requests served with host hits from the service, pages read back, pages adopted
    assert soak["requests"] > CYCLES and soak["host_hit_requests"] > 0 and soak["writer_pages_checked"] > 0, soak
    assert soak["hybrid_requests"] > 0 and soak["hybrid_host_hit_requests"] > 0, soak  # (the hybrid engines' outputs are among them)
    assert soak["service_restarts"] == soak["kills"]["service"] + soak["kills"]["hybrid-service"]
    assert 0 < soak["host_pages_adopted"] <= soak["host_pages_before_kills"], soak
    ttft = soak["restart_ttft"]
    assert ttft["all_host_hits"] and ttft["ratio"] > 0 and ttft["cache_path_service_ms"] > 0 and ttft["cache_path_in_process_ms"] > 0, soak
