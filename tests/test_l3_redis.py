"""L3 over real Redis servers (single node and a 3-node cluster) started on 127.0.0.1 by fixtures."""

import os
import subprocess
import sys
import textwrap

import pytest
import redis

from support.cache_helpers import make_tiered_cache, serve, serve_tiered
from kvtier.app.devservers import RedisServer, start_redis_cluster, wait_until
from support import l3_scenarios as sc

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
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])  # scattered from host pages, and whole objects from staging
def test_round_trip_bit_exact(redis_server, spec_name, layout):
    sc.round_trip(redis_server.url, sc.real_specs()[spec_name], layout)


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
        from support.cache_helpers import make_tiered_cache, serve, serve_tiered
        from support import l3_scenarios as sc
        c = make_tiered_cache(sc.tiny(), 8, 8, {redis_server.url!r}, model="two-processes")
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


def test_direct_get_statuses_and_stream_stays_in_step(redis_server):
    """One pipelined batch mixing a hit, a miss, a wrong-size value and a wrong type: each gets its
    status, and every value after them still lands bit-exact (the reply stream never drifts)."""
    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus

    b = open_backend(redis_server.url)
    size = 200_000  # several socket reads per value
    good = [os.urandom(size) for _ in range(2)]
    b.client.set("k/good0", good[0])
    b.client.set("k/short", b"x" * 100)
    b.client.rpush("k/list", "a")
    b.client.set("k/good1", good[1])
    keys = ["k/good0", "k/missing", "k/short", "k/list", "k/good1"]
    outs = [[memoryview(bytearray(72)), memoryview(bytearray(size - 72))] for _ in keys]
    assert b.get_scattered(keys, outs) == [KeyStatus.OK, KeyStatus.MISS, KeyStatus.WRONG_SIZE, KeyStatus.ERROR, KeyStatus.OK]
    for i, want in ((0, good[0]), (4, good[1])):
        assert bytes(outs[i][0]) + bytes(outs[i][1]) == want
    assert b.stats.get_hits == 2 and b.stats.errors == 0
    assert b.client.ping()  # the pooled connection is still in step for redis-py's own commands
    b.close()


def test_direct_get_after_server_restart_reconnects(redis_server):
    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus

    b = open_backend(redis_server.url)
    b.client.set("k/v", b"abc")
    out = [[memoryview(bytearray(3))]]
    assert b.get_scattered(["k/v"], out) == [KeyStatus.OK]
    redis_server.stop()
    assert b.get_scattered(["k/v"], out) == [KeyStatus.ERROR] and b.stats.errors == 1
    redis_server.start()
    b.client.set("k/v", b"xyz")
    assert b.get_scattered(["k/v"], out) == [KeyStatus.OK] and bytes(out[0][0]) == b"xyz"
    b.close()


def test_direct_set_error_reply_is_a_status_and_stream_stays_in_step(redis_server):
    """A server out of memory answers each SET with -OOM (the pipelined batch itself fills the query
    buffer): every key is ERROR, no exception, and the same pooled connection then stores again."""
    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus

    b = open_backend(redis_server.url)
    used = b.client.info("memory")["used_memory"]
    b.client.config_set("maxmemory-policy", "noeviction")
    b.client.config_set("maxmemory", used + 1_500_000)
    blob = os.urandom(1_000_000)
    parts = [[memoryview(blob[:72]), memoryview(blob[72:])] for _ in range(3)]
    assert b.set_scattered(["k/a", "k/b", "k/c"], parts) == [KeyStatus.ERROR] * 3
    assert b.client.exists("k/a", "k/b", "k/c") == 0 and b.stats.errors == 0
    b.client.config_set("maxmemory", 0)
    assert b.set_scattered(["k/d"], parts[:1]) == [KeyStatus.OK] and b.client.get("k/d") == blob
    b.close()


def _record_fallbacks(backend) -> list[tuple[str, list[str]]]:
    """Which keys a cluster backend sent through redis-py's pipeline instead of its direct path."""
    seen: list[tuple[str, list[str]]] = []
    for name in ("_get_via_client", "_set_via_client"):
        real = getattr(backend, name)

        def spy(keys, bufs, real=real, name=name):
            seen.append((name, list(keys)))
            return real(keys, bufs)

        setattr(backend, name, spy)
    return seen


def _cluster_backend(servers):
    from kvtier.l3 import open_backend

    return open_backend(f"redis+cluster://127.0.0.1:{servers[0].port}?timeout=2")


def test_cluster_reads_and_writes_go_direct_to_every_node(redis_cluster):
    """Keys grouped by owning node: each group is written from and read into the caller's buffers
    on that node's own connection, bit-exact, with nothing falling back to redis-py."""
    from kvtier.l3.base import KeyStatus

    b = _cluster_backend(redis_cluster)
    fallbacks = _record_fallbacks(b)
    keys = [f"direct/{i:032x}" for i in range(24)]
    blobs = [os.urandom(300_000) for _ in keys]
    assert b.set_scattered(keys, [[memoryview(v)[:72], memoryview(v)[72:]] for v in blobs]) == [KeyStatus.OK] * 24
    assert len({b.client.get_node_from_key(k).name for k in keys}) == 3  # the batch spans every node
    for k, v in zip(keys, blobs):  # each value on the node that owns its slot
        node = b.client.get_node_from_key(k)
        assert redis.Redis(port=node.port).get(k) == v
    outs = [[memoryview(bytearray(72)), memoryview(bytearray(300_000 - 72))] for _ in keys] + [[memoryview(bytearray(8))]]
    assert b.get_scattered([*keys, "direct/missing"], outs) == [KeyStatus.OK] * 24 + [KeyStatus.MISS]
    for o, v in zip(outs, blobs):
        assert bytes(o[0]) + bytes(o[1]) == v
    assert fallbacks == [] and b.stats.get_hits == 24 and b.stats.errors == 0
    b.delete(keys)
    b.close()


def test_cluster_key_whose_slot_moved_is_followed_then_read_direct_again(redis_cluster):
    """A slot migrated behind the client's back: the old owner answers MOVED, that key goes through
    redis-py (which follows it and refreshes its slot map), and the next calls go direct to the new owner."""
    from kvtier.l3.base import KeyStatus

    b = _cluster_backend(redis_cluster)
    key = "moved/" + "ab" * 16
    blob = os.urandom(100_000)
    assert b.set_scattered([key], [[memoryview(blob)]]) == [KeyStatus.OK]
    slot = b.client.keyslot(key)
    src = b.client.get_node_from_key(key)
    dst = next(s for s in redis_cluster if s.port != src.port)
    src_r, dst_r = redis.Redis(port=src.port), redis.Redis(port=dst.port)
    src_id, dst_id = src_r.execute_command("CLUSTER", "MYID"), dst_r.execute_command("CLUSTER", "MYID")
    dst_r.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src_r.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    for k in src_r.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
        src_r.execute_command("MIGRATE", "127.0.0.1", dst.port, k, 0, 5000)
    for s in redis_cluster:
        redis.Redis(port=s.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    fallbacks = _record_fallbacks(b)
    out = [[memoryview(bytearray(len(blob)))]]
    assert b.get_scattered([key], out) == [KeyStatus.OK] and bytes(out[0][0]) == blob
    assert fallbacks == [("_get_via_client", [key])]
    assert b.client.get_node_from_key(key).port == dst.port  # redis-py's map now names the new owner
    blob2 = os.urandom(100_000)
    assert b.set_scattered([key], [[memoryview(blob2)]]) == [KeyStatus.OK]
    assert b.get_scattered([key], out) == [KeyStatus.OK] and bytes(out[0][0]) == blob2
    assert dst_r.get(key) == blob2 and len(fallbacks) == 1  # both went direct
    b.delete([key])
    b.close()


def _fill_cluster(b, prefix: str, victim):
    """18 random 50 kB objects over the cluster; which of them the ``victim`` node holds (some, not all)."""
    from kvtier.l3.base import KeyStatus

    keys = [f"{prefix}/{i:032x}" for i in range(18)]
    blobs = [os.urandom(50_000) for _ in keys]
    assert b.set_scattered(keys, [[memoryview(v)] for v in blobs]) == [KeyStatus.OK] * 18
    on_victim = [b.client.get_node_from_key(k).port == victim.port for k in keys]
    assert 0 < sum(on_victim) < 18
    return keys, blobs, on_victim


def test_cluster_node_killed_fails_only_its_keys_then_resumes(tmp_path):
    """One node of a fresh cluster dies: its keys are errors (counted, against that node), the other
    nodes' keys still hit, bit-exact; once it is back, its keys hit again."""
    from kvtier.l3.base import KeyStatus

    servers = start_redis_cluster(tmp_path, require_full_coverage=False)  # the live nodes keep serving their slots
    try:
        b = _cluster_backend(servers)
        victim = servers[1]
        keys, blobs, on_victim = _fill_cluster(b, "kill", victim)
        redis.Redis(port=victim.port).save()  # its keys survive the restart (dump.rdb in its data dir)
        victim.kill()
        outs = [[memoryview(bytearray(50_000))] for _ in keys]
        got = b.get_scattered(keys, outs)
        assert got == [KeyStatus.ERROR if dead else KeyStatus.OK for dead in on_victim]
        assert all(bytes(o[0]) == v for o, v, dead in zip(outs, blobs, on_victim) if not dead)
        assert b.stats.errors >= 1 and set(b.stats.node_errors) == {f"127.0.0.1:{victim.port}"}  # the dead node's fault only
        victim.start()  # same port and data dir: it rejoins with its slots and keys
        wait_until(lambda: b.get_scattered(keys, outs) == [KeyStatus.OK] * 18, timeout=30, what="the restarted node serving again")
        assert all(bytes(o[0]) == v for o, v in zip(outs, blobs))
        b.close()
    finally:
        for s in servers:
            s.stop()


def test_cluster_node_that_stalls_costs_each_call_its_deadline_not_redis_pys_retries(tmp_path):
    """A node stops answering (SIGSTOP: the kernel still accepts, nothing replies). Its group's direct
    call ends at its deadline and its keys fail there (a retry through redis-py's pipeline would wait
    as long again), so a call takes one timeout, where redis-py alone retries the node for
    (retries + 1) x timeout. The fault is counted against that node only. The other nodes' keys hit
    bit-exact; a reply that arrives after the deadline is dropped (the caller's buffers are left as
    they were); once the node continues, its keys hit again."""
    import signal
    import time

    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus

    servers = start_redis_cluster(tmp_path, require_full_coverage=False)
    try:
        b = open_backend(f"redis+cluster://127.0.0.1:{servers[0].port}?timeout=1&retries=3")
        victim = servers[1]
        keys, blobs, on_victim = _fill_cluster(b, "stall", victim)
        outs = [[memoryview(bytearray(b"\xee" * 50_000))] for _ in keys]
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = b.get_scattered(keys, outs)
            took = time.monotonic() - t0
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)  # the abandoned pipeline now gets its replies, late
        assert got == [KeyStatus.ERROR if dead else KeyStatus.OK for dead in on_victim]
        assert took < 2 * 1, f"a call with one stalled node took {took:.2f} s"
        assert b.stats.node_errors == {f"127.0.0.1:{victim.port}": 1}
        time.sleep(1.0)
        for o, v, dead in zip(outs, blobs, on_victim):
            assert bytes(o[0]) == (b"\xee" * 50_000 if dead else v)  # late replies never reach the buffers
        assert b.get_scattered(keys, outs) == [KeyStatus.OK] * 18 and all(bytes(o[0]) == v for o, v in zip(outs, blobs))
        # the bound is what made the difference: redis-py's own pipeline holds on for its retries
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            pipe = b.client.pipeline()
            pipe.get(next(k for k, dead in zip(keys, on_victim) if dead))
            t0 = time.monotonic()
            with pytest.raises(redis.RedisError):
                pipe.execute()
            assert time.monotonic() - t0 > 2 * 1 + 1.5
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        b.close()
    finally:
        for s in servers:
            s.stop()


def test_io_threads_one_per_single_node_two_over_a_cluster(redis_server, redis_cluster):
    """One Redis node runs one command at a time: the tier uses one I/O thread there unless told otherwise."""
    from kvtier.build import open_storage_tier
    from kvtier.config import StorageConfig
    from kvtier.hashing import Namespace
    from kvtier.pools import HostPool

    spec = sc.tiny()
    host = HostPool(spec, 4, "page_first")
    ns = Namespace("threads", spec.fingerprint())
    cluster_url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}?timeout=2"
    for url, io_threads, want in ((redis_server.url, None, 1), (redis_server.url, 2, 2), (cluster_url, None, 2)):
        tier = open_storage_tier(StorageConfig(url=url, io_threads=io_threads), host, ns)
        assert tier.io_threads == want and tier._io._max_workers == want
        tier.close()
