"""Hardening, second round: each test failed on the code before its fix, and checks that nothing
leaked and no bytes moved where they must not (the numbers follow the hardening issue's list)."""

from __future__ import annotations

import pytest

from support.cache_helpers import MODES, device_bytes, expected_page, fill_device, make_cache, on_worker, serve, write_pages
from support.pools import tiny_specs
from kvtier.core.plans import Tier
from kvtier.errors import InvalidStateError, PageOwnershipError
from kvtier.radix import NO_PAGE


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- 1. a failed host->device load never hands out wrong bytes -------------------------------------
def _fail_loads(executor, on: bool) -> None:
    """Next to the bytes: make the transfer engine refuse host->device copies (the executor turns the
    refusal into a Failed completion, as it does for a real copy error), or stop refusing."""
    engine = executor.engine
    if on:
        real = engine.submit

        def refuse_loads(src, dst, *args, **kwargs):
            if (src, dst) == (Tier.HOST, Tier.DEVICE):
                raise RuntimeError("injected: the copy engine failed")
            return real(src, dst, *args, **kwargs)

        engine._unfailing_submit, engine.submit = real, refuse_loads
    else:
        engine.submit = engine._unfailing_submit


def _tree_device_pages(cache) -> set[int]:
    return {n.device_page for n in cache.tree.nodes.values() if n.device_page != NO_PAGE}


@pytest.mark.parametrize("mode", MODES)
def test_failed_load_shrinks_the_request_and_its_pages_are_never_offered(mode):
    spec = tiny_specs(page_size=4, num_layers=2)["dsa"]
    cache = make_cache(spec, dev_pages=10, host_pages=12, write_policy="write_back", mode=mode)
    prompt = tokens(100, 18)  # 4 full pages + a tail
    serve(cache, prompt)
    assert cache.evict_device(4).backed_up == 4  # the 4 pages now live on host only
    fill_device(cache, 0xAB)  # whatever a failed load leaves on device is not the page's bytes
    on_worker(cache, _fail_loads, True)
    # 1. the request hits 4 host pages; their load back fails
    req = cache.begin(prompt)
    assert (req.host_hit, req.num_cached) == (4, 4)
    stale = list(req.cached_pages)
    assert req.wait() == 0 and req.num_cached == 0 and req.failed == 4  # the request is told
    assert cache.stats.load_failed_pages == 4 and cache.stats.transfer_failures == 1
    assert not _tree_device_pages(cache) & set(stale)  # off the tree: no later match can offer them
    # 2. an engine that ignores it cannot commit the failed pages (nothing changes, the request stays open)
    extra = req.alloc(1)
    with pytest.raises(PageOwnershipError, match="failed host->device load"):
        req.commit(stale + extra.pages)
    # 3. the engine recomputes into pages it allocates, and commits them
    new = req.alloc(4)
    write_pages(cache, new.pages, prompt, 0)
    ins = req.commit(new.pages + extra.pages)
    assert device_bytes(cache, ins.device_pages) == [expected_page(spec, prompt, i) for i in range(4)]
    cache.wait_idle()
    cache.check_integrity(idle=True)  # the quarantined pages were freed once the request finished
    assert cache.dev_alloc.num_used == 4
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_failed_load_then_abort_leaves_no_device_hit_on_wrong_bytes(mode):
    spec = tiny_specs(page_size=4, num_layers=2)["mha"]
    cache = make_cache(spec, dev_pages=10, host_pages=12, write_policy="write_back", mode=mode)
    prompt = tokens(500, 16)
    serve(cache, prompt)
    cache.evict_device(4)
    fill_device(cache, 0xCD)
    on_worker(cache, _fail_loads, True)
    req = cache.begin(prompt)
    assert req.wait() == 0 and req.failed == 4
    req.abort()
    cache.wait_idle()
    cache.check_integrity(idle=True)
    assert cache.dev_alloc.num_used == 0  # the 4 quarantined pages are back in the pool, none leaked
    # the next request finds the pages on host again (not on device), and loads the right bytes
    on_worker(cache, _fail_loads, False)
    s = serve(cache, prompt)  # serve checks every page's bytes
    assert (s.device_hit, s.host_hit, s.computed) == (0, 4, 0)
    cache.check_integrity()
    cache.close()


def test_begin_on_a_closed_cache_is_a_typed_error():
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=4, host_pages=4)
    cache.close()
    cache.close()  # twice: a no-op
    for call in (lambda: cache.begin(tokens(0, 8)), lambda: cache.match(tokens(0, 8)), lambda: cache.alloc_device(1),
                 lambda: cache.insert(tokens(0, 4), [1])):
        with pytest.raises(InvalidStateError, match="closed"):
            call()


# ---- 7. a completion for an op the core never planned ----------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_completion_for_an_unknown_op_is_ignored_and_the_rest_of_the_batch_applied(mode):
    from kvtier.core.plans import Done, Failed, Reason

    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=8, host_pages=8, write_policy="write_through", mode=mode)
    port = cache.port
    real_poll, real_wait = port.poll, port.wait
    strays = [Done(10**6), Failed(10**6 + 1, Reason.ERROR, "never planned"), "not a completion"]

    def poll_with_strays():
        got = real_poll()
        return [strays.pop(0), *got] if strays else got

    def wait_with_strays(ops):
        got = real_wait(ops)
        return [strays.pop(0), *got] if strays else got

    port.poll, port.wait = poll_with_strays, wait_with_strays
    for i in range(3):
        serve(cache, tokens(100 * i, 8))  # write-through backups: completions arrive beside the strays
    cache.wait_idle()  # returns: before the fix a KeyError dropped the batch and this spun for ever
    assert not strays and cache.stats.unknown_completions == 3
    cache.check_integrity(idle=True)
    assert cache.stats.backed_up_pages == 6  # every real completion of those batches was applied
    cache.close()


# ---- 2. the file store's cap and temp sweep delete only its own objects -----------------------------
def test_capped_file_store_in_a_shared_directory_keeps_every_user_file(tmp_path):
    import os
    import time
    from pathlib import Path

    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus
    from kvtier.l3.file import dir_name
    from kvtier.l3.page import MAGIC

    root = tmp_path / "with-user-files"
    ns_dir = dir_name("ns")
    # the user's files, all older than anything the store writes: at the root, in folders, named like a
    # temp file, and one laid out and named exactly like a page file but not a page object
    user = {root / "notes.txt": b"mine", root / "model" / "weights.bin": bytes(5000), root / ".tmp-1-2-3": bytes(4000),
            root / "ab" / "ab12": b"x" * 3000, root / ns_dir / "00" / "00aa": b"lookalike" * 400,
            root / ns_dir / "00" / ".tmp-7-7-7": b"user temp" * 400}
    for path, data in user.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        long_ago = time.time() - 30 * 24 * 3600
        os.utime(path, (long_ago, long_ago))
    store = open_backend(f"file://{root}?max_bytes=10000")
    keys = [f"ns/{i:032x}" for i in range(60)]
    for i in range(0, 60, 3):  # 60 objects of 1000 bytes through a 10,000-byte cap: many full cap cycles
        assert store.set(keys[i : i + 3], [memoryview(MAGIC + bytes([i]) * 996)] * 3) == [KeyStatus.OK] * 3
    assert store.usage_bytes() <= 10000 and store.exists(keys[-1:]) == 1  # the cap still holds its own objects
    assert store.exists(keys[:1]) == 0  # and evicted its oldest
    for path, data in user.items():
        assert path.read_bytes() == data, f"the store's cap deleted or changed the user's {path.relative_to(root)}"
    assert Path(store._path(keys[-1])).read_bytes()[:4] == MAGIC


# ---- 6. the file store's root removed under a running store ------------------------------------------
def test_file_store_root_removed_under_a_running_store_is_recreated_and_writes_resume(tmp_path):
    import shutil

    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus
    from kvtier.l3.page import MAGIC

    root = tmp_path / "store"
    store = open_backend(f"file://{root}")
    keys = [f"ns/{i:032x}" for i in range(4)]
    value = memoryview(MAGIC + bytes(60))
    assert store.set(keys[:2], [value] * 2) == [KeyStatus.OK] * 2
    shutil.rmtree(root)  # an operator wipes the store's directory while the engine runs
    assert store.exists(keys[:2]) == 0
    assert store.set(keys[2:], [value] * 2) == [KeyStatus.OK] * 2  # recreated, writes resume
    assert store.exists(keys[2:]) == 2 and root.is_dir() and store.roots_recreated == 1
    out = memoryview(bytearray(len(value)))
    assert store.get(keys[3:], [out]) == [KeyStatus.OK] and bytes(out) == bytes(value)


# ---- 3. every plan an executor receives is checked before any byte moves ----------------------------
def _host_snapshot(executor) -> list[bytes]:
    return [executor.engine.host.page_bytes(p) for p in range(executor.engine.host.num_pages)]


def _stored(executor, keys) -> int:
    return sum(executor.storage.stored_prefix([k]) for k in keys)


def _malformed_plans(keys):
    import dataclasses

    from kvtier.core.plans import GroupRun, Tier, Transfer, copy_plan, fetch_plan, save_plan

    def forged(**fields):  # what an unpickled plan can hold: __post_init__ never ran
        t = object.__new__(Transfer)
        base = dict(op=fields.pop("op", 90), src=Tier.HOST, dst=Tier.DEVICE, src_pages=(0,), dst_pages=(1,), keys=(), after=0, groups=())
        for f in dataclasses.fields(Transfer):
            object.__setattr__(t, f.name, fields.get(f.name, base[f.name]))
        return t

    return {
        "fetch into host page -2": fetch_plan(71, keys[:1], [-2]),
        "save from host page -3": save_plan(72, keys[1:2], [-3]),
        "save from host page 99 of 8": save_plan(73, keys[2:3], [99]),
        "copy to device page 8 of 8": copy_plan(74, Tier.HOST, [0], Tier.DEVICE, [8]),
        "float host page": forged(op=75, src_pages=(0.5,)),
        "bool device page": forged(op=76, dst_pages=(True,)),
        "two pages into one": copy_plan(77, Tier.HOST, [0, 1], Tier.DEVICE, [3, 3]),
        "sides of different lengths": forged(op=78, src_pages=(0, 1), dst_pages=(2,)),
        "key that is a str": forged(op=79, src=Tier.HOST, dst=Tier.STORAGE, src_pages=(0,), dst_pages=(), keys=("k",)),
        "pages as a list": forged(op=80, src_pages=[0]),
        "device to storage": forged(op=81, src=Tier.DEVICE, dst=Tier.STORAGE, dst_pages=(), keys=(keys[0],)),
        "groups that are not group runs": forged(op=82, groups=("swa",)),
        "another KV group's objects": copy_plan(83, Tier.HOST, [0], Tier.DEVICE, [1], 0, (GroupRun("swa", (0,), (0,), (1,)),)),
    }


def _refusals(executor, keys):
    """Submit every malformed plan next to the bytes; returns what came back and whether anything moved."""
    plans = _malformed_plans(keys)
    host_before, dev_before = _host_snapshot(executor), [executor.engine.device.page_bytes(p) for p in range(8)]
    for plan in plans.values():
        executor.submit(plan)
    done = executor.wait([p.op for p in plans.values()])
    moved = (_host_snapshot(executor) != host_before or [executor.engine.device.page_bytes(p) for p in range(8)] != dev_before
             or _stored(executor, keys) != 0)
    return [(c.op, type(c).__name__, c.reason.value, c.detail) for c in done], moved


@pytest.mark.parametrize("mode", MODES)
def test_malformed_plans_complete_failed_invalid_and_move_no_byte(tmp_path, mode):
    from kvtier.hashing import page_keys

    from support.cache_helpers import make_tiered_cache

    spec = tiny_specs(page_size=4, num_layers=2)["mla"]
    cache = make_tiered_cache(spec, 8, 8, f"file://{tmp_path}", mode=mode)
    on_worker(cache, _fill_pools)
    keys = page_keys(list(range(16)), 4, cache.root_key)
    answers, moved = on_worker(cache, _refusals, keys)
    assert not moved, "a malformed plan moved bytes"
    assert len(answers) == len(_malformed_plans(keys))
    for op, kind, reason, detail in answers:
        assert (kind, reason) == ("Failed", "invalid") and detail, (op, kind, reason, detail)
    details = {op: d for op, _, _, d in answers}
    assert "page -2 is outside its pool of 8" in details[71] and "page 99 is outside" in details[73] and "repeat" in details[77]
    cache.close()


def _fill_pools(executor) -> None:
    import torch

    gen = torch.Generator().manual_seed(3)
    for pool in (executor.engine.host, executor.engine.device):
        for name in pool.buffers:
            for layer in range(pool.spec.num_layers):
                rows = pool.rows(name, layer).view(torch.uint8)
                rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen))


# ---- 14. request API misuse is a typed error --------------------------------------------------------
def test_request_api_misuse_is_a_typed_error_and_changes_nothing():
    from kvtier.errors import IndexTypeError, KVTierError

    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=8, host_pages=8)
    serve(cache, tokens(0, 8))
    before = (len(cache.tree), cache.dev_alloc.num_free, cache.stats.requests)
    for bad in (None, (t for t in range(8)), set(range(8)), {1: 2}, "abcdefgh"):
        with pytest.raises(IndexTypeError, match="ordered sequence"):
            cache.begin(bad)
    with pytest.raises(KVTierError, match="integers"):
        cache.begin([0.5] * 8)
    assert (len(cache.tree), cache.dev_alloc.num_free, cache.stats.requests) == before
    req = cache.begin(tokens(0, 8))
    for bad in (None, 5, {0, 1}):
        with pytest.raises(IndexTypeError, match="commit: pages"):
            req.commit(bad)
    req.commit(list(req.cached_pages))  # still open, and commits as it should
    cache.wait_idle()
    cache.check_integrity(idle=True)
    cache.close()


# ---- 9. one stalled server costs the engine's thread one deadline, not one per back-off -------------
@pytest.mark.integration
def test_stalled_redis_blocks_the_engine_thread_under_ten_percent_and_hits_resume(tmp_path):
    """Steady lookups (the engine thread's L3 query every step) against a SIGSTOPped Redis: before,
    the breaker reopened after a fixed 0.5 s and the next lookup paid the whole deadline again
    (77-89% of the wall time blocked). Now the back-off doubles and a probe on a helper thread finds
    the store back; lookups stay non-blocking while the breaker is open."""
    import os
    import signal
    import time

    from kvtier import HostPool
    from kvtier.app.devservers import RedisServer, wait_until
    from kvtier.build import open_storage_tier
    from kvtier.config import StorageConfig
    from kvtier.hashing import Namespace, page_keys

    server = RedisServer(tmp_path / "redis").start()
    try:
        spec = tiny_specs(page_size=4, num_layers=1)["mla"]
        host = HostPool(spec, 8, "page_first")
        ns = Namespace("stall", spec.fingerprint())
        cfg = StorageConfig(url=f"redis://127.0.0.1:{server.port}/0?timeout=0.3", cooldown_s=0.25, max_cooldown_s=2.0)
        tier = open_storage_tier(cfg, host, ns)
        keys = page_keys(list(range(16)), 4, ns.root())
        job = tier.submit("save", keys, [0, 1, 2, 3])
        job.wait(10)
        assert tier.stored_prefix(keys) == 4
        os.kill(server.proc.pid, signal.SIGSTOP)
        blocked, t0 = 0.0, time.monotonic()
        answers = []
        while time.monotonic() - t0 < 8.0:  # bounded: 8 s of engine steps, each a lookup and 10 ms of compute
            s = time.monotonic()
            answers.append(tier.stored_prefix(keys))
            blocked += time.monotonic() - s
            time.sleep(0.01)
        wall = time.monotonic() - t0
        assert set(answers) == {0}  # a stalled store is a miss, never a wrong answer
        assert blocked / wall <= 0.10, f"the engine thread was blocked {blocked / wall:.0%} of {wall:.1f} s"
        assert tier.breaker.probes >= 2 and tier.breaker.opened <= 8  # probed off-thread, with a growing back-off
        os.kill(server.proc.pid, signal.SIGCONT)
        wait_until(lambda: tier.stored_prefix(keys) == 4, timeout=10, what="hits again once the server continues")
        tier.close()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


# ---- 12. values that size allocations are bounded before anything is allocated -----------------------
def test_batch_and_thread_counts_are_bounded_before_anything_is_allocated():
    from kvtier.config import StorageConfig
    from kvtier.errors import ConfigError
    from kvtier.integrations.sglang.options import SGLangStorageOptions

    for make in (lambda **kw: SGLangStorageOptions(**kw), lambda **kw: StorageConfig(url="file:///tmp/x", **kw)):
        with pytest.raises(ConfigError, match=r"batch_pages must be an integer >= 1, <= 4096; got 1000000000"):
            make(batch_pages=10**9)
        with pytest.raises(ConfigError, match=r"io_threads must be an integer >= 1, <= 64; got 1000000"):
            make(io_threads=10**6)
        make(batch_pages=4096, io_threads=64)  # the bounds themselves are fine


# ---- 10. a prefetch given up on releases its locks at once -------------------------------------------
@pytest.mark.integration
def test_a_prefetch_given_up_on_releases_its_locks_at_once_and_its_late_answer_is_discarded(tmp_path):
    import time

    from support.cache_helpers import make_tiered_cache
    from kvtier.app.devservers import RedisServer
    from support.proxies import DripProxy

    server = RedisServer(tmp_path / "redis").start()
    proxy = DripProxy(server.port, interval=0.5, small=1024)  # pages drip a byte every 0.5 s, small answers pass
    proxy.drip.set()
    try:
        spec = tiny_specs(page_size=16, num_layers=4)["mla"]  # 3 KB page objects: past the proxy's "small" replies
        prompt = tokens(7000, 12 * 16)  # 12 pages
        # 1. a first engine stores the prompt's pages in Redis
        first = make_tiered_cache(spec, 16, 32, f"redis://127.0.0.1:{server.port}/0?timeout=3", model="slow")
        serve(first, prompt)
        first.wait_idle()
        first.close()
        # 2. a second engine, a 16-page device, reaches the same Redis through a server that answers a byte every 0.5 s
        cache = make_tiered_cache(spec, 16, 64, f"redis://127.0.0.1:{proxy.port}/0?timeout=3", model="slow",
                                  storage_cfg={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.05, "write_policy": "write_back"})
        t0 = time.monotonic()
        req = cache.begin(prompt)  # 12 pages found in L3; the prefetch gives up after its budget
        assert req.num_cached == 0 and cache.stats.prefetches_given_up == 1 and time.monotonic() - t0 < 2
        new = req.alloc(12)
        write_pages(cache, new.pages, prompt, 0)
        req.commit(new.pages)  # the engine recomputed all 12 pages onto the prefetch's nodes
        # 3. while the stuck read still runs, a request that needs the whole device is served at once
        other = tokens(90000, 16 * 16)  # 16 pages
        t1 = time.monotonic()
        s = serve(cache, other)
        assert s.computed == 16 and time.monotonic() - t1 < 1.0, "the device was pinned by a prefetch given up on"
        assert cache.host_alloc.parked  # the read may still land in its host pages: they are held, not reused
        # 4. the late answer comes, and is discarded: nothing it brought is offered, the held pages go back
        proxy.close()
        cache.wait_idle()
        assert not cache.host_alloc.parked
        cache.check_integrity(idle=True)
        cache.close()
    finally:
        proxy.close()
        server.stop()


# ---- 11. a killed or misbehaving pipe worker ---------------------------------------------------------
def test_a_killed_worker_fails_and_counts_its_plans_and_the_cache_refuses_further_work():
    import os
    import signal
    import time

    from kvtier.errors import ExecutorError

    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=16, host_pages=16, write_policy="write_through", mode="two processes")
    serve(cache, tokens(0, 16))
    serve(cache, tokens(100, 16))  # write-through backups in flight, as far as the core knows
    in_flight = len(cache._inflight)
    assert in_flight >= 1
    os.kill(cache.port.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="plans in flight failed"):
        cache.begin(tokens(0, 16))
    assert time.monotonic() - t0 < 10  # noticed, not waited for
    assert cache.stats.lost_plans == in_flight and not cache._inflight
    cache.check_integrity(idle=True)  # every lock and page the lost plans held was released
    with pytest.raises(ExecutorError):  # and it stays refused
        cache.match(tokens(0, 16))
    cache.close()


def _send_extra_message(executor):
    """A worker that breaks the protocol: a message nobody asked for, sent beside its answer."""
    import gc
    from multiprocessing.connection import Connection

    conn = next(o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed)
    conn.send(("stray", "message"))
    return "done"


def test_an_extra_message_from_the_worker_is_a_typed_error_never_an_answer_off_by_one():
    from kvtier.errors import ExecutorError
    from kvtier.executors.pipe import PipeExecutor, WorkerSpec

    port = PipeExecutor(WorkerSpec(tiny_specs(page_size=4, num_layers=1)["mla"], 4, 4))
    try:
        with pytest.raises(ExecutorError, match="out of protocol"):
            port.run(_send_extra_message)  # the stray message arrives first: never taken for run's answer
        for call in (port.poll, lambda: port.stored_prefix([b"k" * 16])):  # and nothing after it is read off by one
            with pytest.raises(ExecutorError, match="broken"):
                call()
        from kvtier.core.plans import Tier, copy_plan

        with pytest.raises(ExecutorError, match="broken"):
            port.submit(copy_plan(1, Tier.DEVICE, [0], Tier.HOST, [0]))
    finally:
        port.close()
