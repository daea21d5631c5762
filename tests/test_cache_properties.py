"""Stateful property test: random insert/match/lock/unlock/evict/load sequences over small pools.

After every step the tree's accounting must match the allocators, no page may be
owned twice, locked pages keep their bytes, and every transfer is whole pages
(the pools' validation would raise otherwise; page-level APIs take page ids).
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from support.pools import tiny_specs
from support.cache_helpers import expected_page, make_cache, serve

PREFIXES = [list(range(0, 12)), list(range(0, 8)) + list(range(50, 58)), list(range(200, 216)), list(range(0, 4)) + [7] * 9]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.locked = []  # (match, tokens, number of device pages at lock time)

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        evict=st.sampled_from(["backup", "drop"]),
        kind=st.sampled_from(["mla", "dsa", "mha"]),
        layout=st.sampled_from(["layer_first", "page_first"]),
    )
    def start(self, policy, evict, kind, layout):
        spec = tiny_specs(page_size=4, num_layers=2)[kind]
        # 10 device pages: two locked matches (3 pages each) plus one request (up to 4 pages) always fit,
        # so serve_request's allocation can only fail if eviction is wrong (locked pages are never evictable)
        self.cache = make_cache(
            spec, dev_pages=10, host_pages=6, layout=layout, write_policy=policy, on_device_evict=evict, write_through_threshold=1
        )

    @rule(i=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 16))
    def serve_request(self, i, cut):
        toks = PREFIXES[i][:cut]
        serve(self.cache, toks)  # asserts every page's bytes equal what that prefix computes

    @rule(i=st.integers(0, len(PREFIXES) - 1))
    @precondition(lambda self: len(self.locked) < 2)
    def lock_match(self, i):
        m = self.cache.match(PREFIXES[i])
        self.cache.lock(m.last_node)
        self.locked.append((m, PREFIXES[i]))

    @rule()
    @precondition(lambda self: self.locked)
    def unlock(self):
        m, _ = self.locked.pop()
        self.cache.unlock(m.last_node)

    @rule(n=st.integers(1, 8))
    def evict_device(self, n):
        self.cache.evict_device(n)

    @rule(n=st.integers(1, 6))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @rule(i=st.integers(0, len(PREFIXES) - 1))
    def load(self, i):
        m = self.cache.match(PREFIXES[i])
        self.cache.lock(m.last_node)
        ld = self.cache.load_back(m)
        ld.wait()
        for j, page in enumerate(ld.device_pages):
            assert self.cache.device.page_bytes(page) == expected_page(self.cache.device, PREFIXES[i], j)
        self.cache.unlock(m.last_node)

    @invariant()
    def accounting(self):
        if self.cache is None:
            return
        self.cache.wait_idle()
        self.cache.check_integrity(idle=not self.locked)  # nothing locked: everything must be evictable
        for m, toks in self.locked:  # locked device pages stay resident and untouched
            path = list(m.last_node.path_to_root())[::-1] if m.last_node is not None else []
            assert [n.device_page for n in path[: len(m.device_pages)]] == m.device_pages
            for node in m.host_nodes:  # locked host pages are neither freed nor removed from the tree
                assert self.cache.tree.nodes.get(node.key) is node and (node.host_page != -1 or node.device_page != -1)
            for j, page in enumerate(m.device_pages):
                assert self.cache.device.page_bytes(page) == expected_page(self.cache.device, toks, j)

    def teardown(self):
        if self.cache is not None:
            self.cache.close()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
