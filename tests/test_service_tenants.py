"""Tenants' bounds in the node service's region (issue 56, item 4; kvtier.service.tenants): an engine labels the pages
it publishes with its tenant's digest, and ``kvtier serve --tenant-host-pages / --tenant-max-host-pages /
--tenant-ttl-s`` bound them per tenant, for every engine on the node, across the service's restarts. The index's
rules on their own first (a stateful run keeps the rows equal to the pages), then a real service and real engines
(every answer equal to a recompute)."""

from __future__ import annotations

import re
import signal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.app.engine import ReferenceEngine
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig
from kvtier.core import NullCache
from kvtier.errors import ConfigError, ServiceProtocolError
from kvtier.hashing import owner_tag
from kvtier.l3.page import tag_of
from kvtier.pools.device import DevicePool
from kvtier.service.index import HostIndex
from kvtier.service.messages import parse_op
from kvtier.service.tenants import NAMESPACE_OWNER, SHARED_OWNER, RegionBounds, RegionTenants, owner_id, owner_label
from support.service import query_status_of, running_service, scrape_metrics, start_service, stop, wait_until
from support.tenants import MODEL, PS, SPEC, prompt, same_as_recompute

A, B = owner_id("aaaaaaaaaaaaaaaa"), owner_id("bbbbbbbbbbbbbbbb")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _index(pages: int, clock=None, **bounds) -> HostIndex:
    index = HostIndex(pages, tenants=RegionTenants(RegionBounds(**bounds)), clock=clock or Clock())
    index.attach(1, "ns")
    index.attach(2, "ns")
    return index


def _write(index: HostIndex, client: int, owner: int, keys: list[bytes], release: bool = True) -> list[int]:
    pages = index.reserve(client, len(keys))
    indexed = index.publish(client, pages, keys[: len(pages)], [owner] * len(pages))
    if release:
        index.release(client, pages)
    index.check_integrity()
    return indexed


def _keys(stem: int, n: int) -> list[bytes]:
    return [(stem * 1000 + i).to_bytes(8, "big") for i in range(n)]


def _row(index: HostIndex, owner: int):
    return next(r for r in index.tenants.rows if r.owner == owner)


# ---- the index's rules -----------------------------------------------------------------------------
@pytest.mark.parametrize("guarantee", [0, 6])
def test_a_reservation_never_evicts_a_tenant_below_its_guarantee(guarantee):
    index = _index(16, guaranteed_pages=guarantee)
    mine = _keys(1, 8)
    _write(index, 1, A, mine)
    for stem in range(2, 12):  # B floods the region, eight new pages at a time
        _write(index, 2, B, _keys(stem, 8))
    kept = [k for k in mine if index.has("ns", k)]
    assert len(kept) == guarantee and kept == mine[len(mine) - guarantee :]  # (its most recently released kept)
    assert _row(index, A).pages == guarantee and _row(index, A).evicted_pages == 8 - guarantee
    assert _row(index, B).pages == 16 - guarantee
    assert index.lookup(1, kept) == [index._page_of[("ns", k)] for k in kept]


def test_a_tenant_at_its_cap_replaces_its_own_oldest_pages_and_a_page_past_it_with_none_to_evict_is_not_offered():
    index = _index(32, max_pages=4)
    _write(index, 2, B, _keys(9, 3))
    _write(index, 1, A, _keys(1, 4))
    _write(index, 1, A, _keys(2, 2))  # two of A's oldest make room
    assert [index.has("ns", k) for k in _keys(1, 4) + _keys(2, 2)] == [False, False, True, True, True, True]
    assert _row(index, A).pages == 4 and _row(index, A).evicted_pages == 2 and _row(index, B).pages == 3
    held = index.lookup(1, _keys(1, 4)[2:] + _keys(2, 2))  # A holds all four: none of its own to evict
    assert len(held) == 4
    free = index.alloc.num_free
    indexed = _write(index, 1, A, _keys(3, 2))
    assert indexed == [] and _row(index, A).capped_pages == 2 and not index.has("ns", _keys(3, 1)[0])
    assert index.alloc.num_free == free and _row(index, A).pages == 4  # (the two pages freed at release: nothing leaked)
    shared = _write(index, 1, SHARED_OWNER, _keys(4, 6))  # the shared scope is never capped
    unlabelled = _write(index, 1, NAMESPACE_OWNER, _keys(5, 6))  # nor the namespace's own (no tenant's, an L3 load's)
    assert len(shared) == len(unlabelled) == 6


def test_a_page_nobody_holds_for_the_ttl_leaves_and_a_held_one_stays():
    clock = Clock()
    index = _index(16, clock, ttl_s=10.0)
    _write(index, 1, A, _keys(1, 3))
    kept = index.lookup(2, _keys(2, 0))  # (nothing)
    _write(index, 1, B, _keys(2, 2), release=False)  # held by its writer
    clock.now += 9.0
    assert index.expire() == 0
    clock.now += 2.0
    assert index.expire() == 3 and index.expired_pages == 3 and index.evicted_pages == 0
    assert _row(index, A).expired_pages == 3 and _row(index, A).pages == 0 and _row(index, B).pages == 2
    assert kept == [] and all(index.has("ns", k) for k in _keys(2, 2))
    index.check_integrity()


def test_hits_are_counted_per_tenant_and_rows_past_the_limit_share_their_namespaces_unbounded_overflow_row():
    index = HostIndex(64, tenants=RegionTenants(RegionBounds(max_pages=3), max_rows=3))
    for client, ns in ((1, "y"), (2, "z")):
        index.attach(client, ns)
    owners = [owner_id(f"{i:016x}") for i in range(3, 9)]
    for i, owner in enumerate(owners):
        _write(index, 1, owner, _keys(i, 2))
    for i, owner in enumerate(owners[:2]):
        _write(index, 2, owner, _keys(10 + i, 4))  # another namespace's tenants: its own overflow row
    rows = index.tenants.rows
    assert [(r.namespace, owner_label(r.owner)) for r in rows] == \
        [("y", f"{3:016x}"), ("y", f"{4:016x}"), ("y", f"{5:016x}"), ("y", "overflow"), ("z", "overflow")]
    # (an overflow row is many tenants': no cap, so no tenant there evicts another's pages)
    assert [r.pages for r in rows] == [2, 2, 2, 6, 8] and not any(r.evicted_pages for r in rows)
    index.lookup(1, _keys(0, 2))
    assert rows[0].hit_pages == 2 and sum(r.hit_pages for r in rows) == 2
    shown, rest = index.tenants.usage(str, limit=2)  # (--status and the metrics: the rows holding the most pages)
    assert [(r["namespace"], r["tenant"], r["pages"]) for r in shown] == [("z", "overflow", 8), ("y", "overflow", 6)]
    assert rest == 3 and shown[0]["max_pages"] is None and index.tenants.usage(str)[0][0]["max_pages"] == 3


def test_a_cap_lowered_across_a_restart_is_reached_at_the_tenants_next_publish():
    index = HostIndex(32, tenants=RegionTenants(RegionBounds(max_pages=4)))
    index.adopt([(p, "ns", k, A) for p, k in enumerate(_keys(1, 8))], [])  # (the killed service's cap was higher)
    index.release_adopted()
    index.attach(1, "ns")
    assert _write(index, 1, A, _keys(2, 1)) and _row(index, A).pages == 4
    assert sum(index.has("ns", k) for k in _keys(1, 8)) == 3


def test_a_finds_objects_are_not_counted_as_the_tenants_hit_pages():
    index = HostIndex(8, pools=2, tenants=RegionTenants(RegionBounds(accounting=True)))
    index.attach(1, "ns")
    index.attach(2, "ns")
    pages = index.reserve(1, 3, 1)
    index.publish(1, pages, _keys(2, 3), [A] * 3)
    index.release(1, pages)
    assert sum(p >= 0 for p in index.find(2, _keys(2, 3), 1)) == 3
    assert index.found_objects == 3 and _row(index, A).hit_pages == 0


def test_an_owner_label_crosses_the_wire_only_as_an_engine_makes_one():
    op = {"op": "publish", "pages": [1, 2], "keys": ["00", "01"], "owners": ["0123456789abcdef", "shared"]}
    assert parse_op(op).owners == [0x0123456789ABCDEF, SHARED_OWNER]
    assert parse_op(op).wire()["owners"] == op["owners"]
    for bad in (["alice", "shared"], ["0123456789ABCDEF", "shared"], [7, "shared"], ["0" * 17, "shared"], ["\x1b[2J", "shared"]):
        with pytest.raises(ServiceProtocolError, match="owner label"):
            parse_op(op | {"owners": bad})
    with pytest.raises(ServiceProtocolError, match="one owner per page"):
        parse_op(op | {"owners": ["shared"]})
    with pytest.raises(ConfigError, match="above --tenant-max-host-pages"):
        RegionBounds(guaranteed_pages=5, max_pages=4)


class IndexWithTenants(RuleBasedStateMachine):
    """Random writes, lookups, releases, detaches and clock steps of three tenants on two clients under a guarantee,
    a cap and a TTL: after each step the rows equal the pages (``check_integrity``), no tenant is past its cap, a
    reservation took no tenant below its guarantee, and nothing unheld outlived the TTL."""

    GUARANTEE, CAP, TTL = 3, 8, 5.0

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.index = HostIndex(20, tenants=RegionTenants(RegionBounds(self.GUARANTEE, self.CAP, self.TTL)), clock=self.clock)
        self.attached = set()
        self.next_key = 0

    def _client(self, c: int) -> int:
        if c not in self.attached:
            self.index.attach(c, "ns")
            self.attached.add(c)
        return c

    @rule(c=st.sampled_from([1, 2]), owner=st.sampled_from([A, B, NAMESPACE_OWNER]), n=st.integers(1, 6), release=st.booleans())
    def write(self, c, owner, n, release):
        c = self._client(c)
        before = {r.owner: r.pages for r in self.index.tenants.rows}
        pages = self.index.reserve(c, n)
        after = {r.owner: r.pages for r in self.index.tenants.rows}
        tenants = [o for o in before if o not in (NAMESPACE_OWNER, SHARED_OWNER)]  # (the namespace's own: no tenant's, unbounded)
        assert all(after[o] >= min(before[o], self.GUARANTEE) for o in tenants), (before, after)  # the guarantee
        keys = [(self.next_key + i).to_bytes(8, "big") for i in range(len(pages))]
        self.next_key += len(pages)
        self.index.publish(c, pages, keys, [owner] * len(pages))
        if release:
            self.index.release(c, pages)

    @rule(c=st.sampled_from([1, 2]), first=st.integers(0, 60), n=st.integers(1, 5))
    def lookup(self, c, first, n):
        self.index.lookup(self._client(c), [(first + i).to_bytes(8, "big") for i in range(n)])

    @precondition(lambda self: self.attached)
    @rule(data=st.data())
    def release_some(self, data):
        c = data.draw(st.sampled_from(sorted(self.attached)))
        held = list(self.index.clients[c].held)
        if held:
            self.index.release(c, data.draw(st.lists(st.sampled_from(held), unique=True, max_size=len(held))))

    @precondition(lambda self: self.attached)
    @rule(data=st.data())
    def detach(self, data):
        c = data.draw(st.sampled_from(sorted(self.attached)))
        self.index.detach(c)
        self.attached.discard(c)

    @rule(dt=st.floats(0.5, 4.0))
    def tick(self, dt):
        self.clock.now += dt
        self.index.expire()
        released = [t for order in self.index._unheld for t in order.values()]
        assert all(t > self.clock.now - self.TTL for t in released), "an unheld page outlived the TTL"

    @invariant()
    def rows_match_pages_and_bounds_hold(self):
        self.index.check_integrity()
        assert all(r.pages <= self.CAP for r in self.index.tenants.rows if r.owner not in (SHARED_OWNER, NAMESPACE_OWNER))


IndexWithTenants.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_the_index_keeps_its_tenant_rows_and_bounds_through_random_steps = IndexWithTenants.TestCase


# ---- a real service, real engines ------------------------------------------------------------------
def _engine(sock: str, host_pages: int = 64):
    cache = build_cache(SPEC, TierConfig(device_pages=16, host_pages=host_pages, service=sock), CacheConfig())
    return cache, ReferenceEngine(MODEL, cache)


def _prefill(cache, engine, base, tokens: list[int], tenant: str) -> int:
    r = engine.prefill(tokens, tenant=tenant)
    same_as_recompute(base, tokens, r)
    cache.wait_idle()
    cache.evict_device(cache.device.num_pages)  # (pushed to the region)
    cache.wait_idle()
    return r.hit_tokens


def _alice_prompts() -> list[list[int]]:
    return [prompt(100 + i, 3 * PS + 1) for i in range(4)]  # 12 full pages


def _flood_after_alice(sock: str, base) -> tuple[int, str]:
    """Alice's engine writes four prompts to the region and exits; Bob's floods it with new prompts; a new engine of
    Alice's asks for hers again. Returns its hit tokens and Alice's label."""
    cache, engine = _engine(sock, host_pages=16)
    try:
        for p in _alice_prompts():
            _prefill(cache, engine, base, p, "alice")
        label = cache.tenant_label("alice")
    finally:
        cache.close()
    cache, engine = _engine(sock, host_pages=16)
    try:
        for i in range(12):  # 12 prompts of 3 pages: more than the region's pages
            _prefill(cache, engine, base, prompt(500 + i, 3 * PS + 1), "bob")
    finally:
        cache.close()
    cache, engine = _engine(sock, host_pages=16)
    try:
        return sum(_prefill(cache, engine, base, p, "alice") for p in _alice_prompts()), label
    finally:
        cache.close()


def _region_gb(pages: int) -> str:
    return f"{pages * SPEC.page_bytes / (1 << 30):.9f}"


@pytest.mark.parametrize("guarantee", [12, 0], ids=["guaranteed", "not guaranteed"])
def test_engines_on_one_service_keep_a_tenants_guaranteed_pages_through_another_tenants_flood(tmp_path, guarantee):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    args = ["--tenant-host-pages", str(guarantee)] if guarantee else ["--tenant-accounting"]
    with running_service(tmp_path, _region_gb(40), *args, "--metrics-port", "0") as svc:
        hits, label = _flood_after_alice(svc.socket, base)
        status = query_status_of(svc.socket)()
        rows = {r["tenant"]: r for r in status["tenants"]}
        assert "alice" not in str(status["tenants"]) and "bob" not in str(status["tenants"])  # digests, never names
        assert status["tenants_not_shown"] == 0
        if guarantee:
            assert hits == 12 * PS, "every one of alice's pages must come back from the region"
            assert rows[label]["pages"] >= 12 and rows[label]["evicted_pages"] == 0, rows
            assert rows[label]["hit_pages"] >= 12
        else:  # (what the guarantee prevents)
            assert hits < 6 * PS and rows[label]["evicted_pages"] > 6, rows
        bob = [r for t, r in rows.items() if t != label and r["evicted_pages"]]
        assert bob and status["evicted_pages"] > 0
        url = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", svc.banner).group(1)
        m = scrape_metrics(url)
        who = tuple(sorted({"namespace": rows[label]["namespace"], "tenant": label}.items()))
        assert m[("kvtier_service_tenant_pages", who)] == rows[label]["pages"]
        assert m[("kvtier_service_tenant_evicted_pages_total", who)] == rows[label]["evicted_pages"]


def test_a_tenants_cap_holds_and_its_pages_keep_their_owner_across_a_service_kill(tmp_path):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock, 0.01, "--tenant-max-host-pages", "9", "--tenant-host-pages", "4")
    try:
        cache, engine = _engine(sock)
        try:
            for p in _alice_prompts():  # 12 pages against a cap of 9
                _prefill(cache, engine, base, p, "alice")
            label = cache.tenant_label("alice")
            row = {r["tenant"]: r for r in query_status_of(sock)()["tenants"]}[label]
            assert row["pages"] <= 9 and row["pages"] + row["evicted_pages"] + row["capped_pages"] >= 12, row
        finally:
            cache.close()
        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait(10)
        stop(svc.proc)
        svc = start_service(sock, 0.01, "--tenant-max-host-pages", "9")
        status = query_status_of(sock)()
        assert status["adopted"]["pages"] >= 1
        rows = {r["tenant"]: r for r in status["tenants"]}
        assert rows[label]["pages"] == status["adopted"]["pages"], rows  # every adopted page is alice's again
        cache, engine = _engine(sock)
        try:  # what the killed service's region gave back is alice's bytes, and to alice alone
            assert _prefill(cache, engine, base, _alice_prompts()[0], "mallory") == 0
            assert _prefill(cache, engine, base, _alice_prompts()[0], "alice") == 3 * PS
        finally:
            cache.close()
    finally:
        stop(svc.proc)


def test_pages_a_tenants_cap_leaves_out_of_the_region_are_still_written_through_to_the_services_l3(tmp_path):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    store = tmp_path / "l3"
    with running_service(tmp_path, 0.01, "--tenant-max-host-pages", "2", "--storage-url", f"file://{store}") as svc:
        cache, engine = _engine(svc.socket)
        try:
            for p in _alice_prompts():  # 12 pages against a cap of 2, all held by alice's engine
                _prefill(cache, engine, base, p, "alice")
            label = cache.tenant_label("alice")
        finally:
            cache.close()
        status, _s = wait_until(lambda: _saved(query_status_of(svc.socket)(), 12), 30.0)
        row = {r["tenant"]: r for r in status["tenants"]}[label]
        assert row["capped_pages"] >= 10 and status["l3"]["saved_pages"] == status["published_pages"] == 12
        tags = [tag_of(f.read_bytes()[:16]) for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")]
        assert tags == [owner_tag(label)] * 12, "the service's L3 objects must carry their tenant's owner tag"
        cache, engine = _engine(svc.socket)
        try:  # (the service loads them back from its L3 into the region)
            assert _prefill(cache, engine, base, _alice_prompts()[3], "alice") == 3 * PS
        finally:
            cache.close()


def test_the_services_file_l3_keeps_a_tenants_cap_by_the_tags_it_writes_and_says_so_in_its_status(tmp_path):
    from kvtier.l3.page import PageCodec

    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    store = tmp_path / "l3"
    cap = 6 * PageCodec.for_spec(SPEC).object_bytes
    with running_service(tmp_path, 0.01, "--storage-url", f"file://{store}?tenant_max_bytes={cap}", "--metrics-port", "0",
                         "--tenant-accounting") as svc:
        cache, engine = _engine(svc.socket)
        try:
            for p in _alice_prompts():  # 12 pages through the service's L3, against a cap of 6 objects there
                _prefill(cache, engine, base, p, "alice")
            label = cache.tenant_label("alice")
        finally:
            cache.close()
        wait_until(lambda: _saved(query_status_of(svc.socket)(), 12), 30.0)

        def objects() -> list[int]:
            tags = []
            for f in store.rglob("*"):
                try:
                    if f.is_file() and not f.name.startswith("."):
                        tags.append(tag_of(f.read_bytes()[:16]))
                except FileNotFoundError:  # (unlinked by a sweep meanwhile)
                    pass
            return tags

        obj = PageCodec.for_spec(SPEC).object_bytes

        def settled() -> tuple[dict, dict, list[int]] | None:
            """Her objects under her cap, and her row's l3_bytes theirs (a sweep for a cap waits a second after the last
            one: the store's sweeper brings her under it once she stops; it counts once every unlink is done)."""
            tags = objects()
            status = query_status_of(svc.socket)()
            row = {r["tenant"]: r for r in status["tenants"]}[label]
            return (status, row, tags) if len(tags) <= 6 and row["l3_bytes"] == len(tags) * obj else None

        (status, row, tags), _s = wait_until(settled, 10.0)
        assert tags == [owner_tag(label)] * len(tags)  # (her bytes in L3, under her digest)
        assert status["l3"]["capped_objects"] == 12 - len(tags) and status["l3"]["evicted_objects"] == 0
        m = scrape_metrics(re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", svc.banner).group(1))
        assert m[("kvtier_service_l3_store_capped_objects_total", ())] == status["l3"]["capped_objects"]
        who = tuple(sorted({"namespace": row["namespace"], "tenant": label}.items()))
        assert m[("kvtier_service_tenant_l3_bytes", who)] == row["l3_bytes"]


def _saved(status: dict, n: int) -> dict | None:
    return status if status["l3"]["saved_pages"] >= n else None


def _with_expired(status: dict, n: int) -> dict | None:
    return status if status["expired_pages"] >= n else None


def test_a_page_unused_past_the_services_ttl_leaves_the_region(tmp_path):
    base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
    with running_service(tmp_path, 0.01, "--tenant-ttl-s", "0.5", "--zero-evicted-pages") as svc:
        cache, engine = _engine(svc.socket)
        try:
            _prefill(cache, engine, base, _alice_prompts()[0], "alice")
            label = cache.tenant_label("alice")
        finally:
            cache.close()  # (its holds released: unused from now on)
        status, _s = wait_until(lambda: _with_expired(query_status_of(svc.socket)(), 3), 30.0)
        row = {r["tenant"]: r for r in status["tenants"]}[label]
        assert row["expired_pages"] == 3 and row["pages"] == 0 and status["zeroed_pages"] >= 3
        cache, engine = _engine(svc.socket)
        try:
            assert _prefill(cache, engine, base, _alice_prompts()[0], "alice") == 0
        finally:
            cache.close()
