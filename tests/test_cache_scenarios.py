"""Scenario tests with real tensors: each step narrated, exact counts asserted, integrity checked after each.

Each runs twice (``mode``): the core and its executor in this process, and the core here with the
executor in a spawned process (plans and completions pickled across a pipe); bytes are read back
where they are and compared bit-exact."""

import pytest

from kvtier import PageAlignmentError
from kvtier.errors import InvalidStateError
from support.pools import tiny_specs
from support.cache_helpers import MODES, device_bytes, expected_page, fill_device, indexer_nonzero, make_cache, serve


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("kind", ["mla", "dsa"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mode", MODES)
def test_prefill_evict_to_host_match_load_bit_exact(kind, layout, mode):
    spec = tiny_specs(page_size=4, num_layers=3)[kind]
    cache = make_cache(spec, dev_pages=8, host_pages=16, layout=layout, write_policy="write_back", mode=mode)
    req = tokens(100, 18)  # 4 full pages + a 2-token tail
    # 1. prefill: nothing cached, 4 pages computed and inserted, the tail page freed
    s = serve(cache, req)
    assert (s.device_hit, s.host_hit, s.computed) == (0, 0, 4)
    cache.check_integrity()
    originals = device_bytes(cache, s.pages)
    # 2. memory pressure: evict all 4 device pages; write_back backs them up first
    r = cache.evict_device(4)
    assert (r.evicted, r.backed_up, r.dropped) == (4, 4, 0)
    assert cache.dev_alloc.num_free == 8 and cache.host_alloc.num_used == 4
    cache.check_integrity()
    # scribble over the whole device pool: restored bytes must come from host
    fill_device(cache, 0xAB)
    # 3. the same request again: 4 host hits, loaded per layer, bytes identical (latent AND indexer)
    m = cache.match(req)
    assert (m.num_device_pages, m.num_host_pages) == (0, 4)
    cache.lock(m.last_node)
    ld = cache.load_back(m)
    for layer in range(spec.num_layers):
        ld.wait_layer(layer)
    assert ld.loaded == 4 and device_bytes(cache, ld.device_pages) == originals == [expected_page(spec, req, i) for i in range(4)]
    if kind == "dsa":  # the indexer's own buffer came back (not left zero behind equal latent bytes)
        assert indexer_nonzero(cache, ld.device_pages)
    cache.unlock(m.last_node)
    cache.wait_idle()
    cache.check_integrity()
    assert cache.stats.host_hit_pages == 4 and cache.stats.loaded_pages == 4
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_shared_prefix_device_hit_and_duplicate_insert(mode):
    spec = tiny_specs(page_size=4, num_layers=2)["mha"]
    cache = make_cache(spec, dev_pages=12, host_pages=12, mode=mode)
    system = tokens(0, 8)
    a = serve(cache, system + tokens(1000, 8))
    b = serve(cache, system + tokens(2000, 8))
    # the second request reuses the 2 system pages from device, computes its own 2
    assert (b.device_hit, b.host_hit, b.computed) == (2, 0, 2)
    assert b.pages[:2] == a.pages[:2] and b.pages[2:] != a.pages[2:]
    # inserting already-cached keys with other pages frees the caller's copies
    extra = cache.alloc_device(2).pages
    res = cache.insert(system, extra)
    assert res.freed == extra and res.device_pages == a.pages[:2] and res.new_pages == 0
    cache.wait_idle()
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_partial_tail_never_inserted_and_insert_count_checked(mode):
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=8, host_pages=8, mode=mode)
    s = serve(cache, tokens(0, 7))  # one full page + 3 tail tokens
    assert s.computed == 1 and len(cache.tree) == 1
    assert cache.match(tokens(0, 7)).num_device_pages == 1
    with pytest.raises(PageAlignmentError, match="2 device pages for 1 full pages"):
        cache.insert(tokens(0, 7), [3, 4])
    cache.wait_idle()
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_locked_pages_are_never_evicted_and_oom_is_a_result(mode):
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=4, host_pages=4, write_policy="write_back", mode=mode)
    req = tokens(0, 16)
    serve(cache, req)
    m = cache.match(req)
    cache.lock(m.last_node)
    # every device page is in use by the locked request: eviction frees nothing, allocation says so
    assert cache.evict_device(4).evicted == 0
    got = cache.alloc_device(1)
    assert not got.ok and got.shortfall == 1
    assert device_bytes(cache, m.device_pages) == [expected_page(spec, req, i) for i in range(4)]
    cache.unlock(m.last_node)
    # unlocked: the LRU leaf (the last page) is backed up and its device page handed out
    got = cache.alloc_device(1)
    assert got.ok and got.pages == [m.device_pages[-1]] and cache.stats.backed_up_pages == 1
    with pytest.raises(InvalidStateError, match="unlock of an unlocked node"):
        cache.unlock(m.last_node)
    cache.check_integrity(caller_device_pages=set(got.pages))
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_load_back_serves_what_fits(mode):
    spec = tiny_specs(page_size=4, num_layers=2)["dsa"]
    cache = make_cache(spec, dev_pages=6, host_pages=8, write_policy="write_back", mode=mode)
    req = tokens(0, 24)  # 6 pages
    serve(cache, req)
    cache.evict_device(6)
    hold = cache.alloc_device(3)  # the engine holds 3 pages for another request
    assert hold.ok
    m = cache.match(req)
    cache.lock(m.last_node)
    ld = cache.load_back(m)
    ld.wait()
    # only 3 pages fit: the first 3 are loaded, the rest stay on host, nothing half-assigned
    assert (ld.loaded, ld.requested) == (3, 6)
    assert device_bytes(cache, ld.device_pages) == [expected_page(spec, req, i) for i in range(3)]
    cache.unlock(m.last_node)
    cache.wait_idle()
    cache.check_integrity(caller_device_pages=set(hold.pages))
    assert cache.stats.load_shortfall_pages == 3
    m2 = cache.match(req)
    assert (m2.num_device_pages, m2.num_host_pages) == (3, 3)
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_host_eviction_frees_only_pages_without_device_copy(mode):
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=4, host_pages=4, write_policy="write_through", mode=mode)
    a, b = tokens(0, 8), tokens(500, 8)
    serve(cache, a)
    cache.wait_idle()
    cache.evict_device(2)  # a is host-only now
    serve(cache, b)  # write_through needs 2 host pages: host has 2 free
    cache.wait_idle()
    assert cache.host_alloc.num_free == 0
    c = tokens(900, 8)
    cache.evict_device(2)  # b host-only too
    serve(cache, c)  # needs host: evicts the LRU host-only leaves (a), never b's pages... b is newer
    cache.wait_idle()
    assert cache.match(a).num_pages == 2 and cache.match(a).num_host_pages == 0 and cache.match(a).num_device_pages == 0
    assert cache.match(b).num_host_pages == 2
    assert cache.stats.host_evicted_pages == 2
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_device_eviction_drop_policy_removes_unbacked_pages(mode):
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=4, host_pages=4, write_policy="write_back", on_device_evict="drop", mode=mode)
    serve(cache, tokens(0, 12))
    r = cache.evict_device(3)
    assert (r.evicted, r.dropped, r.backed_up) == (3, 3, 0) and len(cache.tree) == 0
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_locked_host_pages_are_never_evicted(mode):
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=4, host_pages=4, write_policy="write_back", mode=mode)
    req = tokens(0, 16)
    serve(cache, req)
    cache.evict_device(4)  # all 4 pages host-only now
    m = cache.match(req)
    assert m.num_host_pages == 4
    cache.lock(m.last_node)
    assert cache.evict_host(4).evicted == 0 and cache.host_alloc.num_used == 4
    cache.unlock(m.last_node)
    assert cache.evict_host(4).evicted == 4 and len(cache.tree) == 0
    cache.check_integrity()
    cache.close()
