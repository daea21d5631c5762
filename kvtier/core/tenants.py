"""Tenants' quotas in the host tier, and what each tenant holds, hits and loses there.

Every tree node carries its *owner*: a small id per tenant scope (the scope of the request that made
it, :func:`~kvtier.hashing.tenant_scope`; 0 the namespace's own, 1 a declared shared prefix's pages).
The tree counts host pages per owner (:attr:`~kvtier.radix.PrefixTree.host_by_owner`), and a
:class:`TenantQuota` per tenant bounds them:

* ``guaranteed_host_pages``: another tenant's writes never evict a tenant's host pages below this;
  its own writes may (its LRU, as before);
* ``max_host_pages``: a tenant at its cap makes room from its own least recently used pages first;
  what still does not fit gets no host copy (recomputed or read from L3 later);
* ``ttl_s``: a host page the tenant has not used for this long leaves the host tier (at the next
  request, within an eighth of the TTL), never written back to L3 on the way.

Host pages other engines share (the node service's region) are counted as this engine holds them.
Each owner's L3 tag (:attr:`TenantLedger.tags`) marks the page objects it saves, so a store that evicts on its own
(the file store) can bound each tenant there (docs/tenants.md).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import CacheConfig, check_number
from kvtier.errors import ConfigError
from kvtier.hashing import NAMESPACE_TAG, SHARED_TAG, owner_tag

#: the owner id of pages keyed in the namespace's own scope (no tenant), and of a declared shared prefix's pages
NAMESPACE_OWNER, SHARED_OWNER = 0, 1
#: tenants counted apart; more share one id (:data:`OVERFLOW_OWNER`): hostile tenant ids cannot grow the ledger without bound
MAX_TENANTS = 1 << 16
OVERFLOW_OWNER = MAX_TENANTS
_SHARED_SCOPE = object()


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's bounds in the host tier (see the module docstring); the defaults bound nothing."""

    guaranteed_host_pages: int = 0
    max_host_pages: int | None = None
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        check_number(self, "guaranteed_host_pages", at_least=0, integer=True)
        check_number(self, "max_host_pages", at_least=0, integer=True)
        check_number(self, "ttl_s", above=0)
        if self.max_host_pages is not None and self.guaranteed_host_pages > self.max_host_pages:
            raise ConfigError(f"TenantQuota: guaranteed_host_pages={self.guaranteed_host_pages} is above max_host_pages="
                              f"{self.max_host_pages}; a tenant cannot be guaranteed more than it may hold")

    @classmethod
    def from_config(cls, config: CacheConfig) -> TenantQuota:
        return cls(config.tenant_host_pages, config.tenant_max_host_pages, config.tenant_ttl_s)


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's row of :meth:`TenantLedger.usage`: ``tenant`` is its digest, never its name."""

    tenant: str
    host_pages: int
    guaranteed_host_pages: int
    max_host_pages: int | None
    ttl_s: float | None
    lookup_pages: int
    hit_pages: int
    #: its host pages evicted to make room (its own writes' or another's above its guarantee)
    evicted_pages: int
    #: its host pages that outlived ``ttl_s``
    expired_pages: int
    #: host copies not made because it was at ``max_host_pages``
    capped_pages: int


class TenantLedger:
    """Owner ids, quotas and per-tenant counters of one cache (see the module docstring). ``digest``: the label of
    a tenant scope (a digest: a label must not carry a tenant's name); ``clock``: seconds, for TTLs."""

    _COUNTERS = ("lookup_pages", "hit_pages", "evicted_pages", "expired_pages", "capped_pages")

    def __init__(self, default: TenantQuota, digest: Callable[[bytes], str], clock: Callable[[], float] = time.monotonic):
        self.default = default
        self._digest = digest
        self._clock = clock
        self._ids: dict[object, int] = {b"": NAMESPACE_OWNER, _SHARED_SCOPE: SHARED_OWNER}
        self.labels: list[str] = ["namespace", "shared"]
        #: each owner's tag in its L3 page objects (:func:`~kvtier.hashing.owner_tag`)
        self.tags: list[int] = [NAMESPACE_TAG, SHARED_TAG]
        self.quotas: list[TenantQuota] = [default, TenantQuota()]
        #: host pages per owner: the tree's :attr:`~kvtier.radix.PrefixTree.host_by_owner` (one list)
        self.host: list[int] = [0, 0]
        self.counters = {name: [0, 0] for name in self._COUNTERS}
        self._overrides: dict[bytes, TenantQuota] = {}
        # TTLs: (time, tree stamp) pairs, a page used before a pair's stamp was used before its time
        self._times: list[float] = []
        self._stamps: list[int] = []
        self._next_sweep = 0.0
        self._thin_at = 64
        #: how many tenants have each TTL (a few distinct values: the shortest and longest read per lookup)
        self._ttls: dict[float, int] = {}
        self._with_ttl(default, 1)

    def owner(self, scope: bytes) -> int:
        """The owner id of a tenant scope (a new one the first time it is seen, up to :data:`MAX_TENANTS`)."""
        got = self._ids.get(scope)
        if got is not None:
            return got
        if len(self.labels) >= MAX_TENANTS:
            if len(self.labels) == MAX_TENANTS:
                self._add("overflow", self.default)
            return OVERFLOW_OWNER
        got = self._add(self._digest(scope), self._overrides.get(scope, self.default))
        self._ids[scope] = got
        return got

    def _with_ttl(self, quota: TenantQuota, n: int) -> None:
        if quota.ttl_s is not None:
            left = self._ttls.get(quota.ttl_s, 0) + n
            if left:
                self._ttls[quota.ttl_s] = left
            else:
                del self._ttls[quota.ttl_s]

    def _add(self, label: str, quota: TenantQuota) -> int:
        self._with_ttl(quota, 1)
        self.labels.append(label)
        self.tags.append(owner_tag(label))
        self.quotas.append(quota)
        self.host.append(0)
        for values in self.counters.values():
            values.append(0)
        return len(self.labels) - 1

    def set_quota(self, scope: bytes, quota: TenantQuota) -> None:
        """``quota`` for the tenant of ``scope`` from now on (its pages held already stay until evicted)."""
        if not isinstance(quota, TenantQuota):
            raise ConfigError(f"a tenant's quota is a TenantQuota; got {type(quota).__name__}")
        self._overrides[scope] = quota  # (the namespace's own scope too: a tenant of its own, never every new one's default)
        got = self._ids.get(scope)
        if got is not None:
            self._with_ttl(self.quotas[got], -1)
            self._with_ttl(quota, 1)
            self.quotas[got] = quota

    def count(self, name: str, owner: int, n: int) -> None:
        self.counters[name][owner] += n

    def looked_up(self, owner: int, pages: int, hit: int, stamp: int) -> None:
        """A lookup of ``owner``'s: ``pages`` asked, ``hit`` of them found; ``stamp``: the tree's clock after its touch."""
        self.counters["lookup_pages"][owner] += pages
        self.counters["hit_pages"][owner] += hit
        self.note_use(stamp)

    def count_nodes(self, name: str, nodes) -> None:
        values = self.counters[name]
        for node in nodes:
            values[node.owner] += 1

    # ---- the quotas ----------------------------------------------------------------------------
    def allowed_for(self, writers: int | frozenset[int]) -> Callable[[object], bool]:
        """The victims room for ``writers``' pages (an owner id, or several: a run of pages of several tenants) may take,
        asked in the order they are taken: theirs, and another tenant's only while it stays above its guarantee."""
        host, quotas, taken = self.host, self.quotas, {}
        mine = writers if isinstance(writers, frozenset) else frozenset((writers,))

        def allowed(node) -> bool:
            o = node.owner
            if o in mine:
                return True
            t = taken.get(o, 0)
            if host[o] - t <= quotas[o].guaranteed_host_pages:
                return False
            taken[o] = t + 1
            return True

        return allowed

    def over_cap(self, owner: int, n: int) -> int:
        """Of ``n`` more host pages for ``owner``, how many would put it past its cap."""
        cap = self.quotas[owner].max_host_pages
        return 0 if cap is None else max(0, self.host[owner] + n - cap)

    def room_under_cap(self, owner: int) -> int | None:
        cap = self.quotas[owner].max_host_pages
        return None if cap is None else max(0, cap - self.host[owner])

    # ---- lifetimes -----------------------------------------------------------------------------
    @property
    def has_ttl(self) -> bool:
        return bool(self._ttls)

    def note_use(self, stamp: int) -> None:
        """After a lookup's pages were stamped: every page of a stamp up to ``stamp`` was used by now."""
        if self._ttl_step is not None:
            self._record(self._clock(), stamp)

    def _record(self, now: float, stamp: int) -> None:
        """Keep a (time, stamp) pair about every ``_ttl_step`` seconds, the newest always current: it moves forward
        while it stays within a step of the one before, else a new one starts. Older pairs are thinned to a spacing of
        a sixteenth of their age (:meth:`_thin`): a pair is needed near ``now - ttl`` to a fraction of that TTL."""
        times, stamps = self._times, self._stamps
        if len(times) >= 2 and now - times[-2] < self._ttl_step:
            times[-1], stamps[-1] = now, stamp
            return
        times.append(now)
        stamps.append(stamp)
        cut = bisect_right(times, now - self._longest_ttl) - 1  # keep the newest pair older than every TTL
        if cut > 0:
            del times[:cut], stamps[:cut]
        if len(times) > self._thin_at:
            self._thin(now)

    def _thin(self, now: float) -> None:
        """Drop pairs closer to a newer kept one than a sixteenth of their age (the oldest and newest always stay).
        Fewer pairs only make an expiry later, never earlier: a page's bound is the newest pair at least a TTL old."""
        times, stamps = self._times, self._stamps
        keep = [len(times) - 1]
        for i in range(len(times) - 2, 0, -1):
            if times[keep[-1]] - times[i] >= max(self._ttl_step, (now - times[i]) / 16):
                keep.append(i)
        keep.append(0)
        keep.reverse()
        self._times, self._stamps = [times[i] for i in keep], [stamps[i] for i in keep]
        self._thin_at = max(64, 2 * len(keep))

    @property
    def _ttl_step(self) -> float | None:
        return min(max(min(self._ttls) / 8, 0.001), 1.0) if self._ttls else None

    @property
    def _longest_ttl(self) -> float:
        return max(self._ttls)

    def expiry(self, stamp: int) -> tuple[Callable[[object], bool], int] | None:
        """Called before each lookup with the tree's clock: whether a sweep is due now, as the predicate of the
        host pages that outlived their tenant's TTL and a stamp every one of them is older than (None: none due).
        A page expires at the first lookup a step (an eighth of the shortest TTL, at most 1 s) past its TTL."""
        step = self._ttl_step
        if step is None:
            return None
        now = self._clock()
        self._record(now, stamp)
        if now < self._next_sweep:
            return None
        self._next_sweep = now + step
        bounds = []
        for q in self.quotas:
            i = -1 if q.ttl_s is None else bisect_right(self._times, now - q.ttl_s) - 1
            bounds.append(self._stamps[i] if i >= 0 else -1)  # stamps up to this one were used ttl seconds ago or more
        if max(bounds) < 0:
            return None
        return (lambda node: node.last_access <= bounds[node.owner]), max(bounds) + 1

    def usage(self) -> list[TenantUsage]:
        """A row per tenant seen (the namespace's own and the shared prefixes' first)."""
        c = self.counters
        return [TenantUsage(label, self.host[i], q.guaranteed_host_pages, q.max_host_pages, q.ttl_s,
                            *(c[name][i] for name in self._COUNTERS))
                for i, (label, q) in enumerate(zip(self.labels, self.quotas))]
