"""Tenants in vLLM's KV event stream, across restarts (issue 56's stateful property test, its events): random
two- and three-tenant traces through the connector's scheduler side and two ranks (no engine: vLLM's step protocol
driven as vLLM drives it), over one file L3, with the engine restarted, host memory evicting and the store losing
objects at random. A tenant is a request's ``cache_salt``; its blocks' hashes are vLLM's, salted, as a router knows
them. After every step:

- no request hits, and no lookup finds, more of a prompt than its own tenant served (the same token ids are every
  tenant's prompts);
- every event a request's own work causes names its own tenant's blocks only: what its copies out stored (host,
  L3), and what its lookup found gone from the store; host evictions name blocks stored before, of any tenant;
- nothing is reported twice: a block is removed only after it was reported stored, once.
"""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.hashing import hasher, page_keys, request_scope, scoped_root
from support.vllm_split import BS, Engine, finish, request

TENANTS = ("a", "b", "c")
PAGES = 3  # full blocks a prompt has (and a partial tail)

_OP = st.one_of(
    st.tuples(st.just("request"), st.sampled_from(TENANTS), st.integers(0, 2)),
    st.tuples(st.just("probe"), st.sampled_from(TENANTS), st.integers(0, 2)),
    st.tuples(st.just("lose"), st.sampled_from(TENANTS), st.integers(0, 2), st.integers(0, PAGES - 1)),
    st.tuples(st.just("restart")),
)


def _tokens(stem: int) -> list[int]:
    return list(range(1000 * (stem + 1), 1000 * (stem + 1) + PAGES * BS + 2))


def _block_hashes(tenant: str, tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of a salted request: chained, the salt in the first block's (as vLLM folds cache_salt in)."""
    out, parent = [], tenant.encode()
    for i in range(len(tokens) // BS):
        parent = hashlib.blake2b(parent + repr(tokens[i * BS : (i + 1) * BS]).encode(), digest_size=32).digest()
        out.append(parent)
    return out


class _Trace:
    def __init__(self, url: str, store):
        self.url, self.store = url, store
        self.served: dict[tuple[str, int], int] = {}  # (tenant, stem) -> pages served (an upper bound on what it may hit)
        self.owner: dict[object, str] = {}  # a block hash as an event carries it -> its tenant
        self.on_host: set = set()
        self.in_storage: set = set()
        self.n = 0
        self.last_events: list = []
        self.eng = None
        self.restart()

    def restart(self) -> None:
        if self.eng is not None:
            self.eng.settle()
            self.check_events(None)
            self.eng.close()
        self.eng = Engine(self.url, seed=len(self.served), host_pages=4)
        self.on_host = set()  # (a new scheduler: nothing of it on host; what it reported stored in L3 it does not know)
        self.in_storage = set()

    def _request(self, tenant: str, stem: int):
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self.n += 1
        req = request(f"{tenant}{stem}-{self.n}", _tokens(stem))
        req.cache_salt = tenant
        req.block_hashes = _block_hashes(tenant, req.prompt_token_ids)
        for h in req.block_hashes:
            self.owner[maybe_convert_block_hash(h)] = tenant
        return req

    def lookup(self, tenant: str, stem: int, *, schedule: bool) -> None:
        req = self._request(tenant, stem)
        external, _ = self.eng.scheduler.get_num_new_matched_tokens(req, 0)
        assert external <= self.served.get((tenant, stem), 0) * BS, (tenant, stem, external, self.served)
        self.check_events(tenant, lookup=True)
        if schedule:
            self.eng.scheduler.update_state_after_alloc(req, external)
            req.num_computed_tokens = external
            self.eng.step(new=[(req, [0, 1, 2, 3], len(req.prompt_token_ids) - external)])
            finish(self.eng, req)
            self.eng.settle()
            self.served[(tenant, stem)] = PAGES
            self.check_events(tenant)
        else:  # (asked and never scheduled: vLLM finishes it, as an aborted waiting request)
            self.eng.scheduler.request_finished(req)

    def lose(self, tenant: str, stem: int, page: int) -> None:
        """The store loses one of ``tenant``'s objects on its own (a cap, maxmemory): on one rank is on every rank."""
        root = scoped_root(self.eng.scheduler._root, request_scope(tenant, None), hasher(self.eng.options.cache.hash_algo))
        key = page_keys(_tokens(stem), BS, root, self.eng.options.cache.hash_algo)[page]
        for f in self.store.rglob(key.hex()):
            f.unlink()
            break

    def check_events(self, tenant: str | None, lookup: bool = False) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self.last_events = self.eng.scheduler.events.take()
        for e in self.last_events:
            owners = {self.owner[h] for h in e.block_hashes}
            if isinstance(e, BlockStored):
                assert not lookup and owners == {tenant}, (e, owners, tenant)  # its own copies out, nothing else
                (self.on_host if e.medium == "CPU" else self.in_storage).update(e.block_hashes)
            else:
                assert isinstance(e, BlockRemoved)
                if e.medium == "STORAGE":  # what its own lookup found gone: its own blocks
                    assert owners == {tenant}, (e, owners, tenant)
                    assert set(e.block_hashes) <= self.in_storage, "removed from L3 without being reported stored there"
                    self.in_storage.difference_update(e.block_hashes)
                else:
                    assert set(e.block_hashes) <= self.on_host, "removed from host without being reported stored there"
                    self.on_host.difference_update(e.block_hashes)

    def run(self, ops) -> None:
        for op in ops:
            if op[0] == "request":
                self.lookup(*op[1:], schedule=True)
            elif op[0] == "probe":
                self.lookup(*op[1:], schedule=False)
            elif op[0] == "lose":
                self.lose(*op[1:])
            else:
                self.restart()
        self.eng.scheduler.core.check_integrity()

    def close(self) -> None:
        self.eng.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=4, max_size=16))
def test_vllm_events_and_lookups_name_only_the_requesting_tenants_blocks_across_restarts(tmp_path_factory, ops):
    store = tmp_path_factory.mktemp("l3")
    trace = _Trace(f"file://{store}", store)
    try:
        trace.run(ops)
    finally:
        trace.close()


def test_a_tenant_whose_object_the_store_lost_is_told_and_another_tenants_lookup_of_the_same_prompt_is_not(tmp_path):
    """The case the property test must be able to reach: a's prompt stored in L3 and evicted from host, one of a's
    objects lost; b's lookup of the same token ids finds nothing and reports nothing; a's reports its own block gone."""
    store = tmp_path / "l3"
    trace = _Trace(f"file://{store}", store)
    try:
        trace.run([("request", "a", 0), ("request", "b", 1), ("request", "c", 2)])  # (a's pages leave the 4-page host)
        a_blocks = _block_hashes("a", _tokens(0))
        assert not trace.on_host & set(map(_external, a_blocks)) and set(map(_external, a_blocks)) <= trace.in_storage
        trace.run([("lose", "a", 0, 1), ("probe", "b", 0)])
        assert trace.last_events == []
        trace.run([("probe", "a", 0)])
        assert [(type(e).__name__, e.medium, e.block_hashes) for e in trace.last_events] == \
            [("BlockRemoved", "STORAGE", [_external(a_blocks[1])])]
    finally:
        trace.close()


def _external(block_hash: bytes):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)
