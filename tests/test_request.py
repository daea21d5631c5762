"""The request protocol (``cache.begin`` -> ``alloc`` -> ``commit`` / ``abort``) and misuse of it or of
``insert``, or of a closed cache: each misuse is a typed error that leaves the index, the allocators and the locks as
they were."""

import pytest

from support.cache_helpers import expected_page, make_cache, make_tiered_cache, serve, tokens, write_page
from support.pools import tiny_specs
from kvtier.errors import IndexTypeError, InvalidStateError, PageIndexError, PageOwnershipError
from support.l3_scenarios import tiny

PS = 4
TOKS = list(range(3 * PS + 2))  # 3 full pages + a 2-token tail


def fresh():
    return make_cache(tiny_specs(page_size=PS, num_layers=2)["dsa"], dev_pages=12, host_pages=12)


def snapshot(cache):
    return (sorted((n.key, n.device_page, n.host_page, n.lock_ref) for n in cache.tree.nodes.values()),
            cache.dev_alloc.allocated_pages(), cache.host_alloc.allocated_pages())


def test_begin_commit_round_trip_and_second_request_hits():
    cache = fresh()
    req = cache.begin(TOKS)
    assert (req.num_cached, req.device_hit, req.host_hit, req.storage_hit) == (0, 0, 0, 0)
    pages = req.alloc(4).pages
    for i, p in enumerate(pages[:3]):
        write_page(cache.device, p, TOKS, i)
    ins = req.commit(pages)
    assert ins.new_pages == 3 and cache.dev_alloc.num_used == 3  # the tail page went back
    cache.wait_idle()
    cache.check_integrity(idle=True)
    again = cache.begin(TOKS)
    assert again.device_hit == 3 and again.cached_pages == pages[:3]
    assert [cache.device.page_bytes(p) for p in again.cached_pages] == [expected_page(cache.device, TOKS, i) for i in range(3)]
    again.commit(again.cached_pages + again.alloc(1).pages)
    assert cache.stats.requests == 2  # each request counted once
    cache.wait_idle()
    cache.check_integrity(idle=True)


def test_a_request_with_an_l3_prefetch_is_counted_once(tmp_path):
    url = f"file://{tmp_path}"
    a = make_tiered_cache(tiny(), 8, 8, url, model="once")
    serve(a, list(range(16)))
    a.wait_idle()
    a.close()
    b = make_tiered_cache(tiny(), 8, 8, url, model="once")
    s = serve(b, list(range(16)), prefetch=True)
    assert (s.storage_hit, s.computed) == (4, 0)
    assert b.stats.requests == 1 and b.stats.lookup_pages == 4 and b.stats.storage_hit_pages == 4
    b.close()


@pytest.mark.parametrize("bad, err", [
    (lambda own, cached: own[:2] + [99], PageIndexError),  # out of range
    (lambda own, cached: own[:2] + [-1], PageIndexError),
    (lambda own, cached: [own[0], own[0], own[1]], PageOwnershipError),  # a page twice
    (lambda own, cached: own[:2] + [11], PageOwnershipError),  # a page nobody allocated
    (lambda own, cached: [0.0, 1.0, 2.0], IndexTypeError),
])
def test_commit_misuse_changes_nothing(bad, err):
    cache = fresh()
    req = cache.begin(TOKS)
    own = req.alloc(3).pages
    before = snapshot(cache)
    with pytest.raises(err):
        req.commit(bad(own, req.cached_pages))
    assert snapshot(cache) == before
    req.commit(own)  # still open: the correct commit works
    cache.wait_idle()
    cache.check_integrity(idle=True)


def test_commit_of_cached_pages_in_swapped_order_is_refused():
    cache = fresh()
    serve(cache, TOKS)
    req = cache.begin(TOKS)
    assert req.device_hit == 3
    swapped = [req.cached_pages[1], req.cached_pages[0], req.cached_pages[2]]
    before = snapshot(cache)
    with pytest.raises(PageOwnershipError, match="not this request's"):
        req.commit(swapped)
    assert snapshot(cache) == before
    req.abort()
    cache.wait_idle()
    cache.check_integrity(idle=True)


def test_commit_or_abort_twice_is_an_invalid_state():
    cache = fresh()
    req = cache.begin(TOKS)
    req.commit(req.alloc(4).pages)
    before = snapshot(cache)
    for again in (lambda: req.commit([]), req.abort, lambda: req.alloc(1)):
        with pytest.raises(InvalidStateError, match="already committed"):
            again()
    assert snapshot(cache) == before
    other = cache.begin(TOKS)
    got = other.alloc(2).pages
    other.abort()  # frees what it allocated, releases its lock
    assert not any(cache.dev_alloc.is_allocated(p) for p in got)
    with pytest.raises(InvalidStateError, match="already aborted"):
        other.abort()
    cache.wait_idle()
    cache.check_integrity(idle=True)


@pytest.mark.parametrize("case", ["page-99", "page-minus-1", "duplicate", "never-allocated", "swapped", "float"])
def test_insert_misuse_is_typed_and_frees_nothing(case):
    """The cache's own ``insert`` refuses the same misuse (before, the swap freed pages the tree still mapped)."""
    cache = fresh()
    served = serve(cache, TOKS[: 3 * PS])
    cached = served.pages
    own = cache.alloc_device(3).pages
    bad = {"page-99": own[:2] + [99], "page-minus-1": own[:2] + [-1], "duplicate": [own[0], own[0], own[1]],
           "never-allocated": own[:2] + [11], "swapped": [cached[1], cached[0], cached[2]], "float": [0.5, 1.5, 2.5]}[case]
    before = snapshot(cache)
    with pytest.raises((PageIndexError, PageOwnershipError, IndexTypeError)):
        cache.insert(TOKS[: 3 * PS], bad)
    assert snapshot(cache) == before
    cache.free_device(own)
    cache.wait_idle()
    cache.check_integrity(idle=True)


def test_unlock_of_an_unlocked_node_is_an_invalid_state():
    cache = fresh()
    serve(cache, TOKS)
    cache.wait_idle()  # the write_through backup's lock is released
    m = cache.match(TOKS)
    with pytest.raises(InvalidStateError):
        cache.unlock(m.last_node)
    cache.check_integrity(idle=True)


# ---- a closed cache, and arguments that are not what the request API takes -----------------------
def test_begin_on_a_closed_cache_is_a_typed_error():
    spec = tiny_specs(page_size=4, num_layers=1)["mla"]
    cache = make_cache(spec, dev_pages=4, host_pages=4)
    cache.close()
    cache.close()  # twice: a no-op
    for call in (lambda: cache.begin(tokens(0, 8)), lambda: cache.match(tokens(0, 8)), lambda: cache.alloc_device(1),
                 lambda: cache.insert(tokens(0, 4), [1])):
        with pytest.raises(InvalidStateError, match="closed"):
            call()


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
