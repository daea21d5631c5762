"""L3 over real Redis servers (single node and a 3-node cluster) started on 127.0.0.1 by fixtures."""

import os
import subprocess
import sys
import textwrap

import pytest
import redis

from cache_helpers import make_tiered_cache, serve, serve_tiered
from kvtier.devservers import RedisServer, start_redis_cluster, wait_until
import l3_scenarios as sc

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    servers = start_redis_cluster(tmp_path_factory.mktemp("cluster"))
    yield servers
    for s in servers:
        s.stop()


def flip_redis_byte(backend, key, offset):
    value = bytearray(backend.client.get(key))
    value[offset] ^= 0xFF
    backend.client.set(key, bytes(value))


@pytest.mark.parametrize("spec_name", ["deepseek-v3.2", "llama-3.1-8b"])
def test_round_trip_bit_exact(redis_server, spec_name):
    sc.round_trip(redis_server.url, sc.real_specs()[spec_name])


def test_round_trip_cluster(redis_cluster):
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}?timeout=2"
    sc.round_trip(url, sc.real_specs()["deepseek-v3.2"])
    # pages really spread over the cluster's nodes
    counts = [redis.Redis(port=s.port).dbsize() for s in redis_cluster]
    assert sum(counts) >= 3 and sum(c > 0 for c in counts) >= 2, counts


def test_namespace_isolation(redis_server):
    sc.namespace_isolation(redis_server.url)


def test_corrupted_page_is_a_miss(redis_server):
    sc.corrupted_page_is_a_miss(redis_server.url, flip_redis_byte)


def test_wrong_header_is_a_miss(redis_server):
    sc.wrong_header_is_a_miss(redis_server.url, flip_redis_byte)


def test_server_killed_mid_run_then_restarted(redis_server):
    spec = sc.tiny()
    cache = make_tiered_cache(spec, 6, 16, redis_server.url, model="fault")
    before = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
    for toks in before:
        serve(cache, toks)
    cache.wait_idle()
    assert cache.stats.storage_saved_pages == 12
    # kill the server with backups queued and then prefetches attempted: every request is still served
    redis_server.kill()
    during = [list(range(i * 100, i * 100 + 16)) for i in range(3, 9)]
    for toks in during:
        serve(cache, toks)  # write_through saves fail in the background
    for toks in before:  # evicted by now and the store is down: misses -> recompute
        d, h, s, c = serve_tiered(cache, toks)
        assert s == 0
    cache.wait_idle()
    assert cache.stats.storage_failures > 0
    cache.check_integrity()  # no host page leaked, none owned twice
    # restart on the same port: the tier resumes (new saves, then hits)
    redis_server.start()
    wait_until(lambda: cache.storage.available, timeout=5, what="the circuit breaker's cooldown")
    fresh = list(range(5000, 5016))
    serve(cache, fresh)
    cache.wait_idle()
    cache.evict_device(6)
    cache.evict_host(16)
    d, h, s, c = serve_tiered(cache, fresh)
    assert (s, c) == (4, 0), (d, h, s, c)
    cache.wait_idle()
    cache.check_integrity()
    cache.close()


def test_two_processes_share_one_redis(redis_server):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from cache_helpers import make_tiered_cache, serve, serve_tiered
        import l3_scenarios as sc
        c = make_tiered_cache(sc.tiny(), 8, 8, {redis_server.url!r}, model="shared")
        toks = list(range(20))
        if sys.argv[1] == "first":
            s = serve(c, toks); c.wait_idle(); print(s.computed, c.stats.storage_saved_pages)
        else:
            print(*serve_tiered(c, toks))
        c.close()
        """
    )
    first = subprocess.run([sys.executable, "-c", script, "first"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stdout.split() == ["5", "5"], first.stderr
    second = subprocess.run([sys.executable, "-c", script, "second"], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split()[2:] == ["5", "0"]
