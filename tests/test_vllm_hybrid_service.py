"""vLLM's connector with a hybrid model (a sliding-window group beside full attention) on the node service, its
scheduler side and worker driven the way vLLM drives them (:mod:`support.vllm_hybrid_split`) against a real ``kvtier
serve``: another engine's pages come with their window pages, bit-exact; a step's requests are asked about in one
round trip, their objects in one find; a window block vLLM freed is never read as a page's window page. (The real
engine through vLLM's CPU build: tests/test_vllm_hybrid.py.)"""

from __future__ import annotations

import time

import pytest
import torch

from support.service import running_service, start_service, stop, wait_until
from support.vllm_hybrid_split import FULL_LAYER, WINDOW_LAYER, HybridEngine, request
from support.vllm_split import gate_copies

from kvtier.service.client import query_status

pytestmark = pytest.mark.timeout(300)

X = list(range(100, 126))  # 6 full pages and 2 tokens
OTHER = list(range(500, 526))


def _window_bytes(engine: HybridEngine, blocks) -> list[bytes]:
    return [engine.block(WINDOW_LAYER, b) for b in blocks]


def test_another_engines_pages_come_with_their_window_pages_bit_exact(tmp_path):
    with running_service(tmp_path, 0.01, "--verify-sample", "1") as svc:
        a, b = HybridEngine(svc.socket, seed=1), HybridEngine(svc.socket, seed=2)
        try:
            assert a.serve("a", X, range(1, 8), range(10, 17)) == (0, False)
            a.settle()
            assert query_status(svc.socket)["object_pools"] == ["window"]
            external, failed = b.serve("b", X, range(30, 37), range(40, 47))
            assert (external, failed) == (24, False)  # six pages: the last one's boundary is the prompt's last full page
            for i in range(6):  # every page a's full layer computed, in b's blocks
                assert b.block(FULL_LAYER, 40 + i) == a.block(FULL_LAYER, 10 + i), f"page {i}"
            for i in (4, 5):  # the window the boundary at page 6 reads (7 tokens before it: pages 4 and 5)
                assert b.block(WINDOW_LAYER, 30 + i) == a.block(WINDOW_LAYER, 1 + i), f"window page {i}"
            b.scheduler.core.check_integrity(idle=True)
        finally:
            a.close()
            b.close()


def test_a_steps_requests_are_asked_in_one_round_trip_and_their_objects_in_one_find_even_where_one_makes_room_from_another(tmp_path):
    """Both prompts in the service's L3 only (it was restarted); engine B, whose share holds one prompt's pages, asks about
    both in one step: the second's pages make room from the first's, whose tree nodes then carry the second's keys --
    one find names each object once, the service (which loads what it misses from L3) stays up, and B stays attached."""
    sock = str(tmp_path / "run" / "node.sock")
    store = f"file://{tmp_path / 'l3'}"
    svc = start_service(sock, 0.01, "--storage-url", store)
    b = None
    try:
        a = HybridEngine(sock, seed=1, service_lookups="request")
        try:
            a.serve("a1", X, range(1, 8), range(10, 17))
            a.serve("a2", OTHER, range(21, 28), range(30, 37))
            a.settle()
        finally:
            a.close()
        wait_until(lambda: query_status(sock)["l3"]["saving_pages"] == 0 and query_status(sock)["clients"] == 0, 30)
        stop(svc.proc)  # (SIGTERM: its region goes, its store stays)
        svc = start_service(sock, 0.01, "--storage-url", store)
        b = HybridEngine(sock, seed=2, host_pages=8, service_lookup_timeout_s=10.0)  # (vLLM's default: a step's lookups together)
        r1, r2 = request("b1", X), request("b2", OTHER)
        assert b.scheduler.get_num_new_matched_tokens(r1, 0)[0] is None and b.scheduler.get_num_new_matched_tokens(r2, 0)[0] is None
        before = query_status(sock)
        b.step()  # the step's end: one lookup frame for both, then one find for the window group
        after = query_status(sock)
        assert after["lookups"] - before["lookups"] <= 2 and after["finds"] - before["finds"] == 1, after
        assert svc.proc.poll() is None and not b.scheduler.leased.lost
        b.scheduler.core.check_integrity()
    finally:
        if b is not None:
            b.close()
        stop(svc.proc)


def test_a_window_page_whose_copy_out_waited_a_step_is_never_read_from_a_block_vllm_freed(tmp_path, monkeypatch):
    """x prefills in two chunks; the second chunk's copy out waits behind the first's, so it is planned a step later --
    when vLLM has freed x's window blocks below its window and given one to request y, which writes into it. Whatever
    window page another engine gets of x's is x's own, never y's bytes."""
    gate = gate_copies(monkeypatch)
    with running_service(tmp_path, 0.01) as svc:
        a = HybridEngine(svc.socket, seed=1, service_lookups="request")
        b = None
        try:
            x = request("x", X)
            assert a.scheduler.get_num_new_matched_tokens(x, 0) == (0, False)
            a.scheduler.update_state_after_alloc(x, 0, ([1, 2, 3], [10, 11, 12]))
            a.step(new=[(x, ([1, 2, 3], [10, 11, 12]), 12)])  # pages 0..2: their copy out waits at the gate
            a.step(cached=[(x, ([4, 5, 6], [13, 14, 15]), 12)])  # pages 3..5: not planned (the copy before them runs)
            computed = _window_bytes(a, [1, 2, 3, 4, 5, 6])  # x's window KV of pages 0..5
            gate.set()
            a.settle()
            # the next step: vLLM freed x's window blocks of the pages out of its window (24 computed, 7 read back) --
            # pages 0..3 -- and hands block 4 (page 3's) to y, whose window layer writes its own KV there
            y = request("y", list(range(900, 908)))
            assert a.scheduler.get_num_new_matched_tokens(y, 0) == (0, False)
            a.scheduler.update_state_after_alloc(y, 0, ([4, 8], [20, 21]))
            theirs = torch.randn(a.kv[WINDOW_LAYER][4].shape, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)

            def forward(layer: str) -> None:
                if layer == WINDOW_LAYER:
                    a.kv[WINDOW_LAYER][4].copy_(theirs)

            a.step(new=[(y, ([4, 8], [20, 21]), 8)], cached=[(x, ([7], [16]), 2)], forward=forward)
            a.settle()
            time.sleep(0.2)  # (the publishes are notes)
            b = HybridEngine(svc.socket, seed=2)
            external, failed = b.serve("b", X[:20] + [7777] * 6, range(30, 37), range(40, 47))  # x's first 5 pages, then its own
            assert not failed
            got = _window_bytes(b, range(30, 30 + external // 4))
            y_bytes = theirs.view(torch.uint8).numpy().tobytes()
            assert y_bytes not in got, "a window page of x was y's bytes: read from a block vLLM had freed"
            for page in range(max(0, external // 4 - 2), external // 4):  # the window the hit's boundary reads
                assert got[page] == computed[page], f"window page {page}"
            b.scheduler.core.check_integrity(idle=True)
        finally:
            gate.set()
            if b is not None:
                b.close()
            a.close()


def test_two_ranks_share_their_shards_of_pages_and_window_pages_with_another_engine_bit_exact(tmp_path):
    """vLLM above one rank: each region page holds both ranks' shards of a page, each object of the window pool both ranks'
    shards of a window page. Another engine's ranks each get their own rank's shard back, bit-exact, never the other's."""
    with running_service(tmp_path, 0.01, "--verify-sample", "1") as svc:
        a, b = HybridEngine(svc.socket, seed=1, ranks=2), HybridEngine(svc.socket, seed=2, ranks=2)
        try:
            assert a.serve("a", X, range(1, 8), range(10, 17)) == (0, False)
            a.settle()
            status = query_status(svc.socket)
            assert status["object_pools"] == ["window"]
            assert a.block(FULL_LAYER, 10, 0) != a.block(FULL_LAYER, 10, 1)  # (each rank's heads differ)
            assert b.serve("b", X, range(30, 37), range(40, 47)) == (24, False)
            for rank in (0, 1):
                for i in range(6):
                    assert b.block(FULL_LAYER, 40 + i, rank) == a.block(FULL_LAYER, 10 + i, rank), f"rank {rank} page {i}"
                for i in (4, 5):
                    assert b.block(WINDOW_LAYER, 30 + i, rank) == a.block(WINDOW_LAYER, 1 + i, rank), f"rank {rank} window page {i}"
            b.scheduler.core.check_integrity(idle=True)
        finally:
            a.close()
            b.close()


def test_a_services_l3_names_each_ranks_objects_as_that_ranks_own_l3_does(tmp_path):
    """A hybrid's L3 objects are named by its region format (the split, the object pools): the prefixes the service's L3
    gives each rank are the namespaces each rank's own L3 uses, at TP=1 and TP=2 -- one store serves both, either way."""
    from kvtier.service.storage import shard_prefixes

    for ranks in (1, 2):
        (tmp_path / f"tp{ranks}").mkdir()
        with running_service(tmp_path / f"tp{ranks}", 0.01) as svc:  # (one page format per service)
            a = HybridEngine(svc.socket, seed=1, ranks=ranks)
            try:
                client = a.scheduler.leased.client
                assert shard_prefixes(client.namespace, client.fmt) == [str(w.namespace) for w in a.workers], ranks
            finally:
                a.close()


def _served_by_two_ranks_through_l3(sock: str, l3) -> tuple[HybridEngine, list[bytes], object]:
    """Engine a (TP=2) serves ``X`` on a service at ``sock`` with file L3 at ``l3``, closes, and its saves drain: a (closed),
    the keys of X's pages, and the service (still up)."""
    from support.vllm_hybrid_split import request

    from kvtier.hashing import page_keys

    svc = start_service(sock, 0.01, "--storage-url", f"file://{l3}")
    try:
        a = HybridEngine(sock, seed=1, ranks=2)
        try:
            assert a.serve("a", X, range(1, 8), range(10, 17)) == (0, False)
            a.settle()
            keys = page_keys(X[:24], 4, a.scheduler._request_root(request("k", X)), a.options.cache.hash_algo)
        finally:
            a.close()
        wait_until(lambda: query_status(sock)["l3"]["saving_pages"] == 0 and query_status(sock)["clients"] == 0, 30)
    except BaseException:
        stop(svc.proc)
        raise
    return a, keys, svc


def test_two_ranks_pages_and_window_pages_come_back_from_the_services_l3_each_ranks_own_bit_exact(tmp_path):
    """TP=2 through the in-process harness, the service with --storage-url: engine a's pages and window pages are saved
    per rank; a service on a fresh region brings them back for engine b, each rank its own shard, bit-exact; nothing held."""
    from support.service import store_files
    sock = str(tmp_path / "run" / "node.sock")
    l3 = tmp_path / "l3"
    a, _keys, svc = _served_by_two_ranks_through_l3(sock, l3)
    b = None
    try:
        st = query_status(sock)
        files = store_files(l3)
        stop(svc.proc)
        svc = start_service(sock, 0.01, "--storage-url", f"file://{l3}", "--fresh-region")
        b = HybridEngine(sock, seed=2, ranks=2, service_lookup_timeout_s=10.0)
        external, failed = b.serve("b", X, range(30, 37), range(40, 47))
        b.settle()
        after = query_status(sock)
        assert (external, failed) == (24, False), (external, failed, after["l3"], sorted(files)[:20], st["l3"])
        for rank in (0, 1):
            for i in range(6):
                assert b.block(FULL_LAYER, 40 + i, rank) == a.block(FULL_LAYER, 10 + i, rank), f"rank {rank} page {i}"
            for i in (4, 5):
                assert b.block(WINDOW_LAYER, 30 + i, rank) == a.block(WINDOW_LAYER, 1 + i, rank), f"rank {rank} window page {i}"
        b.scheduler.core.check_integrity(idle=True)
        assert after["held"] == 12 and st["l3"]["saved_pages"] == 12 and len(files) == 24  # (6 pages + 6 window pages, x2 ranks)
    finally:
        if b is not None:
            b.close()
        stop(svc.proc)


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_a_window_object_missing_or_corrupt_on_one_rank_is_never_published(tmp_path, damage):
    """Rank 1's window objects of the boundary's pages gone (or corrupt) in the store: a fresh region never offers those
    window pages (rank 0's alone would be half an object); what b loads is each rank's own, and nothing stays held."""
    from kvtier.hashing import group_object_key

    sock = str(tmp_path / "run" / "node.sock")
    l3 = tmp_path / "l3"
    a, keys, svc = _served_by_two_ranks_through_l3(sock, l3)
    b = None
    try:
        stop(svc.proc)
        rank1 = [d for d in l3.iterdir() if "_tp1-" in d.name]
        assert len(rank1) == 1
        hit = 0
        for i in (4, 5):
            h = group_object_key(keys[i], "window").hex()
            path = rank1[0] / h[:2] / h
            assert path.is_file(), path
            hit += 1
            if damage == "delete":
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[-3] ^= 0xFF
                path.write_bytes(bytes(data))
        assert hit == 2
        svc = start_service(sock, 0.01, "--storage-url", f"file://{l3}", "--fresh-region")
        b = HybridEngine(sock, seed=2, ranks=2, service_lookup_timeout_s=10.0)
        external, failed = b.serve("b", X, range(30, 37), range(40, 47))
        b.settle()
        assert not failed
        pages = external // 4
        for rank in (0, 1):
            for i in range(pages):
                assert b.block(FULL_LAYER, 40 + i, rank) == a.block(FULL_LAYER, 10 + i, rank), f"rank {rank} page {i}"
            for i in range(max(0, pages - 2), pages):
                assert b.block(WINDOW_LAYER, 30 + i, rank) == a.block(WINDOW_LAYER, 1 + i, rank), f"rank {rank} window page {i}"
        assert pages < 6, external  # (the boundary at page 6 reads window pages 4 and 5: rank 1's are gone)
        b.close()
        b = None
        wait_until(lambda: query_status(sock)["clients"] == 0, 30)
        wait_until(lambda: query_status(sock)["l3"]["saving_pages"] == 0, 30)  # (b's own window pages, published: saved)
        st = query_status(sock)
        assert st["held"] == 0 and st["writing"] == 0 and st["l3"]["fetching_pages"] == 0, st
    finally:
        if b is not None:
            b.close()
        stop(svc.proc)
