"""One request's pass through the cache: the request protocol, written once.

Engines used to spell it out by hand -- match, lock, prefetch, resolve, re-match
without counting, lock the new match, unlock the old one, load back, allocate,
insert, free the tail, unlock -- and each copy could get a step wrong (count a
request twice, leak a lock, free a page the tree maps). Here it is::

    req = cache.begin(tokens)                # hashes once; locks the prefix; L3 prefetch per policy;
                                             # starts the host->device load of what is on host
    use = req.usable(max_pages)              # cached pages the engine will use (<= req.num_cached)
    new = req.alloc(pages_needed)            # device pages for the rest (OOM is a result: new.ok)
    for layer in ...: req.wait_layer(layer)  # layer i of the loaded pages is in place
    req.commit(pages)                        # all the request's pages in order: full ones are
                                             # inserted, the partial tail is freed, locks released

A hybrid model (:mod:`~kvtier.core.group_objects`): ``req.groups[name]`` maps
places to the device ids of the other groups' objects the request continues
from (its window's pages, the snapshot at its boundary), held until it ends;
``req.alloc_group(name, n)`` gives ids for the objects it computes, and
``commit(pages, groups={name: [id or None per full page]})`` hands them over
(``req.handed_places(name)`` says at which pages the cache wants them: every page
it computed for a window, where it keeps a snapshot for a state group).

Lifecycle (enforced; a second ``commit`` or ``abort`` is an :class:`InvalidStateError`)::

    begin() --> OPEN --commit(pages)--> COMMITTED
                  \\---abort()--------> ABORTED   (allocated pages freed, lock released)

Pages handed to ``commit`` are checked before anything changes: the cached
pages the request was given (at their own places) and pages it allocated, each
once. A page the cache holds elsewhere, a foreign page, a duplicate or an
out-of-range page is a typed error and the request stays open.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Mapping
from types import MappingProxyType
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from kvtier.alloc import Allocation, PageAllocator
from kvtier.errors import IndexTypeError, InvalidStateError, PageOwnershipError
from kvtier.pages import checked_page_list, first_duplicate, is_ordered_sequence

if TYPE_CHECKING:
    from kvtier.core.group_objects import Groups, NoGroups
    from kvtier.core.results import InsertResult, LoadResult
    from kvtier.hashing import PageHash
    from kvtier.radix import PageNode


class RequestCache(Protocol):
    """What a :class:`CacheRequest` needs of its cache: :class:`~kvtier.core.cache_core.CacheCore` and the
    recompute baseline :class:`~kvtier.core.nullcache.NullCache` both serve it."""

    #: the device pool's ids (a commit's pages are checked against it)
    dev_alloc: PageAllocator
    #: a hybrid model's other KV groups (what a request holds of them, and how far it can continue)
    groups: Groups | NoGroups

    #: bumped on every failed host->device load: a request re-checks its prefix only when it moved
    load_failure_gen: int

    def quarantined_pages(self) -> set[int]: ...

    def request_finished(self, serial: int) -> None: ...

    def alloc_device(self, n: int) -> Allocation: ...

    def free_device(self, pages: list[int]) -> None: ...

    def alloc_group(self, name: str, n: int) -> list[int]: ...

    def free_group(self, name: str, ids: list[int]) -> None: ...

    def commit_request(self, keys: Sequence[PageHash], device_pages: list[int], prefix: list[PageNode] | None,
                       groups: dict[str, list[int | None]] | None = None, owner: int = 0) -> InsertResult: ...

    def unlock(self, node: PageNode | None) -> None: ...


class RequestState(Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


#: the states as module globals for the per-request paths (an enum member's lookup is not specialized on 3.11)
OPEN, COMMITTED = RequestState.OPEN, RequestState.COMMITTED


#: the objects a request of a model without other KV groups is given: none (shared, read-only)
_NO_OBJECTS: Mapping[str, dict[int, int]] = MappingProxyType({})


#: the one element type the fast commit path takes (a bool, a numpy integer or a float goes the checked way)
_INTS = frozenset({int})


class CacheRequest:
    """Made by :meth:`CacheCore.begin`; see the module docstring for the protocol. Slotted, with a plain
    ``__init__``: one is made per request, on the scheduler's hot path.

    ``cache``: its cache; ``keys``: the page keys of its full pages (empty for a cache that keys
    nothing: the recompute baseline); ``full_pages``: how many full pages it has; ``device_hit``:
    pages of the prefix on device when it began (usable at once); ``host_hit``: pages in host memory,
    loaded back layer by layer (:meth:`wait_layer`); ``storage_hit``: pages its prefetch brought from
    L3, loaded back after those; ``cached_pages``: the device pages holding the cached prefix, in
    order; ``load``: the loads it waits on; ``serial``: its number in the cache (a failed load's pages
    are freed once older requests finish); ``failure_gen``: the cache's failed-load count when it
    last checked its prefix; ``groups`` (a hybrid model): group -> place -> device id of the objects
    the cached prefix continues from, held for it on the nodes ``held``."""

    __slots__ = ("cache", "keys", "full_pages", "device_hit", "host_hit", "storage_hit", "cached_pages", "load", "_locked", "_prefix",
                 "_allocated", "state", "serial", "failure_gen", "failed", "groups", "_held", "_group_alloc",
                 "owner")

    def __init__(self, cache: RequestCache, keys: Sequence[PageHash], full_pages: int, device_hit: int, host_hit: int,
                 storage_hit: int, cached_pages: list[int], load: LoadResult, locked: PageNode | None,
                 prefix: list[PageNode] | None = None, *, serial: int = 0, failure_gen: int = 0,
                 groups: dict[str, dict[int, int]] | None = None, held: list[PageNode] | None = None, owner: int = 0):
        self.cache = cache
        self.keys = keys
        self.full_pages = full_pages
        self.device_hit = device_hit
        self.host_hit = host_hit
        self.storage_hit = storage_hit
        self.cached_pages = cached_pages
        self.load = load
        self._locked = locked
        #: the nodes of ``cached_pages`` (kept on device by the lock): commit does not look them up again
        self._prefix = prefix if prefix is not None else []
        self._allocated: list[int] = []
        self.state = OPEN
        self.serial = serial
        self.failure_gen = failure_gen
        #: cached pages this request lost to a failed host->device load (they must be recomputed)
        self.failed = 0
        self.groups = groups if groups is not None else _NO_OBJECTS
        self._held = held if held is not None else ()
        #: group -> device ids this request allocated (alloc_group) and not yet handed over
        self._group_alloc: dict[str, list[int]] = {}
        #: its tenant's id in the cache's ledger (:mod:`kvtier.core.tenants`): whose the pages it commits are
        self.owner = owner

    def __repr__(self) -> str:
        return (f"CacheRequest({self.state.value}, {self.full_pages} pages, cached {self.num_cached}: device {self.device_hit}, "
                f"host {self.host_hit}, storage {self.storage_hit}, failed {self.failed})")

    @property
    def num_cached(self) -> int:
        return len(self.cached_pages)

    def usable(self, max_pages: int) -> int:
        """Cached pages a request that may use at most ``max_pages`` of them will use (a hybrid model: the
        longest such prefix every group can continue from with the objects this request holds)."""
        cached = len(self.cached_pages)
        n = max(0, min(cached, max_pages))
        if self.groups and n < cached:
            n = self._hybrid_usable(n)
        return n

    def handed_places(self, name: str) -> Sequence[int]:
        """Where the cache wants this request's objects of group ``name`` (places: the full pages they hang
        on): every page it computes past its cached prefix (a window), or the pages that end where it
        keeps a state snapshot (every ``state_every`` pages and its last full page)."""
        return self.cache.groups.handed_places(name, self.num_cached, self.full_pages)

    def snapshot_boundaries(self) -> list[int]:
        """Where the cache wants this request's state snapshots: boundaries (pages from the start) past its
        cached prefix, every ``state_every`` pages and at its last full page (none without a state group)."""
        state = next((c.name for c in self.cache.groups.components if c.kind.keeps == "state"), None)
        return [] if state is None else [p + 1 for p in self.handed_places(state)]

    def alloc_group(self, name: str, n: int) -> list[int]:
        """Up to ``n`` device ids of group ``name``'s pool, the request's until commit or abort."""
        self._check_open("alloc_group")
        ids = self.cache.alloc_group(name, n)
        self._group_alloc.setdefault(name, []).extend(ids)
        return ids

    def served(self, used: int) -> tuple[int, int, int]:
        """Where the first ``used`` cached pages came from, in prefix order: (device, host, storage)."""
        d = min(self.device_hit, used)
        h = min(self.host_hit, used - d)
        return d, h, min(self.storage_hit, used - d - h)

    def wait_layer(self, layer: int) -> None:
        self.load.wait_layer(layer)

    def wait(self) -> int:
        """Every load the cached prefix needs has finished. Returns :attr:`num_cached`: a load that
        failed shrinks the prefix to its last good page (:attr:`failed` counts the pages lost), and
        the engine recomputes from there into pages from :meth:`alloc`."""
        self._check_open("wait")
        self.load.wait()
        self._check_prefix()
        return len(self.cached_pages)

    def alloc(self, n: int) -> Allocation:
        """``n`` device pages for this request (evicting unlocked LRU pages if needed); owned by the
        request until :meth:`commit` hands them over or :meth:`abort` frees them."""
        self._check_open("alloc")
        tree = getattr(self.cache, "tree", None)
        if tree is not None:  # (room it makes backs up pages to host: its tenant's room, whichever request began last)
            tree.current_owner = self.owner
        got = self.cache.alloc_device(n)
        self._allocated += got.pages
        return got

    def commit(self, pages: Sequence[int], groups: dict[str, Sequence[int | None]] | None = None) -> InsertResult:
        """Hand the request's pages to the cache, in order: one per page of the request, the
        full pages first (inserted) and at most one partial tail page (freed). Pages the
        request allocated but did not pass are freed too. Unlocks the prefix."""
        self._check_open("commit")
        is_list = type(pages) is list
        if not is_list and not is_ordered_sequence(pages):
            raise IndexTypeError(f"commit: pages must be a list of device page ids, in order, got {type(pages).__name__}")
        cache = self.cache
        load = self.load
        if load.op is not None or load.pending:
            load.wait()  # every load's outcome is known before anything is inserted over it
        if self.failure_gen != cache.load_failure_gen:
            self._check_prefix()
        full = self.full_pages
        if not full <= len(pages) <= full + 1:
            raise PageOwnershipError(f"commit: {len(pages)} pages for a request of {full} full pages; pass its {full} full pages "
                                     f"in order, then its partial tail page if it has one")
        alloc = self._allocated
        k = len(pages) - len(alloc)
        if is_list and k >= 0 and pages[k:] == alloc and pages[:k] == self.cached_pages[:k] and set(map(type, pages)) <= _INTS:
            # the usual shape, the cached prefix then every page it allocated: list comparisons in C
            rest = pages[full:]
            known = self._prefix[:k]
        else:
            pages = checked_page_list(pages, cache.dev_alloc.num_pages, pool=cache.dev_alloc.name, side="device")  # typed errors
            self._check_pages(pages)
            handed = set(pages[:full])
            rest = [p for p in alloc if p not in handed]
            known = None
        handed = self._check_groups(groups or {}, full) if (groups or self._group_alloc) else None
        # ownership proven above, more strictly than insert's
        result = cache.commit_request(self.keys, pages[:full], known, handed, self.owner)
        if rest:
            cache.free_device(rest)
        if self._group_alloc:
            self._free_group_alloc(handed or {})
        self._finish(COMMITTED)
        return result

    def abort(self) -> None:
        """Give up the request: free the pages it allocated, release its lock."""
        self._check_open("abort")
        if self._allocated:
            self.cache.free_device(list(self._allocated))
        if self._group_alloc:
            self._free_group_alloc({})
        self._finish(RequestState.ABORTED)

    # ---- internals -----------------------------------------------------------------
    def _check_prefix(self) -> None:
        """Shrink the cached prefix to its last good page if a host->device load failed since the
        last check (the cache took its device copies away; see :mod:`kvtier.core.quarantine`)."""
        gen = self.cache.load_failure_gen
        if gen == self.failure_gen:
            return
        self.failure_gen = gen
        cached, prefix = self.cached_pages, self._prefix
        good = 0
        while good < len(cached) and prefix[good].device_page == cached[good]:
            good += 1
        if self.groups:  # the objects the failure took; then the prefix the rest still continues from
            parts = self.cache.groups
            self.groups = {name: {i: gid for i, gid in objs.items() if i < good and parts.holds_object(name, prefix[i], gid)}
                           for name, objs in self.groups.items()}
            good = self._hybrid_usable(good)
            self.groups = {c.name: {i: self.groups[c.name][i] for i in c.kind.places(good)} for c in parts.components}
        if good < len(cached):
            self.failed += len(cached) - good
            self.cached_pages = cached[:good]
            self._prefix = prefix[:good]

    def _hybrid_usable(self, n: int) -> int:
        """The longest prefix of ``n`` pages every group continues from with the objects this request holds."""
        return self.cache.groups.usable(n, {name: objs.__contains__ for name, objs in self.groups.items()})

    def _check_groups(self, groups: dict[str, Sequence[int | None]], full: int) -> dict[str, list[int | None]]:
        """The other groups' ids handed to commit: one entry per full page, each None, the object the
        request was given at that place, or one it allocated; once. Nothing changes on an error."""
        out = {}
        for name, ids in groups.items():
            self.cache.groups.component(name)  # an unknown group is an UnknownNameError
            if type(ids) is not list and not is_ordered_sequence(ids) or len(ids) != full:
                raise PageOwnershipError(f"commit, KV group {name!r}: pass one entry per full page ({full}): an id from "
                                         f"alloc_group, the id the request was given there, or None")
            ids = list(ids)
            alloc = self._group_alloc.get(name, [])
            k = full - len(alloc)
            if k >= 0 and ids[k:] == alloc and ids[:k].count(None) == k:  # the usual shape, in C: None, then what it allocated
                out[name] = ids
                continue
            mine = set(alloc)
            distinct = set(ids)
            distinct.discard(None)
            if len(distinct) == len(ids) - ids.count(None) and distinct <= mine:  # the usual shape: ids it allocated, each once
                out[name] = ids
                continue
            given, seen = self.groups.get(name, {}), set()
            for place, gid in enumerate(ids):
                if gid is None:
                    continue
                if type(gid) is not int or gid in seen or not (gid in mine or given.get(place) == gid):
                    raise PageOwnershipError(f"commit, KV group {name!r}: id {gid!r} (place {place}) is not this request's "
                                             f"to hand over, or is listed twice: pass ids from alloc_group, or the id it was given there")
                seen.add(gid)
            # the objects it was given, handed back at their places, are the cache's already
            out[name] = [None if gid is not None and gid not in mine else gid for gid in ids]
        return out

    def _free_group_alloc(self, handed: dict[str, list[int | None]]) -> None:
        """Free the group ids this request allocated and did not hand over."""
        for name, ids in self._group_alloc.items():
            given = handed.get(name, ())
            if len(given) - given.count(None) == len(ids):  # (handed ids are distinct and its own: all of them)
                continue
            kept = set(given)
            rest = [i for i in ids if i not in kept]
            if rest:
                self.cache.free_group(name, rest)
        self._group_alloc = {}

    def _check_open(self, what: str) -> None:
        if self.state is not OPEN:
            raise InvalidStateError(f"{what} on a request that is already {self.state.value}; begin a new request")

    def _check_pages(self, pages: list[int]) -> None:
        """Each page is a cached page the request was given, at its place, or one it allocated; once.
        (The general case; :meth:`commit` recognises the usual shape with two list comparisons.)"""
        if len(set(pages)) != len(pages):
            raise PageOwnershipError(f"commit: device page {first_duplicate(pages)} is listed twice")
        cached = self.cached_pages
        n, lim = 0, min(len(cached), len(pages))
        while n < lim and pages[n] == cached[n]:  # the usual shape: the cached prefix, then new pages
            n += 1
        mine = set(self._allocated)
        for i in range(n, len(pages)):
            p = pages[i]
            if p not in mine and not (i < len(cached) and p == cached[i]):
                if self.failed and p in self.cache.quarantined_pages():
                    raise PageOwnershipError(
                        f"commit: device page {p} (place {i}) was lost to a failed host->device load; the request's "
                        f"cached prefix is its first {len(cached)} pages (see wait()): recompute the rest into "
                        "pages from alloc()"
                    )
                raise PageOwnershipError(
                    f"commit: device page {p} (place {i}) is not this request's: pass the cached pages it was "
                    "given, at their places, and pages it allocated"
                )

    def _finish(self, state: RequestState) -> None:
        if self._held:
            self.cache.groups.release(self._held)
            self._held = ()
        self.cache.unlock(self._locked)
        self.cache.request_finished(self.serial)
        self._locked = None
        self._prefix = []
        self._allocated = []
        self.state = state
