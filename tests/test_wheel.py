"""What ``pip wheel .`` ships: the kvtier package and its data, and no test rig -- no module that installs an
import hook, stands in for another project's modules or writes another project's private state (those
live in the clone's ``peers/`` and ``tests/support/``, which the wheel leaves out)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what a test rig does that a library must not do in its users' processes
RIGS = {
    "an import hook": re.compile(r"sys\.meta_path|MetaPathFinder|importlib\.abc\.Loader|sys\.path_hooks"),
    "a stand-in module": re.compile(r"sys\.modules\[[^]]+\]\s*=|sys\.modules\.setdefault"),
    # another object's private attribute assigned (``ctx._config_bags = ...``; a class's own ``self._x`` is its business)
    "another object's private state written": re.compile(r"^\s*(?!self\b)[A-Za-z_]\w*(?:\.\w+)*\._[a-z]\w*\s*=(?!=)", re.M),
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (built,) = out.glob("kvtier-*.whl")
    return built


def test_the_wheel_ships_the_package_and_its_trace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvtier"}, f"the wheel ships {sorted(tops)}: only the kvtier package belongs in it"
    assert "kvtier/app/workloads/data/mooncake_synthetic_trace.jsonl.gz" in names
    assert "kvtier/core/cache_core.py" in names and not any(n.startswith(("peers/", "tests/")) for n in names)


def test_no_module_in_the_wheel_is_a_test_rig(wheel):
    found = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(".py"):
                text = z.read(name).decode()
                found += [f"{name}: {what}" for what, pattern in RIGS.items() if pattern.search(text)]
    assert not found, "\n".join(found)


def test_the_rig_patterns_find_the_rigs_they_describe():
    """The check above is only as good as its patterns: each finds the rig it names where it lives now."""
    texts = {p: p.read_text() for p in [ROOT / "peers" / "sglang_wheel.py", ROOT / "tests" / "support" / "sglang_stack.py"]}
    assert RIGS["an import hook"].search(texts[ROOT / "peers" / "sglang_wheel.py"])
    assert RIGS["another object's private state written"].search(texts[ROOT / "tests" / "support" / "sglang_stack.py"])
    assert RIGS["another object's private state written"].search(texts[ROOT / "peers" / "sglang_wheel.py"])
