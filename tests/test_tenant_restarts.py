"""Tenants across restarts (issue 56's stateful property test): random two- and three-tenant traces through
``kvtier run``'s reference engine, with the tiers pushed down, the engine restarted (a new cache over the same L3) and
the node service killed and started again, at random. After every step:

- no request hits, and no probe finds, more of a prompt than its own tenant served (or a declared shared prefix);
- every output equals a recompute (the bytes each tier gave back are the ones computed);
- a declared system prompt another tenant just computed is a hit.
"""

from __future__ import annotations

from contextlib import contextmanager

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import DevicePool
from kvtier.app.engine import ReferenceEngine
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import NullCache
from support.service import start_service, stop
from support.tenants import MODEL, PS, SPEC, prompt, same_as_recompute

SYSTEM = prompt(999, 2 * PS)  # two pages, declared shareable
SYSTEM_PAGES = len(SYSTEM) // PS

_OP = st.one_of(
    st.tuples(st.just("request"), st.sampled_from(["a", "b", "c"]), st.integers(0, 2), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("probe"), st.sampled_from(["a", "b", "c"]), st.integers(0, 2), st.integers(1, 4), st.booleans()),
    st.tuples(st.sampled_from(["push device", "push host", "restart engine"])),
    # two tenants' requests with the system prompt, back to back: the second hits it
    st.tuples(st.just("share"), st.sampled_from(["a", "b"]), st.sampled_from(["c", "d"]), st.integers(0, 2), st.integers(1, 3)),
)


def _tokens(stem: int, pages: int, system: bool) -> list[int]:
    if system:
        return SYSTEM + prompt(300 + stem, pages * PS) + [5]
    return prompt(100 + stem, pages * PS + 1)


class _Trace:
    """The engine under test, the history that bounds its hits, and the checks (see the module docstring)."""

    def __init__(self, make_cache):
        self.make_cache = make_cache
        self.base = ReferenceEngine(MODEL, NullCache(DevicePool(SPEC, 64)))
        self.served: dict[tuple[str, int, bool], int] = {}  # (tenant, stem, system) -> most pages of it served
        self.system_served = False
        self.last_system_tenant: str | None = None  # the tenant of the step before, if it computed the system prompt
        self.cache = None
        self.start_engine()

    def start_engine(self) -> None:
        if self.cache is not None:
            self.cache.wait_idle()
            self.cache.close()
        self.cache = self.make_cache()
        self.cache.share_prefix(SYSTEM)  # (an operator declares it at every start)
        self.engine = ReferenceEngine(MODEL, self.cache)
        self.last_system_tenant = None

    def bound(self, tenant: str, stem: int, pages: int, system: bool) -> int:
        own = min(self.served.get((tenant, stem, system), 0), pages)
        return own + (SYSTEM_PAGES if system and self.system_served else 0)

    def request(self, tenant: str, stem: int, pages: int, system: bool) -> None:
        toks = _tokens(stem, pages, system)
        r = self.engine.prefill(toks, tenant=tenant)
        same_as_recompute(self.base, toks, r)
        assert r.hit_tokens <= self.bound(tenant, stem, pages, system) * PS, (tenant, stem, pages, system, r.hit_tokens)
        if system and self.last_system_tenant not in (None, tenant):
            assert r.hit_tokens >= SYSTEM_PAGES * PS, "a declared shared prefix another tenant just computed must hit"
        key = (tenant, stem, system)
        self.served[key] = max(self.served.get(key, 0), pages)
        self.system_served |= system
        self.last_system_tenant = tenant if system else None
        self.cache.wait_idle()

    def probe(self, tenant: str, stem: int, pages: int, system: bool) -> None:
        m = self.cache.match(_tokens(stem, pages, system), tenant=tenant)
        found = len(m.nodes) + m.num_storage_pages
        assert found <= self.bound(tenant, stem, pages, system), (tenant, stem, pages, system, found)

    def push(self, tier: str) -> None:
        self.cache.wait_idle()
        self.cache.evict_device(self.cache.device.num_pages)
        if tier == "host":
            self.cache.evict_host(self.cache.host.num_pages)
        self.last_system_tenant = None

    def run(self, ops) -> None:
        for op in ops:
            if op[0] == "request":
                self.request(*op[1:])
            elif op[0] == "probe":
                self.probe(*op[1:])
            elif op[0] == "share":
                _, first, second, stem, pages = op
                self.request(first, stem, pages, True)
                self.request(second, stem, pages, True)  # (checked: it hits the system prompt)
            elif op[0] == "restart engine":
                self.start_engine()
            else:
                self.push(op[0].split()[1])
        self.cache.wait_idle()
        self.cache.check_integrity()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=4, max_size=16).filter(lambda ops: any(op[0] == "share" for op in ops)))
def test_tenants_stay_apart_across_engine_restarts_over_one_l3(tmp_path_factory, ops):
    store = tmp_path_factory.mktemp("l3")
    trace = _Trace(lambda: build_cache(SPEC, TierConfig(device_pages=12, host_pages=16), CacheConfig(), StorageConfig(url=f"file://{store}")))
    try:
        trace.run(ops)
    finally:
        trace.close()


@contextmanager
def _service(sock: str):
    holder = {"svc": start_service(sock)}
    try:
        yield holder
    finally:
        stop(holder["svc"].proc)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(_OP, st.tuples(st.just("restart service"))), min_size=4, max_size=14))
def test_tenants_stay_apart_on_the_node_service_across_its_restarts_and_the_engines(tmp_path_factory, ops):
    """The host tier is a ``kvtier serve``'s region, shared with every engine of the namespace: killed (SIGKILL) and
    started again at random, the engine restarted at random; an engine after a restart finds the region its
    predecessor filled."""
    sock = str(tmp_path_factory.mktemp("svc") / "node.sock")
    with _service(sock) as holder:
        trace = _Trace(lambda: build_cache(SPEC, TierConfig(device_pages=12, host_pages=16, service=sock), CacheConfig()))
        try:
            plain = []
            for op in ops:
                if op[0] == "restart service":
                    trace.run(plain)
                    plain = []
                    holder["svc"].proc.kill()
                    holder["svc"].proc.wait(10)
                    holder["svc"] = start_service(sock)
                    trace.last_system_tenant = None
                else:
                    plain.append(op)
            trace.run(plain)
        finally:
            trace.close()
