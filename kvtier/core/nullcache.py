"""A prefix cache that caches nothing: the recompute baseline, behind the same API.

It is a real backend, not a mock: ``kvtier run`` replays every workload through
it to measure what recomputing everything costs, with the same engine code.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.alloc import Allocation
from kvtier.core.request import CacheRequest
from kvtier.core.results import InsertResult, LoadResult, MatchResult
from kvtier.metrics import CacheStats


class NullCache:
    def __init__(self, device_pool):
        self.device = device_pool
        self.spec = device_pool.spec
        self.dev_alloc = device_pool.allocator
        self.stats = CacheStats()
        self.storage = None
        #: no load ever fails here (nothing is loaded): the request's failed-load checks stay idle
        self.load_failure_gen = 0

    def match(self, tokens_or_keys: Sequence[int], *, count: bool = True) -> MatchResult:
        if count:
            self.stats.requests += 1
            self.stats.lookup_pages += len(tokens_or_keys) // self.spec.page_size
        return MatchResult([], [], [])

    def begin(self, tokens_or_keys: Sequence[int], *, usable_pages: int | None = None, prefetch: bool = True,
              prefetch_policy: str | None = None) -> CacheRequest:
        """A request with nothing cached: every page is computed, committed pages are freed."""
        m = self.match(tokens_or_keys)
        full = len(tokens_or_keys) // self.spec.page_size
        return CacheRequest(self, [None] * full, 0, 0, 0, [], self.load_back(m), None)  # keys are never looked at

    def lock(self, node) -> None:
        pass

    unlock = lock

    def prefetch(self, match: MatchResult) -> None:
        return None

    def resolve_prefetch(self, handle, policy: str | None = None) -> int:
        return 0

    def load_back(self, match: MatchResult) -> LoadResult:
        return LoadResult(None, [], 0, 0)

    def request_finished(self, serial: int) -> None:
        pass

    def quarantined_pages(self) -> set[int]:
        return set()

    def alloc_device(self, n: int) -> Allocation:
        return self.dev_alloc.alloc(n)

    def free_device(self, pages: list[int]) -> None:
        self.dev_alloc.free(pages)

    def insert(self, tokens_or_keys, device_pages: Sequence[int]) -> InsertResult:
        self.dev_alloc.free(list(device_pages))
        return InsertResult([], 0, list(device_pages), None)

    def commit_request(self, keys, device_pages: Sequence[int], prefix, groups=None) -> InsertResult:
        return self.insert(keys, device_pages)

    def wait_idle(self) -> None:
        pass

    def check_integrity(self, *a, **k) -> None:
        assert self.dev_alloc.num_used == 0, "recompute baseline leaked device pages"

    def close(self) -> None:
        pass
