"""The core asks its executor port for finished copies once per entry, and not at all when nothing can have finished
(issue 57, item 2): a public call polls on entry, the calls it makes inside do not poll again, and with no plan in
flight (none held for a late answer, none deferred) the port is not asked -- for a pipe executor that is a round
trip to another process saved per call. ``python -m kvtier.app.bench.calls`` counts the Python calls a request costs."""

from __future__ import annotations

import pytest

from kvtier.app.bench.calls import host_hit, serve_request
from kvtier.build import build_cache
from kvtier.config import TierConfig
from kvtier.errors import ExecutorError
from kvtier.spec import KVSpec

SPEC = KVSpec.mha("polls", num_layers=2, kv_heads=1, head_dim=16, page_size=16, dtype="float32")
PAGES = 8


def _counted(cache) -> list[str]:
    """Record each poll and wait the core asks its port for (by name) from now on (not the port's own, inside them)."""
    calls: list[str] = []
    port = cache.port
    inside = []
    for name in ("poll", "wait"):
        real = getattr(port, name)

        def counted(*args, _real=real, _name=name):
            if not inside:
                calls.append(_name)
            inside.append(_name)
            try:
                return _real(*args)
            finally:
                inside.pop()

        setattr(port, name, counted)
    return calls


def _tokens() -> list[int]:
    return list(range(500, 500 + PAGES * SPEC.page_size + 1))


def _on_host_only():
    """A cache whose every page of :func:`_tokens` is on host and none on the device (a host hit waits)."""
    cache = build_cache(SPEC, TierConfig(device_pages=4 * PAGES, host_pages=4 * PAGES))
    serve_request(cache, _tokens(), SPEC.page_size)
    cache.wait_idle()
    cache.evict_device(4 * PAGES)
    return cache


def test_a_host_hit_polls_once_while_its_load_is_in_flight_and_never_when_nothing_is():
    cache = _on_host_only()
    try:
        calls = _counted(cache)
        n = len(_tokens())
        req = cache.begin(_tokens(), usable_pages=(n - 1) // SPEC.page_size)
        assert calls == [] and cache.plans_in_flight == 1  # (nothing was in flight at entry: its load is the one plan now)
        usable = req.usable((n - 1) // SPEC.page_size)
        new = req.alloc(-(-n // SPEC.page_size) - usable)
        assert calls == ["poll"]  # (the load in flight: one poll on entry, none inside)
        req.wait()
        assert calls == ["poll", "wait"] and cache.plans_in_flight == 0
        req.commit(req.cached_pages[:usable] + new.pages)
        assert calls == ["poll", "wait"]  # (nothing in flight at the commit's entry)
        assert req.served(usable)[1] == usable == PAGES
        cache.wait_idle()
    finally:
        cache.close()


def test_a_begin_with_a_backup_in_flight_polls_once_though_it_loads_and_allocates_inside():
    cache = _on_host_only()
    try:
        other = list(range(9000, 9000 + 2 * SPEC.page_size + 1))
        serve_request(cache, other, SPEC.page_size)  # (its write-through backup: a plan in flight at the next entry)
        assert cache.plans_in_flight >= 1
        calls = _counted(cache)
        cache.begin(_tokens(), usable_pages=PAGES).abort()
        assert calls.count("poll") == 1, calls  # (match, load_back and its allocation inside: one poll, at entry)
        cache.wait_idle()
    finally:
        cache.close()


def test_with_nothing_in_flight_a_closed_cache_still_refuses_every_call():
    cache = build_cache(SPEC, TierConfig(device_pages=4 * PAGES, host_pages=4 * PAGES))
    cache.close()
    with pytest.raises(Exception, match="closed"):
        cache.begin(_tokens())


def test_a_port_lost_with_nothing_in_flight_raises_at_the_next_call_that_submits():
    """Not asked while nothing is in flight, a port that died is found at the next plan: that call's plan fails as
    lost and the call after it raises, as a loss found by a poll does."""
    cache = build_cache(SPEC, TierConfig(device_pages=4 * PAGES, host_pages=4 * PAGES))
    try:
        serve_request(cache, _tokens(), SPEC.page_size)
        cache.wait_idle()

        def gone(*_args):
            raise ExecutorError("worker died")

        cache.port.submit = cache.port.poll = cache.port.wait = gone
        cache.evict_device(4 * PAGES)  # (write-through: its pages are on host already; nothing to copy)
        req = cache.begin(_tokens(), usable_pages=PAGES)  # its load is submitted to the dead port: recorded, not raised
        with pytest.raises(ExecutorError, match="worker died"):
            req.wait()
        assert cache.stats.lost_plans == 1
    finally:
        cache.port.close = lambda: None
        cache.close()


def test_the_call_counts_of_a_host_hit_a_hybrid_one_and_bench_caches_request_are_reported_per_file():
    """``python -m kvtier.app.bench.calls``: per scenario, kvtier's Python calls, file switches and calls into the
    executors, each counted only in kvtier's library (not in the application, not in this test)."""
    import json
    import subprocess
    import sys

    from support.service import ENV, ROOT

    r = subprocess.run([sys.executable, "-m", "kvtier.app.bench.calls"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    hit, book, hybrid = json.loads(r.stdout)
    for count in (hit, book, hybrid):
        assert count["calls"] == sum(count["per_file"].values()) and 0 < count["file_switches"] < count["calls"], count
        assert not any(f.startswith("app/") for f in count["per_file"]), count
    assert hit["port_polls"] > 0 and "radix.py" in hit["per_file"]  # (a load went through the local executor)
    assert hybrid["calls"] > hit["calls"] and "core/group_objects.py" in hybrid["per_file"]  # (its groups' objects: calls of their own)
    assert book["port_polls"] == 0  # (the bookkeeping core's plans: none in flight, so its port is never asked)
    assert host_hit(8).calls == hit["calls"]  # (a count, not a timing: the same in any process, at any request size)
