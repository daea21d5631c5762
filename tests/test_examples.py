"""The README's examples run as written: the library's, and vLLM's (an engine restarted into an L3 hit)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest


def test_library_quickstart_runs_and_restores_bytes():
    script = Path(__file__).resolve().parents[1] / "examples" / "library_quickstart.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "device 0, host 0, storage 5 pages" in r.stdout
    assert "5 pages restored bit-exact" in r.stdout
    assert "loaded_pages=5" in r.stdout and "storage_prefetched_pages=5" in r.stdout


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_vllm_restart_example_hits_l3_after_the_restart():
    """``python examples/vllm_restart.py`` (the README's vLLM example), on a short prompt: the second send
    hits host memory, the restarted engine hits L3 for the same pages, and all three answer alike."""
    script = Path(__file__).resolve().parents[1] / "examples" / "vllm_restart.py"
    r = subprocess.run([sys.executable, str(script), "--prompt-tokens", "100"], capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if "kvtier hit" in line]
    assert len(lines) == 3, r.stdout
    hits = [re.search(r"kvtier hit +(\d+) tokens \(host (\d+) pages, L3 (\d+) pages\)\s+text (.*)$", line).groups() for line in lines]
    (t0, h0, s0, text0), (t1, h1, s1, text1), (t2, h2, s2, text2) = hits
    assert int(t0) == 0 and int(t1) > 0 and int(h1) > 0 and int(s1) == 0  # the second send: from host memory
    assert int(t2) == int(t1) and int(h2) == 0 and int(s2) == int(h1)  # the restarted engine: the same pages from L3
    assert text0 == text1 == text2
