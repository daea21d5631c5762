"""A server that answers slowly (a proxy in front of real Redis dripping its replies a byte at a time):
a call fails at its whole-call deadline, the engine's thread never blocks on it, close is bounded, and a
prefetch the cache gave up on releases its locks at once and has its late answer discarded."""

from __future__ import annotations

import time

import pytest

from kvtier.app.devservers import RedisServer
from kvtier.hashing import Namespace, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.base import KeyStatus
from kvtier.l3.page import PageCodec
from kvtier.l3.tier import StorageTier
from kvtier.pools import HostPool
from support import l3_scenarios as sc
from support.cache_helpers import serve, tokens, write_pages
from support.pools import tiny_specs
from support.proxies import DripProxy


@pytest.mark.integration
def test_slow_drip_server_fails_the_call_on_time_and_never_blocks_the_engine(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    proxy = DripProxy(server.port)
    try:
        spec = sc.tiny()
        host = HostPool(spec, 8, "page_first")
        backend = open_backend(f"redis://127.0.0.1:{proxy.port}/0?timeout=1")
        tier = StorageTier(backend, host, Namespace("drip", spec.fingerprint()), queue_depth=1, io_threads=1)
        keys = page_keys(list(range(32)), spec.page_size, tier.namespace.root())
        first = tier.submit("save", keys[:4], [0, 1, 2, 3])
        assert first.wait(10) and first.statuses == [KeyStatus.OK] * 4  # full speed: stored
        proxy.drip.set()
        # one GET reply of ~1 KB would take minutes at a byte per 0.5 s: the call fails after ~1 s
        out = [memoryview(bytearray(PageCodec.for_spec(spec).object_bytes))]
        t0 = time.monotonic()
        assert backend.get([tier.key(keys[0])], out) == [KeyStatus.ERROR]
        assert time.monotonic() - t0 < 3.0
        # the engine's thread: submissions return at once even with the worker stuck and the queue full
        t0 = time.monotonic()
        jobs = [tier.submit("prefetch", keys[:4], [4, 5, 6, 7]) for _ in range(4)] + [
            tier.submit("save", keys[4:8], [0, 1, 2, 3]) for _ in range(4)
        ]
        assert time.monotonic() - t0 < 0.5
        assert None in jobs and tier.skipped_prefetches + tier.skipped_saves > 0
        t0 = time.monotonic()
        tier.close(timeout_s=2.0)
        assert time.monotonic() - t0 < 6.0
        assert all(j.finished.is_set() for j in jobs if j is not None)
    finally:
        proxy.close()
        server.stop()


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
