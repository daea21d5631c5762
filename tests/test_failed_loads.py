"""A failed host->device load never hands out wrong bytes: the request is told and shrinks, its pages
leave the tree (no later match offers them), a commit naming them is refused, and the pages come back
on host for the next request -- in one process and with the executor behind a pipe."""

from __future__ import annotations

import pytest

from kvtier.core.plans import Tier
from kvtier.errors import PageOwnershipError
from kvtier.radix import NO_PAGE
from support.cache_helpers import MODES, device_bytes, expected_page, fill_device, make_cache, on_worker, serve, tokens, write_pages
from support.pools import tiny_specs


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
