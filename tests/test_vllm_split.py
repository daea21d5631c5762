"""The vLLM connector's scheduler side and its workers, talking only through vLLM's messages.

No engine here: two workers (two tensor-parallel ranks, each with its own KV tensors, host
shard and L3 namespace) and one scheduler side are driven step by step the way vLLM drives
them -- plans out in the connector metadata, each rank's ``build_connector_worker_meta``
aggregated with vLLM's ``aggregate`` and handed to ``update_connector_output`` -- so the
consistency rules can be checked byte for byte: a page counts only when every rank has it,
and a page that failed on one rank is a miss for both.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from kvtier.core.plans import CutShort, Done, Failed, Reason
from kvtier.errors import ConfigError, ExecutorError
from kvtier.hashing import page_keys
from kvtier.integrations.vllm.messages import KVTierWorkerMeta, RankResult, join
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.hashing import request_scope
from kvtier.integrations.vllm.scheduler import ConnectorScheduler
from support.vllm_split import BS, LAYERS, TOKENS, Engine, finish, gate_copies, request, serve, start


def test_pages_round_trip_through_l3_on_every_rank(tmp_path):
    url = f"file://{tmp_path / 'l3'}"
    first = Engine(url, seed=1)
    _req, external, hit = serve(first, "a", TOKENS, [3, 7, 5, 9])
    assert external == 0 and hit["offloaded_pages"] == 3  # the partial tail block is never stored
    first.settle()
    stats = [w.stats for w in first.workers]
    assert [(s.offloaded_pages, s.saved_pages) for s in stats] == [(3, 3), (3, 3)]
    originals = [[first.page(r, b) for b in (3, 7, 5)] for r in range(2)]
    first.close()

    second = Engine(url, seed=2)  # a restart: new tensors, empty host shards, the same store
    _req, external, hit = serve(second, "b", TOKENS, [0, 1, 2, 4])
    assert external == 3 * BS and (hit["host_pages"], hit["storage_pages"]) == (0, 3)
    for r in range(2):  # each rank got its own bytes back
        assert [second.page(r, b) for b in (0, 1, 2)] == originals[r]
    assert second.load_errors[-1] == set()
    # the pages are now on host in the scheduler's index: the next request hits host memory
    _req, external, hit = serve(second, "c", TOKENS, [6, 8, 10, 11])
    assert (external, hit["host_pages"], hit["storage_pages"]) == (3 * BS, 3, 0)
    assert [second.page(1, b) for b in (6, 8, 10)] == originals[1]
    second.close()


def test_a_page_that_failed_on_one_rank_is_a_miss_on_both(tmp_path):
    url = f"file://{tmp_path / 'l3'}"
    first = Engine(url, seed=3)
    serve(first, "a", TOKENS, [3, 7, 5, 9])
    first.settle()
    first.close()
    second = Engine(url, seed=4)
    keys = page_keys(TOKENS, BS, second.scheduler._root)
    # rank 1's object of the second page gets a flipped byte: its checksum fails when rank 1 reads it
    [victim] = [p for p in (tmp_path / "l3").rglob(keys[1].hex()) if p.parent.parent.name.split("-")[0].endswith("_tp1")]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(raw)

    _req, external, hit = serve(second, "b", TOKENS, [0, 1, 2, 4])
    assert external == 3 * BS  # the scheduler saw every rank's object present
    assert second.load_errors[-1] == {1, 2}  # rank 1 stopped at its bad page; vLLM recomputes from block 1 on both
    core = second.scheduler.core
    found = core.lookup(keys[:3])
    assert (found.host_pages, found.storage_pages) == (1, 0)  # only the page both ranks have counts; rank 1's copy went
    core.check_integrity(idle=True)
    second.close()


def test_decoded_blocks_are_stored_for_the_next_turn(tmp_path):
    url = f"file://{tmp_path / 'l3'}"
    eng = Engine(url, seed=5)
    req, _external = start(eng, "chat", TOKENS, [3, 7, 5, 9, 11])
    for tok in range(6):  # decode 6 tokens: positions 14..19 fill block 3 (tokens 12..15) and block 4 (16..19)
        req.all_token_ids.append(900 + tok)
        eng.step(cached=[(req, [], 1)])
    finish(eng, req)
    eng.settle()
    assert [w.stats.offloaded_pages for w in eng.workers] == [5, 5]  # 3 prompt blocks, 2 holding decoded tokens
    turn2 = req.all_token_ids[:19] + [7, 7, 7, 7, 7]  # the answer so far is part of the next prompt
    _r, external, hit = serve(eng, "turn2", turn2, [0, 1, 2, 4, 6, 8])
    assert external == 4 * BS and hit["host_pages"] == 4
    assert [eng.page(0, b) for b in (0, 1, 2, 4)] == [eng.page(0, b) for b in (3, 7, 5, 9)]
    eng.close()


def test_a_failed_load_is_not_offered_again_for_a_while():
    """Rank 1 cannot copy into its blocks: the load fails once, vLLM recomputes, and the next lookups
    do not offer those pages (no lookup -> load -> fail loop) until ``load_retry_s`` passed."""
    import time

    eng = Engine(None, seed=7, load_retry_s=0.5)
    serve(eng, "a", TOKENS, [3, 7, 5, 9])  # computed once: now on host
    inner = eng.workers[1].executor.inner
    real_submit = inner.submit

    def broken(plan, **how):
        if plan.dst.name == "DEVICE":
            inner._ready.append(Failed(plan.op, Reason.ERROR, "injected: rank 1 cannot copy"))
            return
        real_submit(plan, **how)

    inner.submit = broken
    _r, external, hit = serve(eng, "b", TOKENS, [0, 1, 2, 4])
    assert external == 3 * BS and hit["host_pages"] == 3  # offered: the failure is not known yet
    assert eng.load_errors[-1] == {0, 1, 2}  # rank 1 failed them all: vLLM recomputes them on both ranks
    _r, external, _hit = serve(eng, "c", TOKENS, [6, 8, 10, 11])
    assert external == 0  # not offered again right away
    inner.submit = real_submit
    time.sleep(0.6)
    _r, external, _hit = serve(eng, "d", TOKENS, [12, 13, 14, 15])
    assert external == 3 * BS and eng.load_errors[-1] == set()
    assert [eng.page(1, b) for b in (12, 13, 14)] == [eng.page(1, b) for b in (3, 7, 5)]
    eng.scheduler.core.check_integrity()
    eng.close()


def test_join_and_aggregate_are_per_page_minimums():
    assert join(Done(1), Done(1, 2)) == Done(1)
    assert join(Done(1), CutShort(1, 3, Reason.MISS)) == CutShort(1, 3, Reason.MISS)
    assert join(CutShort(1, 2, Reason.CORRUPT, 1), CutShort(1, 5, Reason.MISS)) == CutShort(1, 2, Reason.CORRUPT, 1)
    assert type(join(CutShort(1, 2, Reason.MISS), Failed(1, Reason.ERROR, "x"))) is Failed
    a = KVTierWorkerMeta({1: RankResult(Done(1)), 2: RankResult(CutShort(2, 1, Reason.MISS))})
    b = KVTierWorkerMeta({2: RankResult(Done(2), frozenset({1}))})
    agg = a.aggregate(b)
    assert agg.results[1] == RankResult(Done(1)) and agg.results[2] == RankResult(CutShort(2, 1, Reason.MISS), frozenset({0, 1}))


def test_scheduler_never_waits_and_refuses_write_back(tmp_path):
    eng = Engine(f"file://{tmp_path / 'l3'}", seed=6)
    with pytest.raises(ExecutorError, match="cannot wait"):
        eng.scheduler.port.wait([1])
    eng.close()
    with pytest.raises(ConfigError, match="write_through"):
        ConnectorScheduler(
            ConnectorOptions.from_extra_config({"storage_url": "file:///tmp/x", "storage_write_policy": "write_back"}), BS, 1, "m"
        )


def test_stats_count_tokens_and_bytes_per_tier_and_reach_prometheus(tmp_path):
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvtier.integrations.vllm.connector import KVTierConnector

    url = f"file://{tmp_path / 'l3'}"
    first = Engine(url, seed=8)
    serve(first, "a", TOKENS, [3, 7, 5, 9])
    first.settle()
    page_bytes = first.workers[0].executor.inner.engine.host.spec.page_bytes
    stats = [w.take_stats() for w in first.workers]
    agg = stats[0].aggregate(stats[1])  # what vLLM's aggregator does over ranks
    # tokens once per request (rank 0's), bytes from both ranks (each copied its own shard)
    assert stats[1].data["tokens"] == {"host|store": 0, "storage|store": 0}
    assert agg.data["tokens"] == {"host|store": 3 * BS, "storage|store": 3 * BS}
    assert agg.data["bytes"]["storage|store"] == 2 * 3 * page_bytes and len(agg.data["store_seconds"]) == 2
    first.close()
    second = Engine(url, seed=9)
    serve(second, "b", TOKENS, [0, 1, 2, 4])
    s, other = second.workers[0].take_stats(), second.workers[1].take_stats()
    assert s.data["tokens"] == {"storage|load": 3 * BS, "host|load": 3 * BS} and s.data["load_failed_tokens"] == 0
    assert other.data["tokens"] == {"storage|load": 0, "host|load": 0} and other.data["bytes"] == s.data["bytes"]
    assert second.workers[0].take_stats() is None  # a new interval: nothing moved yet
    reduced = s.reduce()
    assert reduced["host_load_tokens"] == 3 * BS and reduced["avg_load_seconds"] > 0

    reg = CollectorRegistry()
    types = {Counter: partial(Counter, registry=reg), Gauge: partial(Gauge, registry=reg), Histogram: partial(Histogram, registry=reg)}
    prom = KVTierConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    rebuilt = KVTierConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(s.data)))
    prom.observe(rebuilt.data, 0)
    assert reg.get_sample_value("vllm:kvtier_tokens_total", {"engine": "0", "tier": "storage", "direction": "load"}) == 3 * BS
    assert reg.get_sample_value("vllm:kvtier_bytes_total", {"engine": "0", "tier": "host", "direction": "load"}) == 3 * page_bytes
    assert reg.get_sample_value("vllm:kvtier_load_seconds_count", {"engine": "0"}) == 1
    second.close()


@pytest.mark.integration
def test_redis_killed_mid_run_gives_misses_then_hits(tmp_path):
    """Redis dies between steps: lookups answer "not stored", saves fail in the background, every step
    still finishes within a bound and nothing raises into vLLM's scheduler or workers; once Redis is
    back, pages are saved and hit from L3 again."""
    import time

    from kvtier.app.devservers import RedisServer, wait_until

    server = RedisServer(tmp_path / "redis").start()
    try:
        eng = Engine(server.url, seed=10, host_pages=3)  # one request's pages: L3 is where older prefixes live
        serve(eng, "a", TOKENS, [3, 7, 5, 9])
        eng.settle()
        server.kill()
        t0 = time.monotonic()
        other = list(range(500, 514))
        _r, external, _hit = serve(eng, "b", other, [0, 1, 2, 4])  # evicts a's pages from host; its saves fail
        eng.settle()
        assert external == 0
        _r, external, hit = serve(eng, "c", TOKENS, [6, 8, 10, 11])  # a's pages: evicted from host, store down
        assert external == 0 and hit["storage_pages"] == 0
        assert time.monotonic() - t0 < 30
        assert any(w.stats.save_failures for w in eng.workers)
        eng.scheduler.core.check_integrity()
        server.start()
        fresh = list(range(900, 914))

        def stored_and_hit() -> bool:
            serve(eng, "d", fresh, [0, 1, 2, 4])
            eng.settle()
            serve(eng, "e", TOKENS, [6, 8, 10, 11])  # push d's pages out of host memory again
            eng.settle()
            _r, external, hit = serve(eng, "f", fresh, [12, 13, 14, 15])
            return external == 3 * BS and hit["storage_pages"] > 0

        wait_until(stored_and_hit, timeout=30, what="L3 saves and hits after Redis came back")
        eng.close()
    finally:
        server.stop()


def test_tiers_reach_vllms_kv_event_stream(tmp_path):
    """BlockStored when a block's host copy is readable on every rank (medium CPU) and when its L3 save
    completed (STORAGE), BlockRemoved when host memory evicts it (CPU) and when a lookup finds it gone
    from the store (STORAGE) -- in vLLM's own block hashes."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external  # what vLLM publishes for a block hash

    eng = Engine(f"file://{tmp_path / 'l3'}", seed=11, host_pages=3)

    def hashed(rid, tokens):
        r = request(rid, tokens)
        r.block_hashes = [bytes([len(rid), i]) * 16 for i in range(len(tokens) // BS)]  # vLLM's, as the router knows them
        return r

    def start_hashed(rid, tokens, blocks):
        req = hashed(rid, tokens)
        external, _ = eng.scheduler.get_num_new_matched_tokens(req, 0)
        eng.scheduler.update_state_after_alloc(req, external)
        req.num_computed_tokens = external
        eng.step(new=[(req, blocks, len(tokens) - external)])
        eng.scheduler.request_finished(req)
        return req

    a = start_hashed("a", TOKENS, [3, 7, 5, 9])
    eng.settle()
    events = eng.scheduler.events.take()
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in events] == [
        ("BlockStored", "CPU", [external(h) for h in a.block_hashes[:3]]),
        ("BlockStored", "STORAGE", [external(h) for h in a.block_hashes[:3]]),
    ]
    assert events[0].token_ids == TOKENS[:12] and events[0].parent_block_hash is None and events[0].block_size == BS
    start_hashed("bb", list(range(500, 514)), [0, 1, 2, 4])  # needs all 3 host pages: a's leave host memory
    eng.settle()
    events = eng.scheduler.events.take()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and sorted(removed[0].block_hashes) == sorted(external(h) for h in a.block_hashes[:3])
    assert removed[0].medium == "CPU"
    assert [e.medium for e in events if isinstance(e, BlockStored)] == ["CPU", "STORAGE"]
    # the store drops a's second block on its own (a cap, maxmemory): the next lookup that asks for it says so
    lost = page_keys(TOKENS[:8], BS, eng.scheduler._root, eng.options.cache.hash_algo)[1]
    files = [f for f in (tmp_path / "l3").rglob("*") if lost.hex() in f.name]
    assert len(files) == 2  # one object per rank
    files[1].unlink()  # gone on one rank is gone
    again = hashed("a", TOKENS)
    assert eng.scheduler.get_num_new_matched_tokens(again, 0)[0] == BS  # block 0 still in L3 on both ranks
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in eng.scheduler.events.take()] == [
        ("BlockRemoved", "STORAGE", [external(a.block_hashes[1])])
    ]
    eng.scheduler.get_num_new_matched_tokens(hashed("a2", TOKENS), 0)
    assert eng.scheduler.events.take() == []  # reported once
    eng.close()


def test_pages_evicted_between_lookup_and_schedule_are_load_errors():
    """vLLM asks, then schedules the request later; if kvtier's pages left host memory in between, the
    blocks it was promised are reported as load errors by every rank, so vLLM recomputes them."""
    eng = Engine(None, seed=12, host_pages=3)
    serve(eng, "a", TOKENS, [3, 7, 5, 9])
    late = request("late", TOKENS)
    external, _ = eng.scheduler.get_num_new_matched_tokens(late, 0)
    assert external == 3 * BS
    serve(eng, "other", list(range(700, 714)), [0, 1, 2, 4])  # needs the 3 host pages: a's go
    eng.scheduler.update_state_after_alloc(late, external)
    late.num_computed_tokens = external
    meta = eng.step(new=[(late, [6, 8, 10, 11], len(TOKENS) - external)])
    assert meta.unavailable_blocks == [6, 8, 10] and eng.load_errors[-1] == {6, 8, 10}
    eng.scheduler.core.check_integrity()
    eng.close()


@pytest.mark.parametrize("announce_layers", [True, False])
def test_blocks_computed_in_a_step_are_copied_out_as_each_layer_is_written(announce_layers):
    """The copy of layer i starts at save_kv_layer(i), after the forward wrote it; layers vLLM never
    announces are copied at wait_for_save. Either way host memory ends with what the forward wrote."""
    eng = Engine(None, ranks=2)
    blocks = [3, 7, 5, 9]
    g = torch.Generator().manual_seed(11)

    def forward(rank, layer):  # the step's forward writes this layer's KV of the blocks it computes
        kv = eng.kv[rank][f"layer{layer}"]
        kv[blocks] = torch.randn(kv[blocks].shape, generator=g).to(kv.dtype)

    req = request("a", TOKENS)
    eng.scheduler.get_num_new_matched_tokens(req, 0)
    eng.scheduler.update_state_after_alloc(req, 0)
    meta = eng.step(new=[(req, blocks, len(TOKENS))], forward=forward, announce_layers=announce_layers)
    [copy] = [p for p in meta.plans if p.src.name == "DEVICE"]
    assert list(copy.src_pages) == blocks[:3]  # full blocks only
    for w in eng.workers:
        w.drained_stats()  # the copies out finish after the step (vLLM keeps the blocks until they did)
        host = w.executor.inner.engine.host
        assert [host.page_bytes(h) for h in copy.dst_pages] == [b"".join(eng.page(w.tp_rank, b)) for b in copy.src_pages]
        early, late = (LAYERS, 0) if announce_layers else (0, LAYERS)
        assert (w.stats.offload_layers_in_forward, w.stats.offload_layers_at_step_end) == (early, late)
        assert w.stats.offloaded_pages == 3
    eng.close()


@pytest.fixture
def gated_copies(monkeypatch):
    return gate_copies(monkeypatch)


def test_a_finished_requests_blocks_are_kept_until_every_rank_copied_them(gated_copies):
    """request_finished asks vLLM to keep the blocks while the copy out of them runs; each rank reports
    the request in get_finished once its own copy is done -- not before, and once."""
    eng = Engine(None, seed=13)
    req, _ = start(eng, "a", TOKENS, [3, 7, 5, 9])
    keep, params = eng.scheduler.request_finished(req)
    assert keep is True and params["kvtier"]["offloaded_pages"] == 3
    meta = eng.step()
    [copy_op] = meta.delayed["a"]
    eng.step()
    assert eng.finished_sending[-2:] == [[set(), set()], [set(), set()]]  # the copies are still running
    gated_copies.set()
    for _ in range(10):
        eng.settle()
        if all(any("a" in r for r in ranks) for ranks in zip(*eng.finished_sending)):
            break
    assert [sum("a" in step[r] for step in eng.finished_sending) for r in range(2)] == [1, 1]
    assert all(eng.scheduler.core.holds(k) for k in page_keys(TOKENS, BS, eng.scheduler._root, eng.options.cache.hash_algo))
    eng.close()


def test_a_preempted_requests_copies_finish_before_the_next_forward_reuses_its_blocks(gated_copies):
    """vLLM frees a preempted request's blocks at once and the next step may overwrite them:
    handle_preemptions waits for kvtier's copies out of them first, so host memory has what they held."""
    import threading

    eng = Engine(None, seed=14)
    blocks = [3, 7, 5, 9]
    req, _ = start(eng, "p", TOKENS, blocks)
    originals = [[eng.page(r, b) for b in blocks[:3]] for r in range(2)]
    timer = threading.Timer(0.2, gated_copies.set)  # the copies can only finish once the next step began
    timer.start()

    def reuse(rank, layer):  # the next request's forward writes into the freed blocks
        eng.kv[rank][f"layer{layer}"][blocks] = 0

    meta = eng.step(preempted=["p"], forward=reuse)
    timer.join()
    assert len(meta.preempted_copies) == 1
    for r, w in enumerate(eng.workers):
        w.drained_stats()
        host = w.executor.inner.engine.host
        copy = next(p for m in eng.metas for p in m.plans if p.op == meta.preempted_copies[0])
        assert [host.page_bytes(h) for h in copy.dst_pages] == [b"".join(page) for page in originals[r]]
    eng.close()


def test_a_rank_reported_twice_counts_once_and_never_stands_in_for_another_rank():
    """Rank 0's report of a load arrives twice (within one step's aggregate, and again next step) and
    rank 1 has not copied: the load is not complete -- before, two reports counted as two ranks and
    the prefix was served from host with rank 1's blocks stale."""
    from kvtier.core.plans import Tier, copy_plan
    from kvtier.integrations.vllm.scheduler_port import SchedulerPort

    port = SchedulerPort(world_size=2, probe=None)
    port.submit(copy_plan(5, Tier.HOST, [0, 1], Tier.DEVICE, [3, 4]))
    assert [p.op for p in port.take_plans()] == [5]
    rank0 = KVTierWorkerMeta({5: RankResult(Done(5), frozenset({0}))})
    port.deliver(rank0.aggregate(rank0).results)  # the same rank twice in one step's aggregate
    port.deliver(rank0.results)  # and once more the next step
    assert port.poll() == [] and 5 in port.in_flight and port.duplicate_reports == 2
    port.deliver({5: RankResult(Failed(5, Reason.ERROR, "rank 1 cannot copy"), frozenset({1}))})
    assert [type(c).__name__ for c in port.poll()] == ["Failed"] and not port.in_flight  # a failure on any rank fails all
    port.deliver({5: RankResult(Done(5), frozenset({1}))})  # a late report of a plan already answered: ignored
    port.deliver({9: RankResult(Done(9), frozenset({7}))})  # a plan never sent, from a rank outside the world
    assert port.poll() == [] and port.stray_reports == 2


def test_a_rank_that_never_runs_a_copy_out_gives_vllm_its_blocks_back_and_nothing_is_cached():
    """Rank 1 never runs the copy out of a finished request's blocks. Before, vLLM held the blocks
    and the scheduler its host pages for ever. Now, after ``rank_timeout_s``, rank 1 reports the
    request finished (its blocks go back to vLLM, the copy counts as failed), the scheduler fails
    the plan (nothing cached) and holds its host pages until the late copy answers."""
    import time

    eng = Engine(None, rank_timeout_s=0.5)
    inner = eng.workers[1].executor.inner
    real_submit, stuck = inner.submit, []

    def never_copies_out(plan, **how):
        if plan.src.name == "DEVICE":
            stuck.append((plan, how))
            return
        real_submit(plan, **how)

    inner.submit = never_copies_out
    req, _external = start(eng, "a", TOKENS, [3, 7, 5, 9])
    keep, _params = eng.scheduler.request_finished(req)
    assert keep and stuck
    first, t0 = len(eng.finished_sending), time.monotonic()
    while not any("a" in step[1] for step in eng.finished_sending[first:]) and time.monotonic() - t0 < 5:  # bounded
        eng.step()
        time.sleep(0.05)
    waited = time.monotonic() - t0
    reported = [sum("a" in step[r] for step in eng.finished_sending[first:]) for r in (0, 1)]
    assert reported == [1, 1] and 0.4 <= waited < 3, (reported, waited)
    core, port = eng.scheduler.core, eng.scheduler.port
    assert eng.workers[1].stats.copies_abandoned == 1 and port.timed_out_plans == 1 and core.stats.timed_out_plans == 1
    held = set(core.host_alloc.parked)
    assert held and not any(core.holds(k) for k in core.page_keys(TOKENS))  # nothing of "a" cached
    core.check_integrity()
    # the late copy runs after all: its answer (Failed: abandoned) reaches the scheduler, the pages are free again
    inner.submit = real_submit
    for plan, how in stuck:
        real_submit(plan, **how)
        inner.release_rest(plan.op)
    t0 = time.monotonic()
    while core.host_alloc.parked and time.monotonic() - t0 < 5:
        eng.step()
        time.sleep(0.02)
    assert not core.host_alloc.parked and core.stats.unknown_completions == 0
    assert eng.workers[1].stats.offloaded_pages == 0  # the abandoned copy never counted as done
    _r, external, _hit = serve(eng, "b", TOKENS, [0, 1, 2, 4])
    assert external == 0  # nothing offered from the failed copy
    core.check_integrity()
    eng.close()


@pytest.mark.parametrize("lists", [(), ([3, 7], [5, 9]), [3, 7, 5, 9]])
def test_block_ids_not_one_list_per_kv_cache_group_are_a_typed_error_naming_both_counts(lists):
    """vLLM hands the connector a request's block ids as one list per KV cache group; anything else (a
    short tuple, a list per group too many, a flat list) is refused by name, not an IndexError mid-step."""
    from types import SimpleNamespace

    eng = Engine(None, ranks=1)
    req = request("bad", TOKENS)
    eng.scheduler.get_num_new_matched_tokens(req, 0)
    eng.scheduler.update_state_after_alloc(req, 0)
    out = SimpleNamespace(num_scheduled_tokens={"bad": len(TOKENS)}, preempted_req_ids=set(),
                          scheduled_new_reqs=[SimpleNamespace(req_id="bad", block_ids=lists, num_computed_tokens=0)],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                num_computed_tokens=[]))
    with pytest.raises(ConfigError, match="request 'bad'.*serves 1 KV cache group"):
        eng.scheduler.build_meta(out)
    eng.close()


# ---- a request's scope: its cache_salt and LoRA adapter --------------------------------------------------------
_SALTS = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["\ud800", "a\udfff|b", "a|b", "|", "\x00"]), st.integers())


@given(a=st.tuples(_SALTS, _SALTS), b=st.tuples(_SALTS, _SALTS))
def test_two_requests_share_a_scope_only_with_the_same_salt_and_adapter_and_no_salt_ever_raises(a, b):
    """The scope is injective: a salt and an adapter name never combine into another pair's (the old '|'-join
    made salt 'a|b' and salt 'a' with adapter 'b' one scope); any salt, lone surrogates and non-strings included,
    scopes its request instead of raising on vLLM's scheduler thread. An empty salt is no salt."""
    norm = lambda pair: tuple(None if v == "" else v for v in pair)  # noqa: E731
    same = norm(a) == norm(b) and all(type(x) is type(y) for x, y in zip(norm(a), norm(b)))
    assert (request_scope(*a) == request_scope(*b)) == same
    assert (request_scope(*a) == b"") == (norm(a) == (None, None))


def test_a_salt_scopes_its_pages_on_every_tier_even_one_no_utf8_encoder_takes(tmp_path):
    """Salts as vLLM's API hands them over (any JSON string, a lone surrogate included): a request hits only
    pages of its own salt and adapter -- salt 'a|b' is not salt 'a' with adapter 'b' -- and the scheduler never
    raises."""
    eng = Engine(f"file://{tmp_path / 'l3'}", seed=1)
    try:
        def scoped(rid: str, salt, lora=None):
            req = request(rid, TOKENS)
            req.cache_salt = salt
            req.lora_request = SimpleNamespace(lora_name=lora) if lora else None
            return req

        for i, (salt, lora) in enumerate([("a|b", None), ("\ud800", None)]):
            req = scoped(f"w{i}", salt, lora)
            assert eng.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
            eng.scheduler.update_state_after_alloc(req, 0)
            eng.step(new=[(req, [0, 1, 2, 3], len(TOKENS))])
            finish(eng, req)
        full = (len(TOKENS) - 1) // BS * BS
        cases = [("a|b", None, full), ("a", "b", 0), ("\ud800", None, full), ("\udfff", None, 0), (None, None, 0)]
        hits = [eng.scheduler.get_num_new_matched_tokens(scoped(f"r{i}", salt, lora), 0)[0] for i, (salt, lora, _) in enumerate(cases)]
        assert hits == [want for _s, _l, want in cases]
    finally:
        eng.close()
