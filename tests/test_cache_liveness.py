"""Liveness: when no request holds a lock and nothing is in flight, every cached page is evictable.

The bug this pins: with ``prefetch_policy="timeout"`` over a slow store, a request
computed the pages whose prefetch was still in flight, ``insert`` gave those nodes
device pages, and when the prefetch job ended its unarrived nodes were skipped --
they kept a host page that never became readable, so neither tier could ever evict
them and the device pool shrank until requests ran out of memory, while
``check_integrity()`` still passed. ``check_integrity(idle=True)`` now fails on that
state, and the prefetch's completion releases the dead host pages.
"""

from __future__ import annotations

import random
import threading

import pytest

from support.cache_helpers import make_tiered_cache, serve, serve_tiered
from support.l3_scenarios import tiny
from support.proxies import Injecting


def slow_cache(url: str, dev_pages: int, host_pages: int, release: threading.Event, **config):
    """A tiered cache whose store's reads wait for ``release`` (at most 10 s): prefetches outlive their budget."""
    cache = make_tiered_cache(
        tiny(),
        dev_pages,
        host_pages,
        url,
        model="live",
        storage_cfg={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.01, "prefetch_timeout_per_page_s": 0.0},
        **config,
    )
    tier = cache.storage
    injecting = Injecting(tier.backend, tier.codec.object_bytes)
    injecting.before_get = lambda _i: release.wait(10)
    tier.backend = tier.mover.backend = injecting  # the tier asks exists, its mover reads
    return cache


def fill_store(url: str, tokens: list[int]) -> None:
    filler = make_tiered_cache(tiny(), 16, 16, url, model="live")
    serve(filler, tokens)
    filler.wait_idle()
    filler.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_pages_computed_while_their_prefetch_was_in_flight_stay_evictable(tmp_path, policy):
    url = f"file://{tmp_path}"
    toks = list(range(6 * 4))  # a 6-page prompt in the store
    fill_store(url, toks)
    release = threading.Event()
    cache = slow_cache(url, dev_pages=8, host_pages=16, release=release, write_policy=policy)
    d, h, s, c = serve_tiered(cache, toks)  # the budget (10 ms) passes: nothing arrived, all 6 computed
    assert (s, c) == (0, 6), (d, h, s, c)
    release.set()  # the prefetch now finishes (late) or is cancelled
    cache.wait_idle()
    cache.check_integrity(idle=True)  # on the old code: "a host page is not readable"
    assert cache.evict_device(8).evicted == 6  # every device page can go (old code: 0)
    cache.wait_idle()
    cache.check_integrity(idle=True)
    assert cache.dev_alloc.num_used == 0
    cache.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_driver_nothing_locked_means_everything_evictable(tmp_path, seed):
    """Seeded random requests over shared prefixes, tiny pools, a store whose reads are sometimes slow
    (prefetches cut short by their budget) and random evictions; after each step, with nothing locked
    and nothing in flight, both tiers must be entirely evictable."""
    rng = random.Random(seed)
    url = f"file://{tmp_path}"
    prompts = [[1000 * p + i for i in range(4 * 6)] for p in range(3)]
    prompts += [prompts[0][:12] + [7000 + i for i in range(12)], prompts[1][:8] + [8000 + i for i in range(8)]]
    for p in prompts[:3]:
        fill_store(url, p)
    release = threading.Event()
    release.set()
    cache = slow_cache(url, dev_pages=8, host_pages=10, release=release, write_policy=rng.choice(["write_through", "write_back"]))
    for step in range(150):
        if rng.random() < 0.3:
            release.clear()  # this step's prefetch will outlive its budget
        action = rng.random()
        if action < 0.7:
            serve_tiered(cache, rng.choice(prompts)[: rng.randint(4, 24)])
        elif action < 0.85:
            cache.evict_device(rng.randint(1, 8))
        else:
            cache.evict_host(rng.randint(1, 10))
        release.set()
        cache.wait_idle()
        cache.check_integrity(idle=True)
    # the whole device and host can be emptied
    cache.evict_device(cache.dev_alloc.num_used)
    cache.wait_idle()
    cache.evict_host(cache.host_alloc.num_used)
    cache.wait_idle()
    assert cache.dev_alloc.num_used == 0 and cache.host_alloc.num_used == 0, (cache.dev_alloc.num_used, cache.host_alloc.num_used)
    cache.check_integrity(idle=True)
    cache.close()


@pytest.mark.parametrize("on_device_evict", ["drop", "backup"])
def test_device_page_with_prefetched_host_pages_below_it_is_evictable(tmp_path, on_device_evict):
    """Found by the core's state machine: a prefetch hangs host-only pages under a device page that
    has no host copy (write_back never made one). Under ``drop`` -- or when its backup copy fails --
    that device page could not be dropped (it has children) nor freed (no host copy): it stayed
    forever. Now it leaves together with the host pages that hang from it. (``backup``: the host
    pages below it are evicted to make room for its copy; the same end state.)"""
    url = f"file://{tmp_path}"
    toks = list(range(4 * 4))
    fill_store(url, toks)
    # host of 2 pages: both hold the prefetched pages
    cache = make_tiered_cache(tiny(), 8, 2, url, model="live", write_policy="write_back", on_device_evict=on_device_evict)
    serve(cache, toks[:8])  # pages 0-1 computed: on device, no host copy (write_back)
    d, h, s, c = serve_tiered(cache, toks, policy="wait_complete")  # pages 2-3 from the store, loaded back
    assert (d, s, c) == (2, 2, 0), (d, h, s, c)
    cache.wait_idle()
    assert cache.evict_device(2).evicted == 2  # pages 2-3 leave the device (their host copies stay)
    m = cache.match(toks)
    assert (m.num_device_pages, m.num_host_pages) == (2, 2)
    cache.wait_idle()
    cache.check_integrity(idle=True)
    cache.evict_device(8)
    assert cache.dev_alloc.num_used == 0  # old code: 2 device pages stuck
    cache.wait_idle()
    cache.evict_host(2)
    assert cache.host_alloc.num_used == 0 and len(cache.tree) == 0
    cache.check_integrity(idle=True)
    cache.close()
