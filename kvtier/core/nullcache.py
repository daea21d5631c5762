"""A prefix cache that caches nothing: the recompute baseline, behind the same API.

It is a real backend, not a mock: ``kvtier run`` replays every workload through
it to measure what recomputing everything costs, with the same engine code. It
serves :class:`~kvtier.core.request.CacheRequest` through the request's declared
face (:class:`~kvtier.core.request.RequestCache`) and keys nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.alloc import Allocation
from kvtier.core.request import CacheRequest
from kvtier.core.results import InsertResult, LoadResult, MatchResult
from kvtier.errors import UnknownNameError
from kvtier.metrics import CacheStats


class BaselineGroups:
    """A hybrid model's other groups in the baseline: their device pools by name (a request computes their
    objects too, freed at commit like its pages), nothing kept, so no object is wanted anywhere and no
    request is given one (what :class:`~kvtier.core.request.CacheRequest` asks of a cache's groups)."""

    __slots__ = ("pools",)
    components: tuple = ()

    def __init__(self, pools: dict):
        self.pools = pools

    def component(self, name: str):
        if name not in self.pools:
            raise UnknownNameError("KV group beside full attention", name, self.pools)
        return self.pools[name]

    def handed_places(self, name: str, first: int, pages: int, *, at_end: bool = True) -> Sequence[int]:
        self.component(name)
        return []

    def release(self, nodes) -> None:
        """(No request is ever given an object to hold.)"""


class NullCache:
    """``group_pools``: a hybrid model's other groups' device pools (by group name)."""

    def __init__(self, device_pool, group_pools: dict | None = None):
        self.device = device_pool
        self.spec = device_pool.spec
        self.dev_alloc = device_pool.allocator
        self.group_pools = dict(group_pools or {})
        self.groups = BaselineGroups(self.group_pools)
        self.stats = CacheStats()
        self.storage = None

    #: nothing is matched, so no request is ever given a group's objects
    components = ()
    #: no load ever fails here (nothing is loaded): a request's failed-load checks stay idle
    load_failure_gen = 0

    def match(self, tokens_or_keys: Sequence[int], *, count: bool = True, tenant: object = None) -> MatchResult:
        if count:
            self.stats.requests += 1
            self.stats.lookup_pages += len(tokens_or_keys) // self.spec.page_size
        return MatchResult([], [], [])

    def begin(self, tokens_or_keys: Sequence[int], *, usable_pages: int | None = None, prefetch: bool = True,
              prefetch_policy: str | None = None, tenant: object = None) -> CacheRequest:
        """A request with nothing cached (whoever's: ``tenant`` scopes nothing here): every page is computed, committed
        pages are freed."""
        self.match(tokens_or_keys)
        return CacheRequest(self, (), len(tokens_or_keys) // self.spec.page_size, 0, 0, 0, [], LoadResult(None, [], 0, 0), None)

    def unlock(self, node) -> None:
        pass

    def request_finished(self, serial: int) -> None:
        pass

    def quarantined_pages(self) -> set[int]:
        return set()

    def alloc_device(self, n: int) -> Allocation:
        return self.dev_alloc.alloc(n)

    def free_device(self, pages: list[int]) -> None:
        self.dev_alloc.free(pages)

    def commit_request(self, keys, device_pages: Sequence[int], prefix, groups=None, owner: int = 0) -> InsertResult:
        for name, ids in (groups or {}).items():
            self.free_group(name, [i for i in ids if i is not None])
        self.dev_alloc.free(list(device_pages))
        return InsertResult([], 0, list(device_pages), None)

    def alloc_group(self, name: str, n: int) -> list[int]:
        alloc = self.groups.component(name).allocator
        return alloc.alloc(min(n, alloc.num_free)).pages

    def free_group(self, name: str, ids: list[int]) -> None:
        if ids:
            self.groups.component(name).allocator.free(ids)

    def snapshot_boundaries(self, first: int, pages: int) -> list[int]:
        return []  # nothing is kept: no state snapshot is worth taking

    def wait_idle(self) -> None:
        pass

    def check_integrity(self, *a, **k) -> None:
        assert self.dev_alloc.num_used == 0, "recompute baseline leaked device pages"
        for name, pool in self.group_pools.items():
            assert pool.allocator.num_used == 0, f"recompute baseline leaked {name} objects"

    def close(self) -> None:
        pass
