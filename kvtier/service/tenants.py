"""Tenants' bounds in the node service's region, and what each tenant holds, hits and loses there.

An engine that accounts tenants (:mod:`kvtier.core.tenants`) names each page it publishes with its
owner's label -- a digest of the tenant's scope, "shared" for a declared shared prefix, "namespace" for
the namespace's own -- and the service counts the region's indexed pages per (namespace, owner). The
bounds are the service's (``kvtier serve --tenant-*``), the same for every tenant, in pages of the region
(any pool):

* ``guaranteed_pages``: a reservation never evicts a tenant's unheld pages below this (a reservation does
  not say whose its pages will be, so the guarantee holds against every writer, the tenant's own
  included; a region whose guarantees fill it leaves new writes no room);
* ``max_pages``: a publish of a tenant at its cap evicts that tenant's own least recently released
  pages first; a page that still does not fit is not indexed (its writer's alone, freed when released);
* ``ttl_s``: a page nobody has held for this long leaves the region (zeroed with
  ``--zero-evicted-pages``), checked on the service's tick.

Labels cross a process boundary: the service takes a label only in the form an engine makes one, and
counts at most :data:`MAX_TENANTS` (namespace, owner) rows; a tenant past them is counted in its
namespace's "overflow" row (rows are kept for their counters, never reclaimed), and ``--status`` and the
metrics show the :data:`SHOWN_TENANTS` rows holding the most pages. A label is the engine's claim:
engines attached to one service trust each other's pages (they publish bytes others read), and so their
labels. Bounds apply to a tenant's row alone: not to the namespace's own pages (no tenant's -- requests
without one, an engine that does not label, a page the service loads from its own L3, since a lookup
does not say whose it is), nor to the shared scope, nor to an overflow row (many tenants': a cap there
would let one evict another's pages). A cap never stops the service's L3 write-through: a page past it is
saved, then freed.
"""

from __future__ import annotations

import heapq
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import check_number
from kvtier.errors import ConfigError
from kvtier.hashing import owner_tag

#: owners that are not a tenant's digest, as the engine's ledger names them (and their ids in page records)
WORDS = ("namespace", "shared", "overflow")
NAMESPACE_OWNER, SHARED_OWNER, OVERFLOW_OWNER = 0, 1, 2
_DIGEST = re.compile(r"[0-9a-f]{16}")
#: (namespace, owner) rows counted apart; a tenant past them shares its namespace's "overflow" row
MAX_TENANTS = 1 << 16
#: the rows ``--status`` and the metrics show (those holding the most pages; the rest counted)
SHOWN_TENANTS = 1000


def owner_id(label: str) -> int:
    """A label's owner id (a u64: a digest's value, or a word's index); ValueError if it is neither."""
    if type(label) is not str:
        raise ValueError(f"an owner label is a string; got {type(label).__name__}")
    if label in WORDS:
        return WORDS.index(label)
    if not _DIGEST.fullmatch(label):
        raise ValueError(f"{label!r} is not an owner label (16 lowercase hex digits, or one of {', '.join(WORDS)})")
    return int(label, 16)


def owner_label(owner: int) -> str:
    return WORDS[owner] if owner < len(WORDS) else f"{owner:016x}"


def l3_tag(owner: int) -> int:
    """The owner tag of ``owner``'s pages in the service's L3 objects: the engine's own for the same tenant."""
    return owner_tag(owner_label(owner))


@dataclass(frozen=True)
class RegionBounds:
    """The service's per-tenant bounds (see the module docstring); ``accounting``: count tenants with no bound set."""

    guaranteed_pages: int = 0
    max_pages: int | None = None
    ttl_s: float | None = None
    accounting: bool = False

    def __post_init__(self) -> None:
        check_number(self, "guaranteed_pages", at_least=0, integer=True)
        check_number(self, "max_pages", at_least=1, integer=True)
        check_number(self, "ttl_s", above=0)
        if self.max_pages is not None and self.guaranteed_pages > self.max_pages:
            raise ConfigError(f"--tenant-host-pages {self.guaranteed_pages} is above --tenant-max-host-pages {self.max_pages}: a "
                              "tenant cannot be guaranteed more than it may hold")

    @property
    def enabled(self) -> bool:
        return self.accounting or bool(self.guaranteed_pages) or self.max_pages is not None or self.ttl_s is not None


@dataclass
class TenantRow:
    """One (namespace, owner)'s pages and counters in the region."""

    namespace: str
    owner: int
    #: indexed pages (offered to lookups), held or not
    pages: int = 0
    hit_pages: int = 0
    #: evicted to make room: a reservation's (above its guarantee) or its own publish's at its cap
    evicted_pages: int = 0
    #: unheld past the TTL
    expired_pages: int = 0
    #: published at its cap with none of its own to evict: not indexed
    capped_pages: int = 0

    @property
    def bounded(self) -> bool:
        """Whether the tenants' bounds apply: to a tenant's row, not to the namespace's own pages (no tenant's: requests
        without one, engines that do not label, the service's L3 loads), the shared scope or an overflow row."""
        return self.owner not in (NAMESPACE_OWNER, SHARED_OWNER, OVERFLOW_OWNER)

    def as_dict(self, bounds: RegionBounds, label: Callable[[str], str]) -> dict:
        return {"namespace": label(self.namespace), "tenant": owner_label(self.owner), "pages": self.pages,
                "guaranteed_pages": bounds.guaranteed_pages if self.bounded else 0,
                "max_pages": bounds.max_pages if self.bounded else None,
                "ttl_s": bounds.ttl_s, "hit_pages": self.hit_pages, "evicted_pages": self.evicted_pages,
                "expired_pages": self.expired_pages, "capped_pages": self.capped_pages}


class RegionTenants:
    """The rows, and each indexed page's row; the index (:class:`~kvtier.service.index.HostIndex`) tells it what
    changes and asks it what its bounds allow."""

    def __init__(self, bounds: RegionBounds, max_rows: int = MAX_TENANTS):
        self.bounds = bounds
        self.rows: list[TenantRow] = []
        self._ids: dict[tuple[str, int], int] = {}
        self._max_rows = max_rows
        #: indexed page -> its row
        self.row_of: dict[int, int] = {}
        #: per row: its unheld indexed pages, least recently released first
        self.unheld_of: list[OrderedDict[int, None]] = []

    def row(self, namespace: str, owner: int) -> int:
        """The row of ``owner``'s pages in ``namespace`` (a new one the first time; past :data:`MAX_TENANTS`, the
        namespace's "overflow" row)."""
        key = (namespace, owner)
        got = self._ids.get(key)
        if got is not None:
            return got
        if len(self.rows) >= self._max_rows:
            key = (namespace, OVERFLOW_OWNER)
            got = self._ids.get(key)
            if got is not None:
                return got
        got = self._ids[key] = len(self.rows)
        self.rows.append(TenantRow(*key))
        self.unheld_of.append(OrderedDict())
        return got

    # ---- what the index tells ------------------------------------------------------------------
    def indexed(self, page: int, row: int) -> None:
        """``page`` is indexed as ``row``'s (held: by its publisher, or by a restarted service's adoption)."""
        self.row_of[page] = row
        self.rows[row].pages += 1

    def unindexed(self, page: int, counter: str | None = None) -> None:
        """``page`` left the index (``counter``: why, counted for its row: evicted_pages or expired_pages)."""
        row = self.row_of.pop(page)
        r = self.rows[row]
        r.pages -= 1
        self.unheld_of[row].pop(page, None)
        if counter is not None:
            setattr(r, counter, getattr(r, counter) + 1)

    def held(self, page: int) -> None:
        row = self.row_of.get(page)
        if row is not None:
            self.unheld_of[row].pop(page, None)

    def unheld(self, page: int) -> None:
        self.unheld_of[self.row_of[page]][page] = None

    def hit(self, pages: list[int]) -> None:
        rows, row_of = self.rows, self.row_of
        for page in pages:
            row = row_of.get(page)
            if row is not None:
                rows[row].hit_pages += 1

    # ---- what the bounds allow -------------------------------------------------------------------
    def evictable(self) -> Callable[[int], bool]:
        """A filter of a reservation's victims, asked in the order they are taken: a page of a tenant above its guarantee
        (or of no tenant's row, or of the shared scope)."""
        guarantee = self.bounds.guaranteed_pages
        if not guarantee:
            return lambda _page: True
        rows, row_of, taken = self.rows, self.row_of, {}

        def allowed(page: int) -> bool:
            row = row_of.get(page)
            if row is None or not rows[row].bounded:
                return True
            t = taken.get(row, 0)
            if rows[row].pages - t <= guarantee:
                return False
            taken[row] = t + 1
            return True

        return allowed

    def at_cap(self, row: int) -> bool:
        cap = self.bounds.max_pages
        return cap is not None and self.rows[row].bounded and self.rows[row].pages >= cap

    def oldest_unheld(self, row: int) -> int | None:
        return next(iter(self.unheld_of[row]), None)

    def usage(self, label: Callable[[str], str], limit: int = SHOWN_TENANTS) -> tuple[list[dict], int]:
        """The ``limit`` rows holding the most pages (of those with pages or counts), as ``--status`` and the metrics
        show them (the namespace through ``label``), and how many more there are."""
        live = [r for r in self.rows if r.pages or r.hit_pages or r.evicted_pages or r.expired_pages or r.capped_pages]
        shown = heapq.nlargest(limit, live, key=lambda r: r.pages) if len(live) > limit else live
        return [r.as_dict(self.bounds, label) for r in shown], len(live) - len(shown)

    def check(self, indexed: set[int], unheld: set[int]) -> None:
        """The rows agree with the index: every indexed page has one row, the counts and unheld orders are its pages'."""
        assert set(self.row_of) == indexed, "an indexed page without a tenant row, or a row's page not indexed"
        counts = [0] * len(self.rows)
        for row in self.row_of.values():
            counts[row] += 1
        assert counts == [r.pages for r in self.rows], "a tenant row's page count drifted"
        assert {p for order in self.unheld_of for p in order} == unheld & indexed, "a tenant row's unheld pages drifted"
        assert all(self.row_of[p] == row for row, order in enumerate(self.unheld_of) for p in order)
