"""kvtier inside SGLang's default cache stack, as an SGLang server runs it, on CPU.

Each server is a process running ``tests/support/sglang_stack.py``: SGLang 0.5.23's
``UnifiedRadixCache`` (Rust tree core) built by SGLang's own ``default_radix_cache_factory``
with the hierarchical cache on, its host pool, its ``HybridCacheController`` with its own
prefetch / IO / backup threads, and kvtier attached through ``attach_storage_backend`` on the
``dynamic`` path, with metrics on. Requests go through the cache's own calls (insert with
write-through, ``check_hicache_events``, ``prefetch_from_storage``, ``init_load_back``).

Stand-ins, each listed with its reason in that module's docstring: the server's published
config and process groups (there is no server), page-locking (no CUDA), and the device <-> host
slot copy SGLang binds only on CUDA/ROCm/XPU (the same copy in torch). Nothing on the storage
path is replaced. Pages are compared by the xxh3-128 of their device bytes: the bytes a request
computed on one server against the bytes another server (or the same one after evicting them)
loaded back from kvtier's store.

Not here: ``sglang.launch_server`` itself (it does not start on this CPU machine; see the README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.app.devservers import free_port

pytestmark = pytest.mark.integration

PAGES = 8  # the scenario's prompt: 8 pages of 4 tokens


def run_servers(scenario: str, url: str, kind: str = "mha", world: int = 1) -> list[dict]:
    """``world`` ranks of one server (one process each, a gloo group on 127.0.0.1), each running ``scenario``."""
    tests = Path(__file__).resolve().parent  # the harness (support/) and the clone's peers/ beside kvtier
    path = os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, "-m", "support.sglang_stack", scenario, url, str(rank), str(world), kind],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in range(world)]
    reports = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def stored_objects(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp")]


def assert_sglangs_own_stack(report: dict) -> None:
    assert (report["cache"], report["tree_core"], report["controller"], report["storage"]) == (
        "UnifiedRadixCache", "RustUnifiedTreeCore", "HybridCacheController", "KvtierStorage")
    assert report["storage_metrics_on"] and report["stats_class"] == ["sglang.srt.observability.metrics_collector.StorageMetrics"]


# (stack, prompt tokens, objects stored, objects read back, digests compared)
STACKS = [("mha", 32, PAGES, PAGES, PAGES),
          ("mla", 32, PAGES, PAGES, PAGES),
          # SGLang's DSATokenToKVPool (MLA latent + the indexer's FP8 keys and fp32 scales, 64-token pages): the
          # indexer's host pool rides on the KV pool's pages; a page's digest covers its indexer bytes too
          ("dsa", 8 * 64, 2 * PAGES, 2 * PAGES, PAGES),
          # SGLang's SWA pools (a 2-page sliding-window layer beside a full-attention one): every page of both is
          # stored, a prefetch reads the window's pages only (SGLang's trailing-pages policy), and the window
          # layer's last two pages are compared beside the full layer's eight
          ("swa", 32, 2 * PAGES, PAGES + 2, PAGES + 2),
          # SGLang's hybrid linear pools (a Mamba2-style state layer beside a full one; its tree takes 1-token
          # pages): 32 KV pages and the prompt's state snapshot, whose host pool hands out copies (kvtier moves
          # it by copy); the state comes back into the request's own Mamba slot
          ("mamba", 32, 33, 33, 33)]


@pytest.mark.parametrize("kind,tokens,stored,read,digests", STACKS, ids=[s[0] for s in STACKS])
def test_pages_are_stored_evicted_and_prefetched_back_bit_exact_with_metrics_on(tmp_path, kind, tokens, stored, read, digests):
    [r] = run_servers("write", f"file://{tmp_path}", kind)
    assert_sglangs_own_stack(r)
    assert len(r["written"]) == digests and len(set(r["written"])) == digests  # every page different
    assert r["pages_written"] == stored and len(stored_objects(tmp_path)) == stored
    assert r["after_evict"] == [0, 0]  # neither device nor host holds the prefix any more
    assert (r["prefetched"], r["on_device"]) == (tokens, tokens) and r["pages_read"] == read
    assert r["reloaded"] == r["written"]
    # SGLang's own StorageMetricsCollector took kvtier's get_stats() on every check_hicache_events
    assert (r["backup_pgs_logged"], r["prefetch_pgs_logged"]) == (stored, read)


def test_a_fresh_server_prefetches_what_another_server_stored(tmp_path):
    [writer] = run_servers("write", f"file://{tmp_path}")
    [reader] = run_servers("read", f"file://{tmp_path}")
    assert_sglangs_own_stack(reader)
    assert (reader["prefetched"], reader["on_device"], reader["pages_read"]) == (PAGES * 4, PAGES * 4, PAGES)
    assert reader["reloaded"] == writer["written"]


def test_a_corrupt_page_ends_the_prefetch_there_and_is_deleted(tmp_path):
    [writer] = run_servers("write", f"file://{tmp_path}")
    # page 5: the five before it (20 tokens) are more than SGLang's load-back threshold (10 tokens)
    sixth = [p for p in stored_objects(tmp_path) if p.name == writer["keys"][5]]
    assert len(sixth) == 1
    raw = bytearray(sixth[0].read_bytes())
    raw[-1] ^= 0xFF
    sixth[0].write_bytes(bytes(raw))
    [reader] = run_servers("read", f"file://{tmp_path}")
    assert reader["corrupt"] == 1 and not sixth[0].exists()  # a miss, deleted so the next save writes it again
    assert (reader["prefetched"], reader["on_device"]) == (5 * 4, 5 * 4)  # pages 0-4 only: a prefix stops at a bad page
    assert reader["reloaded"] == writer["written"][:5]


def test_tp2_mla_one_rank_writes_and_both_read_it_back(tmp_path):
    """MLA's KV is the same on every TP rank: SGLang's storage writer (rank 0) stores it once, both ranks
    prefetch it, and the controller's all-reduces over the gloo group agree on the hit."""
    ranks = run_servers("write", f"file://{tmp_path}", "mla", world=2)
    for r in ranks:
        assert_sglangs_own_stack(r)
        assert r["reloaded"] == r["written"] == ranks[0]["written"]
        assert (r["prefetched"], r["pages_read"]) == (PAGES * 4, PAGES)
    assert [r["pages_written"] for r in ranks] == [PAGES, 0]
    assert len(stored_objects(tmp_path)) == PAGES


def test_tp2_mla_with_mamba_state_one_rank_writes_the_kv_and_every_rank_its_own_state(tmp_path):
    """MLA's KV is replicated, a Mamba layer's state is sharded by head: under TP=2 the storage writer (rank 0)
    stores the 32 KV pages, and each rank stores and reads back its own state."""
    ranks = run_servers("write", f"file://{tmp_path}", "mla-mamba", world=2)
    for r in ranks:
        assert_sglangs_own_stack(r)
        assert r["reloaded"] == r["written"] and (r["prefetched"], r["pages_read"]) == (32, 33)
    kv, states = [r["written"][:-1] for r in ranks], [r["written"][-1] for r in ranks]
    assert kv[0] == kv[1] and states[0] != states[1]
    assert [r["pages_written"] for r in ranks] == [33, 1]
    assert len(stored_objects(tmp_path)) == 32 + 2


def test_tp2_mha_every_rank_writes_its_own_shard(tmp_path):
    ranks = run_servers("write", f"file://{tmp_path}", "mha", world=2)
    for r in ranks:
        assert r["reloaded"] == r["written"] and r["pages_written"] == PAGES and r["pages_read"] == PAGES
    assert len(stored_objects(tmp_path)) == 2 * PAGES  # one namespace per rank
