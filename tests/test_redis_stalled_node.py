"""One stalled Redis node under steady lookups (the hardening issue's item 8): real redis-server
processes on 127.0.0.1, one SIGSTOPped (the kernel still accepts, nothing answers) while a thread
runs the engine's steps -- an L3 lookup, then some compute -- for a bounded time.

Before, the breaker was one for the whole store and its probe asked a fixed key that a healthy
node served: the probe closed the breaker, the next lookup waited out the stalled node's 2 s
deadline, twice (its direct call, then redis-py's pipeline). Measured here: the lookup thread was
blocked 91% of the wall time with one cluster node stalled and 20% with a single server. Now the
breaker is per node, a lookup answers from the healthy nodes at once and waits at most the short
lookup deadline, once, on a node that stalls; the probe asks the stalled node, off that thread. A
single server that stalls under the same steady lookups costs one deadline per back-off, which doubles,
not one per lookup (the hardening issue's item 9)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from support.pools import fill_random, tiny_specs
from kvtier import HostPool
from kvtier.app.devservers import RedisServer, start_redis_cluster, wait_until
from kvtier.build import open_storage_tier
from kvtier.config import StorageConfig
from kvtier.hashing import Namespace, page_keys

pytestmark = pytest.mark.integration

PAGES = 16
#: each engine step is one L3 lookup, then STEP_S of compute (the issue's steady load: about 100 lookups a second)
STEP_S = 0.01
STALLED_S = 10.0
#: the URL's deadline, the default: what a call on another thread may wait on a stalled node
URL_OPTIONS = "timeout=2"


def _tier_with_pages(url: str):
    """A storage tier over ``url`` holding PAGES chained pages (host pages 0..PAGES-1), and their keys."""
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    host = HostPool(spec, 2 * PAGES, "page_first")
    fill_random(host, seed=8)
    ns = Namespace("stalled-node", spec.fingerprint())
    tier = open_storage_tier(StorageConfig(url=url, max_cooldown_s=2.0), host, ns)
    keys = page_keys(list(range(PAGES * 4)), 4, ns.root())
    job = tier.submit("save", keys, list(range(PAGES)))
    assert job.wait(10) and job.statuses == ["ok"] * PAGES
    assert tier.stored_prefix(keys) == PAGES
    return tier, keys


def _timed(fn, *args) -> tuple[float, object]:
    s = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - s, out


def _steps_while_stalled(tier, keys, healthy: int) -> list[int]:
    """STALLED_S of engine steps with a node stalled whose first key is ``keys[healthy]``; what the
    lookups answered.

    The stalled node blocks the lookup thread at most 10% of the wall time. Its share of a lookup
    is the lookup's time less that of a lookup of ``keys[:healthy]`` made right after it: the round
    trips to the nodes that answer, paid with or without a stall, at about the same moment and under
    the same load (on this 2-core machine under load they alone swing between 3% and 20% of the steps;
    a single server's lookups ask no node while it is down). At most one lookup waited on the
    stalled node: the one that found it stalled, for the lookup deadline."""
    took: list[float] = []
    healthy_part: list[float] = []
    answers: list[int] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < STALLED_S + sum(healthy_part):  # (the control lookups are no part of a step)
        first = len(took) % 2 == 0  # in turn first, so neither pays the wake-up after a step's sleep more often
        if not first:
            healthy_part.append(_timed(tier.stored_prefix, keys[:healthy])[0])
        seconds, answer = _timed(tier.stored_prefix, keys)
        took.append(seconds)
        answers.append(answer)
        if first:
            healthy_part.append(_timed(tier.stored_prefix, keys[:healthy])[0])
        time.sleep(STEP_S)
    wall = time.perf_counter() - t0 - sum(healthy_part)
    fraction = (sum(took) - sum(healthy_part)) / wall
    slowest = sorted(took)[-2:]
    print(f"the stalled node blocked the lookup thread {fraction:.1%} of {wall:.0f} s ({sum(took) / wall:.1%} in the lookups) "
          f"over {len(took)} lookups; the longest {slowest[-1] * 1e3:.0f} ms, the next {slowest[0] * 1e3:.1f} ms")
    assert fraction <= 0.10, f"the stalled node blocked the lookup thread {fraction:.0%} of the wall time"
    waited = [t for t in took if t >= 0.8 * tier.backend.lookup_timeout]
    assert len(waited) <= 1, f"{len(waited)} lookups waited on the stalled node ({[round(t, 2) for t in waited]} s)"
    return answers


def _prefetch_during_stall(tier, keys, arrive: int) -> None:
    """A prefetch of every page gives up on the stalled node's first page at once (a result, never a
    wait for its deadline); the pages before it arrive bit-exact."""
    t0 = time.perf_counter()
    job = tier.submit("prefetch", keys, list(range(PAGES, 2 * PAGES)))
    assert job.wait(1.0), "a prefetch waited on a node whose breaker is open"
    assert job.arrived == arrive and job.statuses[arrive] == "error" and time.perf_counter() - t0 < 1.0
    for p in range(arrive):
        assert tier.host.page_bytes(PAGES + p) == tier.host.page_bytes(p)


def test_one_stalled_cluster_node_blocks_the_lookup_thread_under_ten_percent_and_heals(tmp_path):
    servers = start_redis_cluster(tmp_path, require_full_coverage=False)  # the other nodes keep serving their slots
    tier = None
    try:
        tier, keys = _tier_with_pages(f"redis+cluster://127.0.0.1:{servers[0].port}?{URL_OPTIONS}")
        client = tier.backend.client
        node_of = [client.get_node_from_key(tier.key(k)).name for k in keys]
        first_on = {name: node_of.index(name) for name in set(node_of)}
        victim = max(first_on, key=first_on.get)  # the node whose first key comes last: the longest healthy prefix
        healthy = first_on[victim]
        assert healthy >= 1 and len(first_on) == 3
        stalled = next(s for s in servers if f"127.0.0.1:{s.port}" == victim)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            answers = _steps_while_stalled(tier, keys, healthy)
            # keys on the healthy nodes still hit; the prefix stops at the stalled node's first key, never past it
            assert max(answers) == healthy and answers.count(healthy) >= 0.95 * len(answers)
            nodes = tier.breaker.nodes
            assert nodes[victim].opened == 1 and not nodes[victim].closed  # opened once; its probes never closed it
            assert nodes[victim].probes >= 2  # asked the stalled node, off the lookup thread, with a growing back-off
            assert all(b.opened == 0 for name, b in nodes.items() if name != victim)
            _prefetch_during_stall(tier, keys, healthy)
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        wait_until(lambda: tier.stored_prefix(keys) == PAGES, timeout=20, what="the stalled node's keys hitting again")
        assert tier.breaker.nodes[victim].closed
    finally:
        if tier is not None:
            tier.close()
        for s in servers:
            s.stop()


def test_a_stalled_single_server_blocks_the_lookup_thread_under_ten_percent_and_heals(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    tier = None
    try:
        tier, keys = _tier_with_pages(f"redis://127.0.0.1:{server.port}/0?{URL_OPTIONS}")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            answers = _steps_while_stalled(tier, keys, 0)
            assert set(answers) == {0}  # a stalled store is a miss, never a wrong answer
            (node,) = tier.breaker.nodes.values()  # a single server is one node
            assert node.opened == 1 and not node.closed and node.probes >= 2
            _prefetch_during_stall(tier, keys, 0)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        wait_until(lambda: tier.stored_prefix(keys) == PAGES, timeout=20, what="hits again once the server continues")
        assert node.closed
    finally:
        if tier is not None:
            tier.close()
        server.stop()


def test_a_slot_the_cluster_moves_off_a_stalled_node_is_followed_while_the_node_stays_down(tmp_path):
    """What a failover does: the cluster gives a stalled node's slot to another node. The node's
    failed probe re-reads redis-py's slot map, so the slot's keys go to the new owner -- saved there
    and found by lookups -- while the stalled node's breaker stays open. (Before, the failed call
    retried through redis-py's pipeline, which followed the move, at a deadline per call.)"""
    import redis

    servers = start_redis_cluster(tmp_path, require_full_coverage=False)
    tier = None
    try:
        tier, keys = _tier_with_pages(f"redis+cluster://127.0.0.1:{servers[0].port}?{URL_OPTIONS}")
        client = tier.backend.client
        node_of = [client.get_node_from_key(tier.key(k)).name for k in keys]
        victim = max(set(node_of), key=node_of.index)
        healthy = node_of.index(victim)
        slot = client.keyslot(tier.key(keys[healthy]))
        stalled = next(s for s in servers if f"127.0.0.1:{s.port}" == victim)
        owner = next(s for s in servers if s is not stalled)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            assert tier.stored_prefix(keys) == healthy and not tier.breaker.nodes[victim].closed
            owner_id = redis.Redis(port=owner.port).execute_command("CLUSTER", "MYID")
            for s in servers:
                if s is not stalled:
                    redis.Redis(port=s.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner_id)
            redis.Redis(port=owner.port).execute_command("CLUSTER", "BUMPEPOCH")
            moved_key, new_owner = tier.key(keys[healthy]), f"127.0.0.1:{owner.port}"

            def followed() -> bool:  # (lookups that meet the stalled node start its probes, as an engine's do)
                return tier.stored_prefix(keys) == healthy and tier.backend.node_of(moved_key) == new_owner

            wait_until(followed, timeout=20, what="the slot map naming the slot's new owner")
            job = tier.submit("save", keys, list(range(PAGES)))
            assert job.wait(5) and job.statuses[healthy] == "ok"
            assert tier.stored_prefix(keys) > healthy
            assert not tier.breaker.nodes[victim].closed
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
    finally:
        if tier is not None:
            tier.close()
        for s in servers:
            s.stop()


def test_the_lookup_deadline_is_a_url_option_no_longer_than_the_calls(tmp_path):
    from kvtier.errors import StorageError
    from kvtier.l3 import open_backend

    server = RedisServer(tmp_path / "redis").start()
    try:
        for query, want in (("timeout=2", 0.25), ("timeout=0.1", 0.1), ("timeout=2&lookup_timeout=0.5", 0.5)):
            backend = open_backend(f"redis://127.0.0.1:{server.port}/0?{query}")
            assert backend.lookup_timeout == want, query
            backend.close()
        with pytest.raises(StorageError, match=r"lookup_timeout='soon' must be a number >= 0.001"):
            open_backend(f"redis://127.0.0.1:{server.port}/0?lookup_timeout=soon")
    finally:
        server.stop()


# ---- a single server stalled: one deadline per back-off, not one per lookup ----------------------
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
