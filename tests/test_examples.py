"""The README's library example runs as written."""

import subprocess
import sys
from pathlib import Path


def test_library_quickstart_runs_and_restores_bytes():
    script = Path(__file__).resolve().parents[1] / "examples" / "library_quickstart.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "device 0, host 0, storage 5 pages" in r.stdout
    assert "5 pages restored bit-exact" in r.stdout
    assert "loaded_pages=5" in r.stdout and "storage_prefetched_pages=5" in r.stdout
