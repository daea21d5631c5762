"""Tenants' bounds in L3 (issue 56, item 4): each page object carries its owner's tag, and the file store keeps a
tenant's guaranteed bytes from its cap, cuts a tenant at its own cap, and deletes a tenant's objects unused past a TTL
(kvtier.l3.tenant_bounds). Every request's pages are checked bit-exact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVSpec
from kvtier.errors import StorageError
from kvtier.hashing import NAMESPACE_TAG, OVERFLOW_TAG, SHARED_TAG, PageHash, owner_tag
from kvtier.l3.base import KeyStatus
from kvtier.l3.registry import parse_url
from kvtier.l3.file import FileBackend
from kvtier.l3.page import PageCodec, tag_of
from kvtier.l3.tenant_bounds import StoredObject, TenantBounds, is_tenant, plan_sweep
from support.cache_helpers import make_tiered_cache, serve, tokens

SPEC = KVSpec.mha("l3-quota-test", 2, kv_heads=2, head_dim=8, page_size=4)
PS = SPEC.page_size
OBJECT = PageCodec.for_spec(SPEC).object_bytes
ALICE, BOB = owner_tag("00000000000000a1"), owner_tag("00000000000000b0")


# ---- the sweep alone ---------------------------------------------------------------------------
def _objects(spec: list[tuple[int, int]], size: int = 10) -> list[StoredObject]:
    """(tag, used_ns) pairs as objects of ``size`` bytes, named by their place."""
    return [StoredObject(used, size, tag, i) for i, (tag, used) in enumerate(spec)]


def test_tags_of_words_and_tenants_are_apart():
    assert (owner_tag("namespace"), owner_tag("shared"), owner_tag("overflow")) == (NAMESPACE_TAG, SHARED_TAG, OVERFLOW_TAG)
    tags = {owner_tag(f"{i:016x}") for i in range(2000)}
    assert len(tags) == 2000 and min(tags) > OVERFLOW_TAG and max(tags) < 1 << 32
    assert not any(map(is_tenant, (NAMESPACE_TAG, SHARED_TAG, OVERFLOW_TAG)))


def test_a_ttl_deletes_tenants_objects_unused_that_long_and_nothing_else():
    objs = _objects([(ALICE, 0), (ALICE, 100), (BOB, 5), (NAMESPACE_TAG, 0), (SHARED_TAG, 0), (OVERFLOW_TAG, 0)])
    sweep = plan_sweep(objs, TenantBounds(ttl_s=1e-7), None, now_ns=150)  # (a TTL of 100 ns)
    assert sorted(o.ref for o in sweep.expired) == [0, 2]
    assert not sweep.capped and not sweep.evicted and sweep.total == 40


def test_a_tenant_past_its_cap_loses_its_own_least_recently_used_down_to_nine_tenths():
    objs = _objects([(ALICE, t) for t in range(20)] + [(BOB, t) for t in range(5)])
    sweep = plan_sweep(objs, TenantBounds(max_bytes=100), None, now_ns=1000)  # alice holds 200, bob 50
    assert [o.ref for o in sweep.capped] == list(range(11))  # her oldest, until 90 bytes are left
    assert sweep.by_tag == {ALICE: 90, BOB: 50}


def test_the_stores_cap_never_takes_a_tenant_below_its_guarantee_and_is_full_when_only_guarantees_are_left():
    # alice's 5 objects are the oldest; bob's 10 came later; the store holds 100 bytes
    objs = _objects([(ALICE, t) for t in range(5)] + [(BOB, 10 + t) for t in range(10)] + [(NAMESPACE_TAG, 50)])
    sweep = plan_sweep(objs, TenantBounds(guaranteed_bytes=50), 100, now_ns=1000)
    assert sweep.by_tag[ALICE] == 50  # kept: all of it is guaranteed
    assert sweep.by_tag[BOB] == 50 and sweep.by_tag.get(NAMESPACE_TAG, 0) == 0  # bob's oldest and the unowned object went
    assert sweep.total == 100 and not sweep.full  # (90 is the aim; only guarantees are left above it)
    packed = plan_sweep(_objects([(ALICE, 1)] * 8 + [(BOB, 2)] * 8), TenantBounds(guaranteed_bytes=80), 100, now_ns=1000)
    assert packed.full and not packed.evicted and packed.total == 160


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([NAMESPACE_TAG, SHARED_TAG, ALICE, BOB, owner_tag("00000000000000c0")]),
                          st.integers(0, 100), st.integers(1, 30)), max_size=40),
       st.integers(0, 60), st.one_of(st.none(), st.integers(60, 200)), st.one_of(st.none(), st.integers(1, 400)),
       st.one_of(st.none(), st.integers(1, 100)))
def test_every_sweep_keeps_the_bounds(spec, guarantee, tenant_cap, store_cap, ttl_ns):
    objs = [StoredObject(used, size, tag, i) for i, (tag, used, size) in enumerate(spec)]
    bounds = TenantBounds(guaranteed_bytes=guarantee, max_bytes=tenant_cap, ttl_s=None if ttl_ns is None else ttl_ns * 1e-9)
    sweep = plan_sweep(objs, bounds, store_cap, now_ns=100)
    gone = [o.ref for o in sweep.deleted]
    assert len(gone) == len(set(gone))  # nothing deleted twice
    left = [o for o in objs if o.ref not in set(gone)]
    held: dict[int, int] = {}
    for o in left:
        held[o.tag] = held.get(o.tag, 0) + o.size
    assert held == sweep.by_tag and sum(held.values()) == sweep.total
    for o in sweep.expired:  # only a tenant's, only past its TTL
        assert is_tenant(o.tag) and ttl_ns is not None and o.used_ns < 100 - ttl_ns
    if ttl_ns is not None:
        assert not any(is_tenant(o.tag) and o.used_ns < 100 - ttl_ns for o in left)
    if tenant_cap is not None:
        assert all(n <= tenant_cap for tag, n in held.items() if is_tenant(tag))
    for tag in {o.tag for o in sweep.evicted}:  # the store's cap took a tenant's objects only above its guarantee
        if is_tenant(tag):
            assert held.get(tag, 0) >= guarantee
    if store_cap is not None:
        assert sweep.full == (sweep.total > store_cap)
        if sweep.full:  # nothing the store's cap may take is left
            assert all(is_tenant(o.tag) and held[o.tag] - o.size < guarantee for o in left)
    else:
        assert not sweep.evicted and not sweep.full


# ---- the file store ------------------------------------------------------------------------------
def _set(store: FileBackend, tag: int, i: int) -> tuple[str, KeyStatus]:
    codec = PageCodec.for_spec(SPEC)
    key = PageHash(i.to_bytes(16, "little"))
    payload = memoryview(bytes([i % 251]) * codec.payload_bytes)
    name = f"ns/{bytes(key).hex()}"
    return name, store.set_scattered([name], [[memoryview(codec.header_for_parts(key, (payload,), owner=tag)), payload]])[0]


def _put(store: FileBackend, tag: int, i: int) -> str:
    name, status = _set(store, tag, i)
    assert status is KeyStatus.OK
    return name


def _age(store: FileBackend, name: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(store._path(name), (t, t))


def test_the_file_store_reads_tags_from_headers_and_keeps_a_tenants_guarantee_from_its_cap(tmp_path):
    store = FileBackend(tmp_path, max_bytes=10 * OBJECT, tenants=TenantBounds(guaranteed_bytes=4 * OBJECT))
    try:
        mine = [_put(store, ALICE, i) for i in range(4)]
        for name in mine:
            _age(store, name, 100)  # alice's are the least recently used
        floods = [_put(store, BOB, 100 + i) for i in range(20)]
        assert store.exists(mine) == 4, "bob's flood took alice below her guarantee"
        assert store.evicted_objects >= 10 and store.usage_bytes() <= 10 * OBJECT
        assert sum(os.path.isfile(store._path(n)) for n in floods) <= 6
        assert store.tag_bytes[ALICE] == 4 * OBJECT
    finally:
        store.close()


def test_a_full_file_store_refuses_new_objects_until_room_is_made_and_deletes_nothing_guaranteed(tmp_path):
    store = FileBackend(tmp_path, max_bytes=4 * OBJECT, tenants=TenantBounds(guaranteed_bytes=3 * OBJECT))
    try:
        held = [_put(store, ALICE, i) for i in range(3)] + [_put(store, BOB, 10 + i) for i in range(2)]  # 5 > 4, all guaranteed
        assert store._full and store.exists(held[:3]) == 3 and store.exists(held[3:]) == 2
        assert _set(store, BOB, 99) == (f"ns/{(99).to_bytes(16, 'little').hex()}", KeyStatus.ERROR)
        assert store.refused_full == 1 and store.exists([f"ns/{(99).to_bytes(16, 'little').hex()}"]) == 0
        store.delete(held[3:])  # an operator (or bob's TTL) makes room
        store._swept_at -= 2  # (a second later)
        assert _set(store, BOB, 99)[1] is KeyStatus.OK
    finally:
        store.close()


def test_a_tenants_cap_in_the_file_store_cuts_only_its_own_oldest(tmp_path):
    store = FileBackend(tmp_path, tenants=TenantBounds(max_bytes=5 * OBJECT))
    try:
        others = [_put(store, t, i) for i, t in enumerate([BOB, NAMESPACE_TAG, SHARED_TAG] * 3)]
        mine = []
        t0 = time.monotonic()
        for i in range(12):
            mine.append(_put(store, ALICE, 100 + i))
            _age(store, mine[-1], 100 - i)  # each older than the next
        elapsed = time.monotonic() - t0
        assert store.exists(others[:1]) == 1 and all(os.path.isfile(store._path(n)) for n in others)
        # (at most one sweep a second from the writes, and one from the sweeper: however slow the machine, not one a write)
        assert store.sweeps <= 2 + 2 * int(elapsed), "a tenant at its cap must not make every write scan the whole store"
        store.sweep()  # (the next one due: within a second of writes, she may be past her cap by what she wrote in it)
        kept = [os.path.isfile(store._path(n)) for n in mine]
        assert sum(kept) <= 5 and kept[-1] and kept == sorted(kept), kept  # her newest kept, her oldest gone
        assert store.capped_objects == 12 - sum(kept)
        store._swept_at -= 2  # a second later, a write past her cap sweeps at once
        before = store.sweeps
        for i in range(3):
            mine.append(_put(store, ALICE, 200 + i))
        assert store.sweeps == before + 1 and sum(os.path.isfile(store._path(n)) for n in mine) <= 5
    finally:
        store.close()


def test_a_tenants_cap_never_makes_the_namespaces_writes_scan_the_store(tmp_path):
    store = FileBackend(tmp_path, max_bytes=10_000 * OBJECT, tenants=TenantBounds(max_bytes=4 * OBJECT))
    try:
        for i in range(300):
            _put(store, NAMESPACE_TAG, i)
        assert store.sweeps == 1  # (the first write's: the store's rescans follow its own cap, every 5% of it)
    finally:
        store.close()


def test_a_tenants_cap_never_cuts_it_below_its_guarantee():
    objs = _objects([(ALICE, t) for t in range(11)])  # 110 bytes
    assert plan_sweep(objs, TenantBounds(guaranteed_bytes=100, max_bytes=100), None, now_ns=1000).by_tag[ALICE] == 100
    assert plan_sweep(objs, TenantBounds(guaranteed_bytes=50, max_bytes=100), None, now_ns=1000).by_tag[ALICE] == 90


def test_the_file_stores_sweeper_deletes_a_tenants_objects_unused_past_its_ttl(tmp_path):
    store = FileBackend(tmp_path, tenants=TenantBounds(ttl_s=0.4))
    try:
        old = _put(store, ALICE, 1)
        _age(store, old, 10)
        unowned = _put(store, NAMESPACE_TAG, 2)
        _age(store, unowned, 10)
        fresh = _put(store, BOB, 3)
        deadline = time.monotonic() + 10
        while (os.path.exists(store._path(old)) or not store.expired_objects) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(store._path(old)), "the sweeper never deleted an expired object"
        assert os.path.exists(store._path(unowned)) and store.expired_objects >= 1
        store.get_scattered([fresh], [[memoryview(bytearray(OBJECT))]])  # a read is a use: it keeps bob's object
        assert os.path.exists(store._path(fresh))
    finally:
        store.close()
    assert not store._sweeper.is_alive()


@pytest.mark.parametrize("query, why", [
    ("tenant_max_gb=0", "tenant_max_gb='0' must be a number > 0"),
    ("tenant_ttl_s=soon", "tenant_ttl_s='soon' must be a number > 0"),
    ("tenant_min_gb=1&tenant_min_bytes=5&max_gb=3", "sets both tenant_min_bytes and tenant_min_gb"),
    ("tenant_min_gb=2&tenant_max_gb=1", "guaranteed 2147483648 bytes are above its cap"),
    ("tenant_min_gb=1", "set max_gb too"),
    ("max_gb=1&tenant_min_gb=0.95", "above 90% of the store's cap"),  # (one tenant would fill it, and every write be refused)
    ("tenant_min_bytes=0.5&max_gb=1", "less than one byte"),
    ("tenant_ttl_s=1e11", "longer than ten years"),  # (past what the sweeper's wait and the sweep's clock hold)
    ("tenant_ttl_s=1e300", "longer than ten years"),
])
def test_bad_tenant_bounds_in_a_file_url_are_typed_errors_and_make_nothing(tmp_path, query, why):
    root = tmp_path / "store"
    with pytest.raises(StorageError, match=why.replace("(", r"\(")):
        FileBackend.from_url(parse_url(f"file://{root}?{query}"))
    assert not root.exists()


def test_a_file_url_sets_every_tenant_bound(tmp_path):
    store = FileBackend.from_url(parse_url(f"file://{tmp_path}?max_gb=2&tenant_min_gb=0.5&tenant_max_bytes=1000000000&tenant_ttl_s=60"))
    try:
        assert store.tenants == TenantBounds(guaranteed_bytes=1 << 29, max_bytes=1_000_000_000, ttl_s=60.0)
    finally:
        store.close()


# ---- through a cache -----------------------------------------------------------------------------
def _tags_on_disk(root: Path) -> list[int]:
    return [tag_of(p.read_bytes()[:16]) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


@pytest.mark.parametrize("query, accounting", [("", True), ("?tenant_ttl_s=3600", False)], ids=["accounting", "bounds in the URL"])
def test_a_caches_l3_objects_carry_their_tenants_tag(tmp_path, query, accounting):
    """With a ledger (tenant accounting), or with none asked for, where the store's URL bounds tenants."""
    cache = make_tiered_cache(SPEC, 8, 32, f"file://{tmp_path}{query}", tenant_accounting=accounting)
    try:
        serve(cache, tokens(1, 3 * PS), tenant="alice")
        serve(cache, tokens(2, 2 * PS), tenant="bob")
        serve(cache, tokens(3, 1 * PS))
        cache.wait_idle()
        alice, bob = (owner_tag(cache.tenant_label(t)) for t in ("alice", "bob"))
        assert sorted(_tags_on_disk(tmp_path)) == sorted([NAMESPACE_TAG] + [bob] * 2 + [alice] * 3)
    finally:
        cache.close()


def _rounds(cache, *, flood: bool, rounds: int = 6) -> float:
    """Tenant A cycles through six 4-page prompts (24 pages: more than device and host hold, so they come back from L3);
    B sends two new 4-page prompts after each of A's when ``flood``. A's hit ratio over its rounds after the first."""
    hit = total = 0
    for r in range(rounds):
        for i in range(6):
            s = serve(cache, tokens(10_000 * (i + 1), 4 * PS), prefetch=True, tenant="A")
            cache.wait_idle()
            if r:
                hit += s.device_hit + s.host_hit
                total += s.device_hit + s.host_hit + s.computed
            for j in range(2 if flood else 0):
                serve(cache, tokens(500_000 + 1000 * (r * 12 + i * 2 + j), 4 * PS), prefetch=True, tenant="B")
                cache.wait_idle()
    cache.check_integrity()
    return hit / total


def test_a_flood_in_l3_leaves_a_tenant_its_guaranteed_share_and_its_hit_ratio(tmp_path):
    cap = f"max_bytes={60 * OBJECT}"  # (both tenants' guarantees fit in it: 48 of the 54 a sweep aims for)
    ratios = {}
    for name, query, flood in [("alone", cap, False), ("guarded", f"{cap}&tenant_min_bytes={24 * OBJECT}", True),
                               ("unguarded", cap, True)]:
        cache = make_tiered_cache(SPEC, 4, 8, f"file://{tmp_path / name}?{query}", tenant_accounting=True)
        try:
            ratios[name] = _rounds(cache, flood=flood)
        finally:
            cache.close()
    assert ratios["alone"] == 1.0, ratios
    assert abs(ratios["guarded"] - ratios["alone"]) <= 0.01, ratios
    assert ratios["unguarded"] < ratios["alone"] - 0.2, f"the flood must hurt A without a guarantee, or this proves nothing: {ratios}"


# ---- Redis: a TTL (it evicts on its own: shares and caps are refused) ------------------------------
@pytest.fixture
def redis_server(tmp_path):
    from kvtier.app.devservers import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def _redis_round(url: str, tmp_path: Path):
    """Alice's, bob's and the namespace's pages through a cache on ``url``; the store's keys with their TTLs (ms)."""
    import redis

    cache = make_tiered_cache(SPEC, 4, 8, url, tenant_accounting=True)
    try:
        serve(cache, tokens(1, 3 * PS), tenant="alice")
        serve(cache, tokens(2, 2 * PS))
        cache.wait_idle()
        alice = cache.tenant_label("alice")
    finally:
        cache.close()
    return alice, redis.Redis.from_url(url.split("?")[0])


@pytest.mark.integration
def test_redis_sets_a_tenants_objects_with_its_ttl_moves_it_on_at_each_read_and_leaves_other_objects_without(redis_server, tmp_path):
    url = f"{redis_server.url}&tenant_ttl_s=30"
    alice, client = _redis_round(url, tmp_path)
    ttls = {k: client.pttl(k) for k in client.keys("*")}
    tagged = {k: tag_of(client.getrange(k, 0, 15)) for k in ttls}
    assert sorted(tagged.values()) == sorted([owner_tag(alice)] * 3 + [NAMESPACE_TAG] * 2)
    assert all(15_000 < ttls[k] <= 30_000 for k, t in tagged.items() if t != NAMESPACE_TAG)
    assert all(ttls[k] == -1 for k, t in tagged.items() if t == NAMESPACE_TAG)  # never an expiry on an unowned object
    mine = [k for k, t in tagged.items() if t != NAMESPACE_TAG]
    for k in mine:
        client.pexpire(k, 10_000)
    cache = make_tiered_cache(SPEC, 4, 8, url, tenant_accounting=True)
    try:
        s = serve(cache, tokens(1, 3 * PS), prefetch=True, tenant="alice")  # read back from Redis: the expiry moves on
        assert s.storage_hit == 3
        serve(cache, tokens(2, 2 * PS), prefetch=True)
    finally:
        cache.close()
    assert all(client.pttl(k) > 15_000 for k in mine)  # (set back to 10 s before the read)
    assert all(client.pttl(k) == -1 for k, t in tagged.items() if t == NAMESPACE_TAG)


@pytest.mark.integration
def test_redis_deletes_a_tenants_objects_once_their_ttl_passes(redis_server, tmp_path):
    _alice, client = _redis_round(f"{redis_server.url}&tenant_ttl_s=0.3", tmp_path)
    deadline = time.monotonic() + 10
    while len(client.keys("*")) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(tag_of(client.getrange(k, 0, 15)) for k in client.keys("*")) == [NAMESPACE_TAG] * 2


@pytest.mark.parametrize("url, why", [
    ("redis://127.0.0.1:1/0?tenant_min_gb=1", "redis URL sets tenant_min_gb, which redis cannot keep.*redis keeps tenant_ttl_s"),
    ("redis://127.0.0.1:1/0?tenant_max_bytes=100&tenant_ttl_s=5", "sets tenant_max_gb, which redis cannot keep"),
    ("memory://?tenant_ttl_s=5", "memory URL sets tenant_ttl_s, which memory cannot keep"),
    ("redis://127.0.0.1:1/0?tenant_ttl_s=-1", "tenant_ttl_s='-1' must be a number > 0"),
    ("redis://127.0.0.1:1/0?tenant_ttl_s=1e16", "longer than ten years"),  # (a PX Redis refuses: every tenant's SET would fail)
])
def test_a_store_that_evicts_on_its_own_refuses_tenant_bounds_it_cannot_keep(url, why):
    from kvtier.l3.registry import open_backend

    with pytest.raises(StorageError, match=why):
        open_backend(url)


def test_a_hybrid_models_group_objects_in_l3_carry_their_pages_tenant(tmp_path):
    """A sliding-window page and a state snapshot ride on a full-attention page's plan: their objects carry its owner."""
    import torch

    from kvtier.app.engine import HybridEngine
    from kvtier.app.model import ModelConfig
    from kvtier.app.model.hybrid import FULL, HybridConfig, HybridReferenceModel
    from kvtier.build import TierConfig, build_hybrid_cache
    from kvtier.config import CacheConfig, StorageConfig

    base = ModelConfig(hidden=64, num_layers=3, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                       index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)
    cfg = HybridConfig(base=base, window=12, swa_heads=2, swa_head_dim=16, state_heads=2, state_dim=8, state_every=2)
    spec = cfg.model_spec()
    cache = build_hybrid_cache(spec, TierConfig(device_pages=24, host_pages=24), CacheConfig(tenant_accounting=True),
                               StorageConfig(url=f"file://{tmp_path}"), state_every=cfg.state_every)
    try:
        engine = HybridEngine(HybridReferenceModel(cfg), cache, {FULL: cache.device, **{n: d for n, (d, _h) in cache.group_pools.items()}})
        tokens_of = torch.randint(0, base.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5)).tolist()
        engine.prefill(tokens_of[0], tenant="alice")
        engine.prefill(tokens_of[1], tenant="bob")
        cache.wait_idle()
        alice, bob = (owner_tag(cache.tenant_label(t)) for t in ("alice", "bob"))
        tags = _tags_on_disk(tmp_path)
        assert len(tags) > 2 * 4, "the groups' objects were not saved, or this proves nothing"  # 4 full pages each, and more
        assert sorted(set(tags)) == sorted({alice, bob}) and tags.count(alice) == tags.count(bob)
    finally:
        cache.close()


def test_vllms_connector_saves_each_cache_salts_objects_with_its_tag_on_every_rank(tmp_path):
    """The scheduler side plans (its ledger knows the owners: the store's URL bounds tenants); each rank's worker writes
    the tags its plans carry, through vLLM's metadata."""
    from support.vllm_split import TOKENS, Engine, finish, request

    eng = Engine(f"file://{tmp_path}?tenant_ttl_s=3600", ranks=2, host_pages=32)
    core = eng.scheduler.core
    try:
        for rid, salt, shift in (("a0", "a", 0), ("b0", "b", 1000)):
            req = request(rid, [t + shift for t in TOKENS])
            req.cache_salt = salt
            external, _ = eng.scheduler.get_num_new_matched_tokens(req, 0)
            eng.scheduler.update_state_after_alloc(req, external)
            eng.step(new=[(req, [0, 1, 2, 3] if salt == "a" else [4, 5, 6, 7], len(TOKENS) - external)])
            finish(eng, req)
            eng.settle()
        a, b = (owner_tag(core.tenant_label(salt)) for salt in ("a", "b"))
        tags = _tags_on_disk(tmp_path)
        assert tags and sorted(set(tags)) == sorted({a, b}) and tags.count(a) == tags.count(b) and len(tags) % 2 == 0
    finally:
        eng.close()


@pytest.mark.integration
def test_a_redis_cluster_sets_moves_on_and_ends_a_tenants_ttl_on_each_node(tmp_path):
    import redis

    from kvtier.app.devservers import start_redis_cluster

    servers = start_redis_cluster(tmp_path / "cluster")
    try:
        url = f"redis+cluster://127.0.0.1:{servers[0].port}?timeout=2&tenant_ttl_s=30"
        cache = make_tiered_cache(SPEC, 4, 8, url, tenant_accounting=True)
        try:
            for i in range(4):
                serve(cache, tokens(100 * i, 3 * PS), tenant="alice")
            serve(cache, tokens(9000, 2 * PS))
            cache.wait_idle()
            alice = owner_tag(cache.tenant_label("alice"))
        finally:
            cache.close()
        nodes = [redis.Redis(port=s.port) for s in servers]
        ttls = {(n, k): (n.pttl(k), tag_of(n.getrange(k, 0, 15))) for n in nodes for k in n.keys("*")}
        assert sorted(t for _ttl, t in ttls.values()) == sorted([alice] * 12 + [NAMESPACE_TAG] * 2)
        assert sum(1 for n in nodes if any(m is n and t == alice for (m, _k), (_ttl, t) in ttls.items())) >= 2  # spread over nodes
        assert all((15_000 < ttl <= 30_000) if t == alice else ttl == -1 for ttl, t in ttls.values())
        for (n, k), (_ttl, t) in ttls.items():
            if t == alice:
                n.pexpire(k, 10_000)
        cache = make_tiered_cache(SPEC, 4, 8, url, tenant_accounting=True)
        try:
            assert serve(cache, tokens(300, 3 * PS), prefetch=True, tenant="alice").storage_hit == 3
        finally:
            cache.close()
        moved = [n.pttl(k) > 15_000 for (n, k), (_ttl, t) in ttls.items() if t == alice]
        assert sum(moved) == 3, "each read must move on its own object's expiry, and no other's"
    finally:
        for s in servers:
            s.stop()


@pytest.mark.integration
def test_a_read_through_redis_pys_cluster_pipeline_moves_a_tenants_expiry_on_too(redis_server):
    """A cluster's redirected keys, a failed node or a missing slot map go through redis-py's pipeline: its reads move a
    tenant's expiry on as the direct path's do."""
    import redis

    from kvtier.l3.redis import RedisBackend

    client = redis.Redis(port=redis_server.port)
    backend = RedisBackend(redis.Redis(port=redis_server.port), cluster=True, tenant_ttl_s=30)  # (no slot map: every key there)
    codec = PageCodec.for_spec(SPEC)
    payload = memoryview(b"y" * codec.payload_bytes)
    try:
        for key, tag in (("mine", ALICE), ("namespace", NAMESPACE_TAG)):
            head = codec.header_for_parts(PageHash(b"\x01" * 16), (payload,), owner=tag)
            assert backend._set_via_client([key], [memoryview(head + bytes(payload))]) == [KeyStatus.OK]
        client.pexpire("mine", 5000)
        outs = [[memoryview(bytearray(codec.object_bytes))] for _ in range(3)]
        assert backend.get_scattered(["mine", "namespace", "absent"], outs) == [KeyStatus.OK, KeyStatus.OK, KeyStatus.MISS]
        assert client.pttl("mine") > 15_000 and client.pttl("namespace") == -1
    finally:
        backend.close()
