"""Tenants: a request's tenant is in the root of its page keys, so one tenant's pages are never a hit for another --
on device, in host memory, in L3, through the node service -- and any tenant value scopes its request (a typed error
only where the call itself is wrong), never a crash. Driven through ``kvtier run``'s reference engine on real tiers,
every output compared with a recompute."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.cli import SMALL, kvtier
from support.tenants import CFG, MODEL, PS, SPEC, prompt, push_down, same_as_recompute, tier_cache, tier_hit
from kvtier import DevicePool
from kvtier.app.engine import ReferenceEngine
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from kvtier.errors import IndexTypeError
from kvtier.hashing import request_scope

@pytest.mark.parametrize("tier", ["device", "host", "storage", "service"])
def test_a_tenants_pages_are_a_hit_for_that_tenant_only_in_every_tier(tmp_path, tier):
    """Tenant A's prompt, then the same prompt as tenant B, as no tenant, and as A again, with its pages pushed down to
    ``tier`` before each: B and the namespace's own scope miss (everything computed), A hits from that tier; every
    output equals a recompute."""
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    with tier_cache(tmp_path, tier) as cache:
        eng = ReferenceEngine(MODEL, cache)
        tokens = prompt(1, 5 * PS + 3)
        first = eng.prefill(tokens, tenant="a")
        same_as_recompute(base, tokens, first)
        assert first.computed_tokens == len(tokens)
        for who in ("b", None, "A", b"a"):  # (another tenant; no tenant; case and type are part of a tenant)
            push_down(cache, tier)
            r = eng.prefill(tokens, tenant=who)
            same_as_recompute(base, tokens, r)
            assert r.hit_tokens == 0, (who, r)
        push_down(cache, tier)
        again = eng.prefill(tokens, tenant="a")
        same_as_recompute(base, tokens, again)
        assert tier_hit(again, tier) == 5 * PS and again.hit_tokens == 5 * PS
        cache.wait_idle()
        cache.check_integrity()


#: tenant values: any text (lone surrogates included), bytes, integers of any size, None
TENANTS = st.one_of(st.none(), st.text(st.characters(), max_size=40), st.binary(max_size=24), st.integers(),
                    st.integers(min_value=10**4000, max_value=10**4000 + 5), st.sampled_from(["", "a", "a|b", "\ud800", "x" * 10_000, "1",
                                                                                            b"1", 1, b"", 0, -1]))


@settings(max_examples=200, deadline=None)
@given(a=TENANTS, b=TENANTS)
def test_any_two_tenants_share_keys_only_when_they_are_the_same_tenant(a, b):
    """Every tenant value (a str, bytes or an int of any size) scopes its keys without raising, and two tenants' keys of
    one prompt are the same only for the same tenant: equal text, equal bytes or an equal int -- "1", b"1" and 1 are
    three tenants; None and "" both the namespace's own scope."""
    cache = _KEYS_CACHE
    tokens = prompt(2, 3 * PS)
    ka, kb = cache.page_keys(tokens, a), cache.page_keys(tokens, b)
    own = lambda t: t is None or t == ""  # noqa: E731
    same_tenant = (own(a) and own(b)) or (not own(a) and type(a) is type(b) and a == b)
    assert (ka == kb) == same_tenant
    assert (ka == cache.page_keys(tokens)) == own(a)


_KEYS_CACHE = build_cache(SPEC, TierConfig(device_pages=4, host_pages=4), CacheConfig())


class _Tenant:  # (an object with the default repr: its memory address)
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("value", [_Tenant("alice"), 1.5, True, [1, 2], ("a",), {"a": 1}, np.array([1, 2]), torch.arange(3)],
                         ids=["object", "float", "bool", "list", "tuple", "dict", "ndarray", "tensor"])
def test_a_tenant_that_is_not_a_stable_id_is_a_typed_error_before_anything_is_matched(value):
    """A value scoped by its repr would let tenants meet (an object's address, reused once it is freed; a tensor's
    repr, which elides its middle) or one tenant miss its own pages: a str, bytes or int only, the call refused
    before anything changes."""
    cache = build_cache(SPEC, TierConfig(device_pages=8, host_pages=8), CacheConfig())
    try:
        with pytest.raises(IndexTypeError, match="a tenant is a str, bytes or int"):
            cache.begin(prompt(4, 2 * PS), tenant=value)
        assert cache.stats.requests == 0
        cache.check_integrity()
    finally:
        cache.close()


def _fill(cache, tokens: list[int], tenant) -> None:
    req = cache.begin(tokens, tenant=tenant)
    new = req.alloc(len(tokens) // PS - len(req.cached_pages))
    req.commit(list(req.cached_pages) + list(new.pages))
    cache.wait_idle()


@pytest.mark.parametrize("tier", ["device", "storage"])
def test_a_prompt_that_spells_a_tenants_scope_never_walks_into_that_tenants_pages(tmp_path, tier):
    """A tenant's root is a digest of its scope under the namespace's root: were it the digest of the same bytes as a
    page's (the parent key, then the page's token ids), a prompt whose first page spells the scope would continue in
    the tenant's chain -- the tenant's pages a hit for anyone, from the tree or L3. The root's input is domain-separated:
    the spelled page is a page of the caller's own, and nothing after it hits."""
    cache = build_cache(SPEC, TierConfig(device_pages=16, host_pages=16), CacheConfig(), StorageConfig(url=f"file://{tmp_path}"))
    try:
        victim = "v" * (4 * PS - 13)  # (its request_scope is 4 * PS bytes: one page of int32 token ids)
        scope = request_scope(victim)
        assert len(scope) == 4 * PS
        spelled = np.frombuffer(scope, "<i4").astype(np.int64).tolist()
        secret = prompt(5, 3 * PS)
        _fill(cache, secret, victim)
        _fill(cache, spelled, None)
        if tier == "storage":
            cache.evict_device(cache.device.num_pages)
            cache.evict_host(cache.host.num_pages)
            cache.wait_idle()
        req = cache.begin(spelled + secret)
        got = req.device_hit + req.host_hit + req.storage_hit
        req.abort()
        assert got == 1  # the spelled page, the caller's own: none of the victim's
        cache.check_integrity()
    finally:
        cache.close()


def test_page_keys_with_a_tenant_are_a_typed_error_and_change_nothing(tmp_path):
    """Keys are scoped already: giving a tenant with them is the caller's mistake, said before anything is matched."""
    cache = build_cache(SPEC, TierConfig(device_pages=8, host_pages=8), CacheConfig())
    try:
        keys = cache.page_keys(prompt(3, 2 * PS), "a")
        with pytest.raises(IndexTypeError, match="a tenant scopes token ids; page keys are scoped already"):
            cache.begin(keys, tenant="a")
        assert cache.stats.requests == 0
        cache.check_integrity()
    finally:
        cache.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(trace=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3), st.integers(1, 4), st.sampled_from(
    ["none", "device", "host"])), min_size=4, max_size=14))
def test_random_three_tenant_traces_through_device_host_and_l3_never_hit_across_tenants(tmp_path_factory, trace):
    """Random requests of three tenants over shared prompts (four stems, prefixes of 1-4 pages), with the tiers
    pushed down at random between them: a request's hit is never longer than what its own tenant served before, and
    every output equals a recompute."""
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    store = tmp_path_factory.mktemp("l3")
    cache = build_cache(SPEC, TierConfig(device_pages=12, host_pages=16), CacheConfig(), StorageConfig(url=f"file://{store}"))
    eng = ReferenceEngine(MODEL, cache)
    served: dict[str, set[tuple[int, int]]] = {}  # tenant -> (stem, full pages) it prefilled
    try:
        for tenant, stem, pages, push in trace:
            tokens = prompt(100 + stem, pages * PS + 1)
            r = eng.prefill(tokens, tenant=tenant)
            same_as_recompute(base, tokens, r)
            own = max((p for s, p in served.get(tenant, ()) if s == stem), default=0)
            assert r.hit_tokens <= min(own, pages) * PS, (tenant, stem, pages, r.hit_tokens, served)
            served.setdefault(tenant, set()).add((stem, pages))
            cache.wait_idle()
            if push in ("device", "host"):
                cache.evict_device(cache.device.num_pages)
            if push == "host":
                cache.evict_host(cache.host.num_pages)
        cache.check_integrity()
    finally:
        cache.close()


def test_kvtier_run_replays_a_multi_tenant_chat_whose_sessions_share_their_system_prompt_only_within_a_tenant(tmp_path):
    """``kvtier run --workload-tenants N``: session s of the chat workload is tenant s mod N. With every session its own
    tenant, a system prompt two sessions share is computed by each (a hit only for its own later turns): fewer hits than
    one tenant, every output still equal to recompute."""
    from kvtier.app.runner import RunConfig, WorkloadConfig, run_workload

    def run(tenants: int):
        workload = WorkloadConfig(sessions=4, turns=2, system_prompts=1, system_tokens=4 * PS, user_tokens=PS, reply_tokens=PS,
                                  tenants=tenants)
        cfg = RunConfig(workload=workload, tiers=TierConfig(device_pages=64, host_pages=64), model=CFG,
                        storage=StorageConfig(url=f"file://{tmp_path / f'l3-{tenants}'}"))
        return run_workload(cfg, progress=False)

    one, four = run(1), run(4)
    assert one.logits_equal and four.logits_equal and (one.tenants, four.tenants) == (1, 4)
    first_turns = 4 * (4 * PS)  # each session's first turn: the system prompt, computed by the first session only when shared
    assert one.tokens == four.tokens
    assert one.tokens_recomputed + 3 * 4 * PS <= four.tokens_recomputed <= one.tokens_recomputed + first_turns
    assert WorkloadConfig(sessions=4, tenants=2).tenant_of(5) == "tenant-1" and WorkloadConfig(tenants=1).tenant_of(3) is None
    # the command line: kvtier run --workload-tenants N (the small workload of the CLI tests)
    r = kvtier("run", "--no-progress", "--json", "-", *SMALL, "--workload-tenants", "4")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["tenants"] == 4 and report["logits_equal"]
    assert WorkloadConfig(kind="trace", tenants=3).tenant_of(7) == "tenant-1"


def test_kvtier_plan_spreads_the_trace_over_tenants_that_share_no_block(tmp_path):
    """``kvtier plan --tenants N``: request i is tenant i mod N, each block id scoped by its tenant. Within a tenant a
    block is the same block (its prefix sharing stays); across tenants none is, so the hit ratio falls, never rises."""
    import subprocess
    import sys

    from kvtier.app.plan import PlanConfig, infinite_cache_hit_ratio, run_plan
    from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace, tenant_scoped

    trace = load_mooncake_trace(default_trace_path(), 400)
    assert tenant_scoped(trace, 1) is trace
    four = tenant_scoped(trace, 4)
    blocks = [{h for r in four[t::4] for h in r.hash_ids} for t in range(4)]
    assert all(not (blocks[a] & blocks[b]) for a in range(4) for b in range(a + 1, 4))  # no block shared across tenants
    for r, s in zip(trace, four):
        assert len(r.hash_ids) == len(s.hash_ids) and (r.timestamp_ms, r.input_length) == (s.timestamp_ms, s.input_length)
    for t in range(4):  # within a tenant, equal blocks stay equal: its requests' sharing is the trace's
        mine = trace[t::4]
        pairs = {(a, b) for r, s in zip(mine, four[t::4]) for a, b in zip(r.hash_ids, s.hash_ids)}
        assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})
    bound_one, bound_four = infinite_cache_hit_ratio(trace), infinite_cache_hit_ratio(four)
    assert bound_four < bound_one
    cfg = PlanConfig()
    assert run_plan(four, cfg).hit_ratio["total"] <= run_plan(trace, cfg).hit_ratio["total"]
    out = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "plan", "--json", "--limit", "400", "--tenants", "4"],
                         capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout)
    assert report["tenants"] == 4 and report["infinite_cache_hit_ratio"] == round(bound_four, 4)
