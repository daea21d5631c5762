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

Stacks attached to the node service (``kvtier serve`` on a temp socket, the extra config's
``service`` instead of a store) share pages through its region: what one server stored, another
prefetches; the service SIGKILLed under a server is misses, and a restarted one is used again.

Not here: ``sglang.launch_server`` itself (it does not start on this CPU machine; see the README).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.service import query_status_of, read_line, running_service, start_service, stop, tell
from kvtier.app.devservers import free_port

pytestmark = pytest.mark.integration

PAGES = 8  # the scenario's prompt: 8 pages of 4 tokens


def start_server(scenario: str, url: str, kind: str = "mha", world: int = 1, rank: int = 0, port: int | None = None,
                 **popen) -> subprocess.Popen:
    """One rank of a server running ``scenario`` (``port``: its gloo group's, shared by its ranks)."""
    tests = Path(__file__).resolve().parent  # the harness (support/) and the clone's peers/ beside kvtier
    path = os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()), "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "support.sglang_stack", scenario, url, str(rank), str(world), kind],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)


def run_servers(scenario: str, url: str, kind: str = "mha", world: int = 1) -> list[dict]:
    """``world`` ranks of one server (one process each, a gloo group on 127.0.0.1), each running ``scenario``."""
    port = free_port()
    procs = [start_server(scenario, url, kind, world, rank, port) for rank in range(world)]
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


# ---- stacks attached to the node service ------------------------------------------------------------
def service_url(svc) -> str:
    return f"unix://{svc.socket}"


def next_report(proc: subprocess.Popen, timeout_s: float = 300.0) -> dict:
    """The next JSON line a server prints (anything else it prints is skipped)."""
    while True:
        line = read_line(proc, timeout_s)
        if not line:
            proc.wait(10)
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        if line.startswith("{"):
            return json.loads(line)


# (stack, prompt tokens, region pages and objects stored, pool pages read): the DSA indexer's page is in its latent
# page's region page, written once with it; SGLang reads it in a call of its own (the KV row, then the indexer row).
# SGLang's SWA and Mamba pools have page ids of their own: each of their pages is an object of the region's object pool
# of that name (every window page stored, the window's last two read back; the prompt's state snapshot)
SERVICE_STACKS = [("mha", 32, PAGES, PAGES), ("dsa", 8 * 64, PAGES, 2 * PAGES), ("swa", 32, 2 * PAGES, PAGES + 2),
                  ("mamba", 32, 33, 33)]


@pytest.mark.parametrize("kind,tokens,pages,read", SERVICE_STACKS, ids=[s[0] for s in SERVICE_STACKS])
def test_two_servers_on_one_node_service_share_pages_bit_exact(tmp_path, kind, tokens, pages, read):
    with running_service(tmp_path) as svc:
        [writer] = run_servers("write", service_url(svc), kind)
        assert_sglangs_own_stack(writer)
        assert writer["pages_written"] == pages and writer["reloaded"] == writer["written"] and writer["errors"] == []
        [reader] = run_servers("read", service_url(svc), kind)
        assert_sglangs_own_stack(reader)
        assert (reader["prefetched"], reader["on_device"], reader["pages_read"]) == (tokens, tokens, read)
        assert reader["reloaded"] == writer["written"] and reader["errors"] == []
        status = query_status_of(svc.socket)()
        assert list(status["pages_per_namespace"].values()) == [pages]  # one copy on the node, one namespace
        assert (status["held"], status["writing"], status["clients"], status["orphaned"]) == (0, 0, 0, 0)


def test_a_server_up_while_another_stores_prefetches_its_pages(tmp_path):
    """Two servers attached to one service at once: the reader is up (attached when SGLang registered its pools)
    before the writer computes the prefix; it then prefetches the writer's pages, bit-exact."""
    with running_service(tmp_path) as svc:
        reader = start_server("read-when-told", service_url(svc), stdin=subprocess.PIPE)
        try:
            assert next_report(reader)["ready"]
            assert query_status_of(svc.socket)()["clients"] >= 1
            [writer] = run_servers("write", service_url(svc))
            tell(reader, "go")
            r = next_report(reader)
            assert reader.wait(60) == 0
        finally:
            if reader.poll() is None:
                reader.kill()
        assert (r["prefetched"], r["pages_read"], r["errors"]) == (PAGES * 4, PAGES, [])
        assert r["reloaded"] == writer["written"]


def test_tp2_mha_servers_keep_per_rank_shards_in_one_node_service(tmp_path):
    with running_service(tmp_path) as svc:
        writers = run_servers("write", service_url(svc), "mha", world=2)
        readers = run_servers("read", service_url(svc), "mha", world=2)
        for w, r in zip(writers, readers):
            assert w["pages_written"] == PAGES and r["pages_read"] == PAGES and r["reloaded"] == w["written"]
        assert writers[0]["written"] != writers[1]["written"]  # each rank's own heads
        status = query_status_of(svc.socket)()
        assert sorted(status["pages_per_namespace"].values()) == [PAGES, PAGES]


def test_tp2_mla_servers_store_the_latent_once_per_node(tmp_path):
    with running_service(tmp_path) as svc:
        ranks = run_servers("write", service_url(svc), "mla", world=2)
        assert [r["pages_written"] for r in ranks] == [PAGES, 0]
        readers = run_servers("read", service_url(svc), "mla", world=2)
        for r in readers:
            assert r["reloaded"] == ranks[0]["written"] and r["pages_read"] == PAGES
        assert list(query_status_of(svc.socket)()["pages_per_namespace"].values()) == [PAGES]


def test_a_node_service_killed_under_a_server_is_misses_then_a_restarted_one_is_used_again(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock)
    server = start_server("outage", f"unix://{sock}", stdin=subprocess.PIPE)
    try:
        assert next_report(server)["stored"] == PAGES
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        tell(server, "killed")
        assert next_report(server)["down"]
        svc = start_service(sock)
        tell(server, "restarted")
        r = next_report(server)
        assert server.wait(60) == 0
        [reader] = run_servers("read", f"unix://{sock}")  # another server prefetches what it stored after the restart
        assert reader["reloaded"] == r["written"] and reader["errors"] == []
    finally:
        if server.poll() is None:
            server.kill()
        stop(svc.proc)
    # while it was down: misses, nothing stored, no exception in SGLang's threads, in bounded time
    assert (r["down_prefetched"], r["down_on_device"], r["down_written"]) == (0, 0, 0) and r["down_faults"] >= 1
    assert r["down_s"] < 60 and r["errors"] == []
    # once it was back: the server attached again on its own, stored and prefetched back bit-exact
    assert r["reattaches"] >= 1 and (r["prefetched"], r["on_device"]) == (PAGES * 4, PAGES * 4)
    assert r["reloaded"] == r["written"]
