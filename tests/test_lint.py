"""The project's own lint, run by the test command: ``ruff check`` with the rule set and the
140-character limit in ``pyproject.toml`` (pycodestyle, pyflakes, mutable defaults, closures over
a loop variable). A finding fails the suite with ruff's own report."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes_on_the_whole_project():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "kvtier", "peers", "tests", "examples"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "All checks passed" in r.stdout
