"""Prefixes declared shareable across tenants (issue 56, item 3): a system prompt an operator declares, by its content and
in a named scope, is one set of pages for every tenant whose request starts with it -- from device, host, L3 and the
node service -- while what follows it stays each tenant's own; nothing undeclared is ever shared. Driven through
``kvtier run``'s reference engine, every output compared with a recompute."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import DevicePool
from kvtier.app.engine import ReferenceEngine
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from kvtier.errors import ConfigError
from kvtier.shared_prefixes import MAX_DECLARED
from support.tenants import MODEL, PS, SPEC, prompt, push_down, same_as_recompute, tier_cache, tier_hit

SYSTEM = prompt(100, 3 * PS + 5)  # (three full pages are declared; the five tokens after them are not)


@pytest.mark.parametrize("tier", ["device", "host", "storage", "service"])
def test_a_declared_system_prompt_is_a_hit_for_every_tenant_and_what_follows_it_for_its_own_alone(tmp_path, tier):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    with tier_cache(tmp_path, tier) as cache:
        assert cache.share_prefix(SYSTEM) == 3
        eng = ReferenceEngine(MODEL, cache)
        a_prompt, b_prompt = SYSTEM + prompt(1, 2 * PS), SYSTEM + prompt(2, 2 * PS)
        first = eng.prefill(a_prompt, tenant="a")
        same_as_recompute(base, a_prompt, first)
        assert first.hit_tokens == 0
        push_down(cache, tier)
        other = eng.prefill(b_prompt, tenant="b")  # another tenant, the same system prompt: its three pages hit
        same_as_recompute(base, b_prompt, other)
        assert other.hit_tokens == 3 * PS
        push_down(cache, tier)
        probe = eng.prefill(a_prompt, tenant="c")  # a's whole prompt as tenant c: the system prompt, nothing of a's own
        same_as_recompute(base, a_prompt, probe)
        assert probe.hit_tokens == 3 * PS
        push_down(cache, tier)
        again = eng.prefill(a_prompt, tenant="a")  # a itself: everything (its own tail after the shared pages)
        same_as_recompute(base, a_prompt, again)
        assert again.hit_tokens == tier_hit(again, tier) == (len(a_prompt) - 1) // PS * PS
        cache.wait_idle()
        cache.check_integrity()


def test_an_undeclared_prefix_a_part_of_one_or_one_further_in_is_never_shared():
    cache = build_cache(SPEC, TierConfig(device_pages=64, host_pages=64), CacheConfig())
    try:
        cache.share_prefix(SYSTEM)
        eng = ReferenceEngine(MODEL, cache)
        eng.prefill(SYSTEM + prompt(1, PS), tenant="a")
        assert eng.prefill(SYSTEM[: 2 * PS] + prompt(3, 2 * PS), tenant="b").hit_tokens == 0  # (two of its three pages)
        assert eng.prefill(prompt(4, PS) + SYSTEM, tenant="b").hit_tokens == 0  # (after a page of its own)
        other = prompt(5, 3 * PS)
        eng.prefill(other + prompt(6, PS), tenant="a")
        assert eng.prefill(other + prompt(7, PS), tenant="b").hit_tokens == 0  # (never declared)
        changed = list(SYSTEM)
        changed[3 * PS - 1] += 1  # (the declared pages' last token)
        assert eng.prefill(changed + prompt(1, PS), tenant="d").hit_tokens == 0  # (d: b computed two of these pages as its own)
    finally:
        cache.close()


def test_scopes_never_meet_and_the_longest_declared_prefix_wins():
    cache = build_cache(SPEC, TierConfig(device_pages=8, host_pages=8), CacheConfig())
    try:
        cache.share_prefix(SYSTEM, scope="eu")
        keys_eu = cache.page_keys(SYSTEM + prompt(1, PS), "a")
        other = build_cache(SPEC, TierConfig(device_pages=8, host_pages=8), CacheConfig())
        other.share_prefix(SYSTEM, scope="us")
        keys_us = other.page_keys(SYSTEM + prompt(1, PS), "a")
        assert keys_eu[:3] != keys_us[:3]  # (the same tokens in two scopes: two sets of pages)
        other.close()
        cache.share_prefix(SYSTEM[: 2 * PS], scope="eu")  # (a shorter prefix of it, declared too)
        longer = cache.page_keys(SYSTEM + prompt(1, PS), "b")
        assert longer[:3] == keys_eu[:3] and longer[3] != keys_eu[3]  # (three shared pages; the tail is b's own)
        short = cache.page_keys(SYSTEM[: 2 * PS] + prompt(9, 2 * PS), "b")
        assert short[:2] == keys_eu[:2] and short[2] != keys_eu[2]
        assert cache.share_prefix(SYSTEM, scope="eu") == 3 and len(cache.shared_prefixes) == 2  # (declared twice: once)
    finally:
        cache.close()


@settings(max_examples=60, deadline=None)
@given(a=st.one_of(st.none(), st.text(max_size=8), st.integers()), b=st.one_of(st.none(), st.text(max_size=8), st.integers()),
       tail=st.integers(0, 3))
def test_two_tenants_share_the_declared_pages_and_their_tails_only_when_they_are_the_same_tenant(a, b, tail):
    tokens = SYSTEM + prompt(11, tail * PS)
    ka, kb = _KEYS.page_keys(tokens, a), _KEYS.page_keys(tokens, b)
    assert ka[:3] == kb[:3]
    own = lambda t: t is None or t == ""  # noqa: E731
    same = (own(a) and own(b)) or (not own(a) and type(a) is type(b) and a == b)
    assert (ka[3:] == kb[3:]) == (same or tail == 0)
    plain = _PLAIN.page_keys(tokens, a)  # (a cache that declared nothing: no page of it is the shared one)
    assert not set(plain) & set(ka[:3])


_KEYS = build_cache(SPEC, TierConfig(device_pages=4, host_pages=4), CacheConfig())
_KEYS.share_prefix(SYSTEM)
_PLAIN = build_cache(SPEC, TierConfig(device_pages=4, host_pages=4), CacheConfig())


@pytest.mark.parametrize("tokens, scope, match", [
    (SYSTEM[: PS - 1], "shared", "at least one full page"),
    (SYSTEM, "", "non-empty name"),
    (SYSTEM, 7, "non-empty name"),
    ([1.5] * PS, "shared", "integers"),
])
def test_a_bad_declaration_is_a_typed_error_that_declares_nothing(tokens, scope, match):
    cache = build_cache(SPEC, TierConfig(device_pages=4, host_pages=4), CacheConfig())
    try:
        before = cache.page_keys(SYSTEM, "a")
        with pytest.raises(ConfigError, match=match):
            cache.share_prefix(tokens, scope=scope)
        assert cache.page_keys(SYSTEM, "a") == before
    finally:
        cache.close()


def test_declarations_are_bounded():
    cache = build_cache(SPEC, TierConfig(device_pages=4, host_pages=4), CacheConfig())
    try:
        for i in range(MAX_DECLARED):
            cache.share_prefix(prompt(1000 + i, PS))
        with pytest.raises(ConfigError, match=f"{MAX_DECLARED} shared prefixes"):
            cache.share_prefix(prompt(5000, PS))
    finally:
        cache.close()


def test_kvtier_run_with_shared_system_prompts_computes_each_once_for_every_tenant(tmp_path):
    """``kvtier run --workload-tenants 4 --workload-share-system-prompts``: the chat workload's system prompt is declared
    shareable, so four tenants' sessions compute it once between them -- as one tenant does -- and still each their own
    turns; every output equals recompute."""
    import json

    from kvtier.app.runner import RunConfig, WorkloadConfig, run_workload
    from support.cli import SMALL, kvtier
    from support.tenants import CFG

    def run(tenants: int, share: bool):
        workload = WorkloadConfig(sessions=4, turns=2, system_prompts=1, system_tokens=4 * PS, user_tokens=PS, reply_tokens=PS,
                                  tenants=tenants, share_system_prompts=share)
        cfg = RunConfig(workload=workload, tiers=TierConfig(device_pages=64, host_pages=64), model=CFG,
                        storage=StorageConfig(url=f"file://{tmp_path / f'l3-{tenants}-{share}'}"))
        return run_workload(cfg, progress=False)

    one, apart, shared = run(1, False), run(4, False), run(4, True)
    assert one.logits_equal and apart.logits_equal and shared.logits_equal
    assert shared.shared_prefixes == 1 and apart.shared_prefixes == 0
    # apart: each of four tenants computes the system prompt; shared: the first session computes it for all four
    assert apart.tokens_recomputed - shared.tokens_recomputed == 3 * 4 * PS
    assert shared.tokens_recomputed == one.tokens_recomputed
    r = kvtier("run", "--no-progress", "--json", "-", *SMALL, "--workload-tenants", "4", "--workload-share-system-prompts")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["tenants"] == 4 and report["shared_prefixes"] == 2 and report["logits_equal"]
    with pytest.raises(ConfigError, match="a trace has none"):
        WorkloadConfig(kind="trace", share_system_prompts=True)
