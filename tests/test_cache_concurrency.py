"""Loads and backups in flight while other requests insert and evict: nothing visible through the API races.

The cache is single-threaded by contract; concurrency is the transfer worker
moving bytes while the owner thread keeps going. A bounded loop with fixed
seeds drives many interleavings; every served page's bytes are verified.
"""

import random

import pytest

from support.pools import tiny_specs
from support.cache_helpers import make_cache, serve


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inflight_transfers_with_interleaved_requests(seed):
    rng = random.Random(seed)
    spec = tiny_specs(page_size=4, num_layers=4)["dsa"]
    cache = make_cache(spec, dev_pages=24, host_pages=40, write_policy="write_through")
    sessions = [list(range(s * 1000, s * 1000 + 8)) for s in range(6)]  # shared system prompts
    inflight = []
    for step in range(150):
        op = rng.random()
        base = rng.choice(sessions)
        toks = base + [rng.randrange(10) for _ in range(rng.randrange(0, 12))]
        if op < 0.5:
            serve(cache, toks)  # verifies bytes of every page used
        elif op < 0.75:
            m = cache.match(toks)
            cache.lock(m.last_node)
            ld = cache.load_back(m)  # left in flight on purpose
            inflight.append((m, ld, toks))
        elif op < 0.9 and inflight:
            m, ld, toks = inflight.pop(rng.randrange(len(inflight)))
            ld.wait()
            from support.cache_helpers import expected_page

            for j, page in enumerate(ld.device_pages):
                assert cache.device.page_bytes(page) == expected_page(cache.device, toks, j)
            cache.unlock(m.last_node)
        else:
            cache.evict_device(rng.randrange(1, 8))
            cache.evict_host(rng.randrange(1, 8))
        if len(inflight) > 3:
            m, ld, toks = inflight.pop(0)
            ld.wait()
            cache.unlock(m.last_node)
    for m, ld, toks in inflight:
        ld.wait()
        cache.unlock(m.last_node)
    cache.wait_idle()
    cache.check_integrity()
    assert cache.stats.loaded_pages > 0 and cache.stats.backed_up_pages > 0 and cache.stats.device_hit_pages > 0
    cache.close()
