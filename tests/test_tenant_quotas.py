"""Tenants' quotas in the host tier (issue 56, item 4): a guaranteed share another tenant's flood cannot evict, a cap,
a lifetime, and per-tenant counts under a digest (kvtier.core.tenants). Every request's pages are checked bit-exact."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from kvtier import KVSpec
from kvtier.config import CacheConfig
from kvtier.core.tenants import TenantQuota
from kvtier.errors import ConfigError
from kvtier.metrics import TenantCollector
from support.cache_helpers import make_cache, make_tiered_cache, serve, tokens

SPEC = KVSpec.mha("quota-test", 2, kv_heads=2, head_dim=8, page_size=4)
PS = SPEC.page_size


def _prompt(i: int, pages: int) -> list[int]:
    return tokens(10_000 * (i + 1), pages * PS)


def _usage(cache, tenant_label: str | None = None) -> dict:
    rows = {u.tenant: u for u in cache.tenant_usage()}
    return rows if tenant_label is None else rows[tenant_label]


def _hit_ratio(served: list) -> float:
    hit = sum(s.device_hit + s.host_hit for s in served)
    return hit / sum(s.device_hit + s.host_hit + s.computed for s in served)


def _run_a(cache, *, flood: bool, rounds: int = 12) -> float:
    """Tenant A cycles through six 4-page prompts (24 pages: more than the device holds, less than its guarantee); B
    sends a new 8-page prompt between two of A's when ``flood``. Returns A's hit ratio over its rounds after the first."""
    a_served = []
    b = 0
    for r in range(rounds):
        for i in range(6):
            s = serve(cache, _prompt(i, 4), tenant="A")
            if r:
                a_served.append(s)
            if flood:
                serve(cache, _prompt(1000 + b, 8), tenant="B")
                b += 1
    cache.check_integrity()
    return _hit_ratio(a_served)


@pytest.mark.parametrize("mode", ["one process", "two processes"])
def test_a_flooding_tenant_leaves_another_its_guaranteed_share_and_its_hit_ratio(mode):
    # device 16 pages, host 64: A's 24 pages live on host; B floods 8 new pages a request
    alone = make_cache(SPEC, 16, 64, mode=mode, tenant_host_pages=32)
    try:
        ratio_alone = _run_a(alone, flood=False)
    finally:
        alone.close()
    guarded = make_cache(SPEC, 16, 64, mode=mode, tenant_host_pages=32)
    try:
        ratio_guarded = _run_a(guarded, flood=True)
        a = _usage(guarded, guarded.tenant_label("A"))
        assert a.host_pages >= 24 and a.evicted_pages == 0, a  # not one of A's host pages went to B's flood
    finally:
        guarded.close()
    unguarded = make_cache(SPEC, 16, 64, mode=mode)
    try:
        ratio_unguarded = _run_a(unguarded, flood=True)
    finally:
        unguarded.close()
    assert ratio_alone == 1.0
    assert abs(ratio_guarded - ratio_alone) <= 0.01, (ratio_guarded, ratio_alone)
    assert ratio_unguarded < ratio_alone - 0.2, "the flood must hurt A without a guarantee, or this test proves nothing"


def test_a_tenant_at_its_cap_replaces_its_own_pages_and_leaves_others_alone():
    cache = make_cache(SPEC, 8, 64, tenant_max_host_pages=12)
    try:
        serve(cache, _prompt(0, 4), tenant="A")
        a_label = cache.tenant_label("A")
        for i in range(10):
            serve(cache, _prompt(100 + i, 4), tenant="B")
            assert all(u.host_pages <= 12 for u in cache.tenant_usage())
        rows = _usage(cache)
        b = rows[cache.tenant_label("B")]
        assert b.host_pages == 12 and b.evicted_pages >= 24  # B's own pages made room for B
        assert rows[a_label].host_pages == 4 and rows[a_label].evicted_pages == 0
        cache.evict_device(cache.device.num_pages)
        again = serve(cache, _prompt(0, 4), tenant="A")  # A's prompt comes back from host, bit-exact
        assert again.host_hit == 4 and again.computed == 0
        cache.check_integrity()
    finally:
        cache.close()


def test_pages_beyond_a_cap_get_no_host_copy_when_the_tenants_own_pages_cannot_go():
    cache = make_cache(SPEC, 16, 64, tenant_max_host_pages=3)
    try:
        first = serve(cache, _prompt(0, 4), tenant="A")  # 4 pages, room for 3 host copies
        assert first.computed == 4
        cache.wait_idle()
        (a,) = [u for u in cache.tenant_usage() if u.lookup_pages]
        assert a.host_pages == 3 and a.capped_pages == 1
        cache.evict_device(cache.device.num_pages)
        again = serve(cache, _prompt(0, 4), tenant="A")  # the three pages with host copies come back; the fourth is recomputed
        assert (again.host_hit, again.computed) == (3, 1)
        cache.check_integrity()
    finally:
        cache.close()


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_tenants_host_pages_leave_after_its_ttl_and_are_not_written_back(tmp_path):
    cache = make_tiered_cache(SPEC, 8, 64, f"file://{tmp_path}", storage_cfg={"write_policy": "write_back"}, tenant_accounting=True)
    try:
        clock = _Clock()
        cache.tenants._clock = clock
        cache.set_tenant_quota("A", TenantQuota(ttl_s=10.0))
        serve(cache, _prompt(0, 4), tenant="A")
        serve(cache, _prompt(1, 4), tenant="B")  # B has no lifetime
        cache.wait_idle()
        cache.evict_device(cache.device.num_pages)
        clock.t += 5
        assert serve(cache, _prompt(0, 4), tenant="A").host_hit == 4  # within its TTL: a hit
        cache.evict_device(cache.device.num_pages)
        clock.t += 11
        serve(cache, _prompt(2, 2), tenant="B")  # a lookup: the sweep runs
        rows = [u for u in cache.tenant_usage() if u.ttl_s == 10.0]
        assert len(rows) == 1 and rows[0].host_pages == 0 and rows[0].expired_pages == 4
        later = serve(cache, _prompt(0, 4), prefetch=True, tenant="A")  # gone from host, and never saved to L3 (write_back)
        assert later.computed == 4 and later.storage_hit == 0
        b = serve(cache, _prompt(1, 4), prefetch=True, tenant="B")
        assert b.computed == 0
        cache.check_integrity()
    finally:
        cache.close()


def test_per_tenant_counts_are_labelled_by_a_digest_and_exported():
    cache = make_cache(SPEC, 16, 64, tenant_accounting=True)
    try:
        serve(cache, _prompt(0, 4), tenant="alice@example.com")
        serve(cache, _prompt(0, 4), tenant="alice@example.com")
        serve(cache, _prompt(0, 4), tenant="bob")
        cache.wait_idle()
        rows = [u for u in cache.tenant_usage() if u.lookup_pages]
        assert sorted((u.lookup_pages, u.hit_pages, u.host_pages) for u in rows) == [(4, 0, 4), (8, 4, 4)]
        assert all(len(u.tenant) == 16 and int(u.tenant, 16) >= 0 for u in rows)
        registry = CollectorRegistry()
        registry.register(TenantCollector(cache.tenant_usage))
        text = generate_latest(registry).decode()
        assert "alice" not in text and "bob" not in text
        for u in rows:
            assert f'kvtier_tenant_host_pages{{tenant="{u.tenant}"}} {float(u.host_pages)}' in text
            assert f'kvtier_tenant_hit_pages_total{{tenant="{u.tenant}"}} {float(u.hit_pages)}' in text
    finally:
        cache.close()


def test_shared_prefix_pages_are_the_shared_scopes_and_no_tenants():
    cache = make_cache(SPEC, 32, 64, tenant_max_host_pages=6)
    try:
        system = _prompt(7, 4)
        cache.share_prefix(system)
        serve(cache, system + _prompt(0, 2), tenant="A")
        serve(cache, system + _prompt(1, 2), tenant="B")
        cache.wait_idle()
        rows = _usage(cache)
        assert rows["shared"].host_pages == 4  # once, for both tenants, and within neither's cap
        assert sorted(u.host_pages for u in rows.values() if u.tenant not in ("shared", "namespace")) == [2, 2]
        cache.check_integrity()
    finally:
        cache.close()


def test_quota_errors_are_typed():
    with pytest.raises(ConfigError, match="guaranteed more than it may hold"):
        CacheConfig(tenant_host_pages=8, tenant_max_host_pages=4)
    with pytest.raises(ConfigError, match="tenant_ttl_s"):
        CacheConfig(tenant_ttl_s=0)
    with pytest.raises(ConfigError, match="max_host_pages"):
        TenantQuota(guaranteed_host_pages=2, max_host_pages=1)
    cache = make_cache(SPEC, 8, 16)
    try:
        with pytest.raises(ConfigError, match="does not account tenants"):
            cache.set_tenant_quota("A", TenantQuota(max_host_pages=4))
        assert cache.tenant_usage() == []
    finally:
        cache.close()
    cache = make_cache(SPEC, 8, 16, tenant_accounting=True)
    try:
        with pytest.raises(ConfigError, match="TenantQuota"):
            cache.set_tenant_quota("A", {"max_host_pages": 4})
        with pytest.raises(Exception, match="tenant"):
            cache.set_tenant_quota(object(), TenantQuota())
    finally:
        cache.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(1, 6), st.booleans()), min_size=5, max_size=40),
       st.integers(0, 24))
def test_no_tenants_writes_take_another_below_its_guarantee(ops, guarantee):
    """Random three-tenant traffic over a small device and host: after each request, every other tenant holds at least
    as many host pages as it held before, or its guarantee. Bytes are checked on every request."""
    cache = make_cache(SPEC, 8, 40, tenant_host_pages=min(guarantee, 13))
    try:
        held = lambda: {u.tenant: u.host_pages for u in cache.tenant_usage()}  # noqa: E731
        for tenant, prompt, pages, push in ops:
            cache.wait_idle()
            before = held()
            serve(cache, _prompt(prompt, pages), tenant=f"t{tenant}")
            cache.wait_idle()
            after = held()
            writer = cache.tenant_label(f"t{tenant}")
            for label, n in before.items():
                if label != writer:
                    assert after[label] >= min(n, min(guarantee, 13)), (label, n, after[label])
            if push:
                cache.evict_device(cache.device.num_pages)
        cache.check_integrity()
    finally:
        cache.close()


def test_vllms_connector_keeps_each_cache_salt_within_its_quota():
    """vLLM's connector (scheduler and a worker, driven as vLLM drives them): a request's ``cache_salt`` is its tenant in
    the ledger. Salt "b" sends five new prompts into a host tier with room for all of them; at its cap of 4 pages, its
    copies out replace its own pages, salt "a"'s three pages stay, and "a"'s prompt is offered whole again."""
    from support.vllm_split import BS, TOKENS, Engine, finish, request

    eng = Engine(None, ranks=1, host_pages=32, tenant_max_host_pages=4)
    core = eng.scheduler.core

    def run(rid: str, toks: list[int], salt: str) -> int:
        req = request(rid, toks)
        req.cache_salt = salt
        external, _ = eng.scheduler.get_num_new_matched_tokens(req, 0)
        eng.scheduler.update_state_after_alloc(req, external)
        eng.step(new=[(req, [0, 1, 2, 3], len(toks) - external)])
        finish(eng, req)
        eng.settle()
        return external

    try:
        assert run("a0", TOKENS, "a") == 0
        for i in range(5):
            run(f"b{i}", [t + 1000 * (i + 1) for t in TOKENS], "b")
            assert all(u.host_pages <= 4 for u in core.tenant_usage())
        a, b = (_usage(core, core.tenant_label(salt)) for salt in ("a", "b"))
        assert (a.host_pages, a.evicted_pages) == (3, 0)
        assert b.host_pages == 4 and b.evicted_pages + b.capped_pages == 5 * 3 - 4
        assert run("a1", TOKENS, "a") == (len(TOKENS) - 1) // BS * BS  # offered whole from host
        core.check_integrity()
    finally:
        eng.close()


def test_vllms_connector_shares_a_declared_system_prompt_across_cache_salts_and_nothing_after_it():
    """``shared_prefixes`` in vLLM's kv_connector_extra_config: salt "b"'s request that starts with the system prompt salt
    "a" computed is offered the system prompt's pages from kvtier's host tier -- the bytes "a"'s blocks held -- and
    not "a"'s turn after it; a salt's own prompt without the system prompt is offered nothing of another's."""
    from support.vllm_split import BS, Engine, finish, request

    system = list(range(500, 500 + 2 * BS))  # two blocks
    turn_a, turn_b = list(range(600, 600 + BS + 2)), list(range(700, 700 + BS + 2))
    eng = Engine(None, ranks=2, host_pages=32, shared_prefixes=[system], tenant_accounting=True)
    core = eng.scheduler.core

    def run(rid: str, toks: list[int], salt: str, blocks: list[int]) -> int:
        req = request(rid, toks)
        req.cache_salt = salt
        external, _ = eng.scheduler.get_num_new_matched_tokens(req, 0)
        eng.scheduler.update_state_after_alloc(req, external)
        eng.step(new=[(req, blocks, len(toks) - external)])
        req.num_computed_tokens = len(toks)
        finish(eng, req)
        eng.settle()
        return external

    try:
        assert run("a", system + turn_a, "a", [0, 1, 2, 3]) == 0
        assert run("b", system + turn_b, "b", [4, 5, 6, 7]) == 2 * BS  # the system prompt, loaded into b's blocks 4 and 5
        assert [[eng.page(r, blk) for blk in (4, 5)] for r in range(2)] == [[eng.page(r, blk) for blk in (0, 1)] for r in range(2)]
        assert run("b2", system + turn_a, "b", [8, 9, 10, 11]) == 2 * BS  # a's turn after it stays a's
        assert run("c", turn_a + system, "c", [12, 13, 14, 15]) == 0  # starting elsewhere: nothing shared
        shared = _usage(core, "shared")
        assert shared.host_pages == 2  # the system prompt's pages, once, the shared scope's
    finally:
        eng.close()

    with pytest.raises(ConfigError, match="shared_prefixes must be a list of token-id lists"):
        Engine(None, ranks=1, shared_prefixes=["You are a helpful assistant"])


# ---- what a review found (each failed before its fix) ------------------------------------------------------------------
def _row(cache, tenant):
    return _usage(cache, cache.tenant_label(tenant))


def test_a_device_eviction_backup_keeps_the_pages_owner_within_its_cap_and_copies_the_pages_nearest_the_root():
    """B's request evicts A's device-only pages (write_back): their host copies count against A's cap of 4, not B's, and
    the four copies made are of A's first four pages (a copy of a page whose parent gets none would be dropped with it);
    A's prompt then comes back: four pages from host, bit-exact, four recomputed."""
    cache = make_cache(SPEC, 8, 64, write_policy="write_back", tenant_accounting=True)
    try:
        cache.set_tenant_quota("A", TenantQuota(max_host_pages=4))
        serve(cache, _prompt(0, 8), tenant="A")
        serve(cache, _prompt(1, 8), tenant="B")
        cache.wait_idle()
        a = _row(cache, "A")
        assert (a.host_pages, a.capped_pages) == (4, 4)
        again = serve(cache, _prompt(0, 8), tenant="A")
        assert (again.host_hit, again.computed) == (4, 4)
        cache.check_integrity()
    finally:
        cache.close()


def test_interleaved_requests_make_room_as_the_tenant_whose_pages_move():
    """begin(A), begin(B), then A's allocation evicts A's device pages to host: the room is A's, and B's host pages at
    its guarantee stay."""
    from support.cache_helpers import write_pages

    cache = make_cache(SPEC, 8, 4, write_policy="write_back", tenant_host_pages=4)
    try:
        serve(cache, _prompt(10, 4), tenant="B")
        serve(cache, _prompt(0, 8), tenant="A")  # evicts B's device pages: backed up, B holds the host tier
        cache.wait_idle()
        assert _row(cache, "B").host_pages == 4
        ra = cache.begin(_prompt(1, 4), tenant="A")
        rb = cache.begin(_prompt(11, 1), tenant="B")
        new = ra.alloc(4)
        write_pages(cache, new.pages, _prompt(1, 4), 0)
        ra.commit(new.pages)
        rb.abort()
        cache.wait_idle()
        b = _row(cache, "B")
        assert (b.host_pages, b.evicted_pages) == (4, 0)
        cache.check_integrity()
    finally:
        cache.close()


def test_a_prefetch_and_a_keyed_call_are_their_tenants_whoever_asked_since(tmp_path):
    """A match of A's, then B's lookup, then the prefetch of A's match: the fetched pages are A's. ``act_for(scope)``
    then a call with page keys: its pages are that tenant's, within its cap."""
    from kvtier.hashing import tenant_scope
    from support.cache_helpers import write_pages

    url = f"file://{tmp_path}"
    w = make_tiered_cache(SPEC, 16, 16, url)
    serve(w, _prompt(0, 4), tenant="A")
    w.wait_idle()
    w.close()
    cache = make_tiered_cache(SPEC, 16, 16, url, tenant_accounting=True)
    try:
        m = cache.match(_prompt(0, 4), tenant="A")
        cache.match(_prompt(5, 4), tenant="B")
        assert cache.resolve_prefetch(cache.prefetch(m)) == 4
        assert (_row(cache, "A").host_pages, _row(cache, "B").host_pages) == (4, 0)
        cache.set_tenant_quota("C", TenantQuota(max_host_pages=2))
        toks = _prompt(7, 4)
        cache.act_for(tenant_scope("C"))
        req = cache.begin(cache.page_keys(toks, "C"))
        new = req.alloc(4)
        write_pages(cache, new.pages, toks, 0)
        req.commit(new.pages)
        cache.wait_idle()
        assert (_row(cache, "C").host_pages, _row(cache, None).host_pages) == (2, 0)
        cache.check_integrity()
    finally:
        cache.close()


def test_the_namespaces_own_quota_is_not_every_new_tenants():
    cache = make_cache(SPEC, 16, 64, tenant_accounting=True)
    try:
        cache.set_tenant_quota(None, TenantQuota(max_host_pages=0))
        serve(cache, _prompt(0, 4))
        serve(cache, _prompt(1, 4), tenant="A")
        cache.wait_idle()
        assert (_row(cache, None).host_pages, _row(cache, None).capped_pages) == (0, 4)
        a = _row(cache, "A")
        assert (a.max_host_pages, a.host_pages) == (None, 4)
    finally:
        cache.close()


def test_the_ttl_clock_stays_small_with_a_day_long_ttl_beside_an_8_ms_one():
    """Pairs are kept about a step apart, thinned to a sixteenth of their age: 20,000 lookups over 40 s keep a few
    hundred, not one per lookup; the short TTL still expires its tenant's pages."""
    cache = make_cache(SPEC, 16, 64, tenant_accounting=True)
    try:
        clock = _Clock()
        cache.tenants._clock = clock
        cache.set_tenant_quota("A", TenantQuota(ttl_s=0.008))
        cache.set_tenant_quota("B", TenantQuota(ttl_s=86400.0))
        serve(cache, _prompt(0, 2), tenant="A")
        cache.wait_idle()
        cache.evict_device(cache.device.num_pages)
        for _ in range(20_000):
            clock.t += 0.002
            cache.match(_prompt(1, 1), tenant="B")
        assert len(cache.tenants._times) < 400
        assert _row(cache, "A").expired_pages == 2
    finally:
        cache.close()
