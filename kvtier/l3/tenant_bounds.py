"""Per-tenant bounds of a store that evicts on its own (the file store): what one sweep of its objects deletes.

Each page object carries its owner's tag (:mod:`kvtier.l3.page`, :func:`~kvtier.hashing.owner_tag`), so a
sweep that reads the objects' headers knows whose bytes each one holds, with no index beside the store
(every engine and node that shares the store writes the same tags). Three bounds, each optional, cover a
tenant's objects only; the namespace's own pages, a declared shared prefix's and a ledger's overflow are
left to the store's LRU, as in the host tier and the node service:

* ``guaranteed_bytes``: the store's cap never deletes a tenant's objects below this. Where only
  guaranteed bytes are left above the cap, the store is *full*: it refuses new objects until a sweep
  finds room (a write that would delete a guaranteed page is refused instead);
* ``max_bytes``: a tenant past it loses its own least recently used objects, down to 90% of it (or its
  guarantee, if more);
* ``ttl_s``: an object of a tenant's that nobody read or wrote for this long is deleted (the store's
  sweeper runs every eighth of it).

The order: expired objects go first, then each tenant past its cap, then the store's LRU down to 90%
of the store's cap. Tags are 32 bits, so two tenants of a store may share one (and its bounds): the
odds are about ``n**2 / 2**33`` for ``n`` tenants. A tag never decides what a reader gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.config import check_number
from kvtier.errors import ConfigError, StorageError
from kvtier.hashing import OVERFLOW_TAG
from kvtier.l3.base import positive_option

#: the longest lifetime a URL may give (ten years): what a store's clocks and Redis's expiry hold with room to spare
MAX_TTL_S = 10 * 365 * 86400.0
#: URL options, each with its scale to bytes (``*_gb``: GiB); a bound takes one spelling
_BYTE_OPTIONS = {"guaranteed_bytes": (("tenant_min_bytes", 1), ("tenant_min_gb", 1 << 30)),
                 "max_bytes": (("tenant_max_bytes", 1), ("tenant_max_gb", 1 << 30))}


def is_tenant(tag: int) -> bool:
    """Whether objects of ``tag`` are a tenant's (bounded), not the namespace's, a shared prefix's or an overflow's."""
    return tag > OVERFLOW_TAG


@dataclass(frozen=True)
class TenantBounds:
    """One store's bounds for each tenant (see the module docstring); the defaults bound nothing."""

    guaranteed_bytes: int = 0
    max_bytes: int | None = None
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        check_number(self, "guaranteed_bytes", at_least=0, integer=True)
        check_number(self, "max_bytes", above=0, integer=True)
        check_number(self, "ttl_s", above=0, at_most=MAX_TTL_S)
        if self.max_bytes is not None and self.guaranteed_bytes > self.max_bytes:
            raise ConfigError(f"a tenant's guaranteed {self.guaranteed_bytes} bytes are above its cap of {self.max_bytes}; "
                              "lower tenant_min_gb or raise tenant_max_gb")

    def check_store_cap(self, store_cap: int | None, store: str) -> None:
        """A StorageError where these bounds cannot hold under a store's cap: a guarantee with no cap to keep it from,
        or one above what a sweep leaves (90% of the cap: a single tenant would fill the store and every write but an
        expiry's room would be refused for good)."""
        if not self.guaranteed_bytes:
            return
        if store_cap is None:
            raise StorageError(f"{store} store: tenant_min_gb keeps a tenant's objects from the store's cap, and there is none; "
                               "set max_gb too (or leave tenant_min_gb out)")
        if self.guaranteed_bytes > 0.9 * store_cap:
            raise StorageError(f"{store} store: a tenant's guaranteed {self.guaranteed_bytes} bytes are above 90% of the store's cap "
                               f"of {store_cap} (what a sweep leaves); lower tenant_min_gb or raise max_gb")

    @property
    def any(self) -> bool:
        return bool(self.guaranteed_bytes) or self.max_bytes is not None or self.ttl_s is not None

    @classmethod
    def from_query(cls, query: Mapping[str, str], store: str) -> TenantBounds:
        """The bounds a store URL's options set (``store``: its name, for errors); StorageError for a bad value."""
        got: dict[str, float] = {}
        for bound, spellings in _BYTE_OPTIONS.items():
            given = [(name, scale) for name, scale in spellings if name in query]
            if len(given) > 1:
                raise StorageError(f"{store} URL sets both {given[0][0]} and {given[1][0]}; give one")
            for name, scale in given:
                got[bound] = int(positive_option(query, name, store, "tenant_max_gb=10", scale))
                if got[bound] < 1:
                    raise StorageError(f"{store} URL option {name}={query[name]!r} is less than one byte; give at least 1 byte "
                                       "(or leave it out)")
        if "tenant_ttl_s" in query:
            got["ttl_s"] = positive_option(query, "tenant_ttl_s", store, "tenant_ttl_s=3600")
            if got["ttl_s"] > MAX_TTL_S:
                raise StorageError(f"{store} URL option tenant_ttl_s={query['tenant_ttl_s']!r} is longer than ten years "
                                   f"({MAX_TTL_S:.0f} s); leave it out for no lifetime")
        try:
            return cls(**got)
        except ConfigError as e:
            raise StorageError(f"{store} URL: {e}") from None


def refuse_unkept(query: Mapping[str, str], store: str, keeps: tuple[str, ...] = ()) -> TenantBounds:
    """The bounds a store that evicts on its own (Redis, Mooncake) can keep: only ``keeps`` (names of
    :class:`TenantBounds` fields); any other tenant option in its URL is a StorageError saying where it works."""
    bounds = TenantBounds.from_query(query, store)
    unkept = [name for name, value, none in (("guaranteed_bytes", bounds.guaranteed_bytes, 0), ("max_bytes", bounds.max_bytes, None),
                                             ("ttl_s", bounds.ttl_s, None)) if value != none and name not in keeps]
    if unkept:
        options = {"guaranteed_bytes": "tenant_min_gb", "max_bytes": "tenant_max_gb", "ttl_s": "tenant_ttl_s"}
        raise StorageError(f"{store} URL sets {', '.join(options[n] for n in unkept)}, which {store} cannot keep: it evicts by its own "
                           f"policy, and only a store kvtier evicts itself (file://) bounds each tenant"
                           + (f"; {store} keeps {', '.join(options[n] for n in keeps)}" if keeps else ""))
    return bounds


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object as a sweep sees it: last used (read or written) at ``used_ns``, ``size`` bytes, ``tag``'s."""

    used_ns: int
    size: int
    tag: int
    ref: object  # the store's handle (a path)


@dataclass
class Sweep:
    """What one sweep deletes, by reason, and the store after it."""

    expired: list[StoredObject] = field(default_factory=list)
    #: a tenant's, past its cap
    capped: list[StoredObject] = field(default_factory=list)
    #: the store's LRU, past the store's cap
    evicted: list[StoredObject] = field(default_factory=list)
    #: bytes left, and per tag (every tag left, not only tenants')
    total: int = 0
    by_tag: dict[int, int] = field(default_factory=dict)
    #: still past the store's cap: only guaranteed bytes were left to delete
    full: bool = False

    @property
    def deleted(self) -> list[StoredObject]:
        return [*self.expired, *self.capped, *self.evicted]


def plan_sweep(objects: Iterable[StoredObject], bounds: TenantBounds, store_cap: int | None, now_ns: int) -> Sweep:
    """What a sweep of ``objects`` deletes under ``bounds`` and the store's cap ``store_cap`` (None: no cap) at ``now_ns``:
    expired first, then each tenant down to 90% of its cap, then the store's LRU down to 90% of its cap, never taking a
    tenant below its guarantee (see the module docstring)."""
    sweep = Sweep()
    live: list[StoredObject] = []
    expire_before = None if bounds.ttl_s is None else now_ns - int(bounds.ttl_s * 1e9)
    for o in objects:
        if expire_before is not None and o.used_ns < expire_before and is_tenant(o.tag):
            sweep.expired.append(o)
        else:
            live.append(o)
    live.sort(key=lambda o: o.used_ns)  # least recently used first
    by_tag: dict[int, int] = {}
    for o in live:
        by_tag[o.tag] = by_tag.get(o.tag, 0) + o.size
    deleted: set[int] = set()
    if bounds.max_bytes is not None:  # a tenant past its cap is cut to 90% of it (never below its guarantee): the next cut is
        target = max(int(bounds.max_bytes * 0.9), bounds.guaranteed_bytes)  # a tenth of a cap of writes away
        over = {tag for tag, n in by_tag.items() if is_tenant(tag) and n > bounds.max_bytes}
        for i, o in enumerate(live):
            if o.tag in over and by_tag[o.tag] > target:
                by_tag[o.tag] -= o.size
                sweep.capped.append(o)
                deleted.add(i)
    total = sum(by_tag.values())
    if store_cap is not None and total > store_cap:
        target = int(store_cap * 0.9)
        guarantee = bounds.guaranteed_bytes
        for i, o in enumerate(live):
            if total <= target:
                break
            if i in deleted or is_tenant(o.tag) and by_tag[o.tag] - o.size < guarantee:
                continue
            by_tag[o.tag] -= o.size
            total -= o.size
            sweep.evicted.append(o)
        sweep.full = total > store_cap
    sweep.total = total
    sweep.by_tag = {tag: n for tag, n in by_tag.items() if n}
    return sweep

