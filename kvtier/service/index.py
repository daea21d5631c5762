"""The node service's host-tier policy over the region's page ids: which page holds which page key in
which namespace, who holds or writes what, and which pages go first when room is needed. No bytes, no
sockets: the server feeds it what its clients ask, and it answers with page ids.

Page lifecycle (every transition below; nothing else changes a page)::

    FREE --reserve(c)--> WRITING(c) --publish(c, key)--> READY, held by c
      ^                    |  release(c) / c detaches       |  lookup(d): held by d too
      |                    v                                |  release / detach: a holder goes
      +--------------------+                                v
      +------ evicted: least recently released first -- READY, held by nobody (offered to lookups)

A page being written is offered to nobody: it becomes visible only when its writer publishes it, and a
writer that detaches (its connection dropped) frees it unpublished. A READY page is offered only in the
namespace it was published in, and never evicted while anyone holds it. A key published twice keeps
its first page; the second page is its publisher's alone (unindexed) and is freed when released.
Eviction order: when a client releases a prefix's pages deepest first (as a core evicts its host
leaves), the deepest goes first here too, so a prefix shortens from its end and never loses its start.

**Pools.** A region of a hybrid model's pages also holds an object pool per other KV group
(:meth:`RegionFormat.with_objects <kvtier.service.region.RegionFormat.with_objects>`): ``pools`` pools of
``num_pages`` ids each, ids region-wide (pool ``k``'s are ``k * num_pages`` on). A writer reserves in a pool;
room is made there by evicting that pool's unheld pages; a lookup's run is of pages (pool 0) only, and
:meth:`HostIndex.find` answers a pool's objects key by key. Everything else names a page alone.

A :class:`PageWatcher` (the service's page records, :mod:`kvtier.service.records`) is told of each page
handed to a writer and each page indexed, and asked before a READY page is offered to a lookup: a page
it refuses (its bytes changed after their checksum) is dropped -- unindexed, freed once nobody holds it
-- and the lookup's run ends before it. A restarted service's index starts from :meth:`HostIndex.adopt`:
the pages that verified READY, offered, and held by the adoption (never evicted) until
:meth:`HostIndex.release_adopted`; the ones being written at the crash parked (out of circulation)
until :meth:`HostIndex.unpark`.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from kvtier.alloc import PageAllocator
from kvtier.errors import ServiceProtocolError
from kvtier.service.tenants import NAMESPACE_OWNER, RegionTenants

Key = tuple[str, bytes]  # (namespace, page key)
#: the index clients that hold an adopted region's pages for a while (this id and below; the service's L3
#: tier's clients are -1, -2, ...)
ADOPTION_CLIENTS = -(1 << 40)


class PageWatcher(Protocol):
    """What the index tells of its pages' bytes, and asks (see the module docstring)."""

    def reserved(self, pages: list[int], client: int) -> None: ...

    def indexed(self, page: int, namespace: str, key: bytes, owner: int = NAMESPACE_OWNER) -> None: ...

    def offered(self, page: int) -> bool: ...

    def cleared(self, page: int) -> None: ...

    def vacated(self, pages: list[int]) -> None: ...


@dataclass
class Client:
    """One attached connection: its namespace, the pages it writes, and the READY pages it holds
    (insertion-ordered: released in reverse when it detaches, deepest first)."""

    namespace: str
    writing: set[int] = field(default_factory=set)
    held: dict[int, None] = field(default_factory=dict)
    #: pages its lookups were offered (and an L3 load's extension of them): the per-engine view's hits
    hit_pages: int = 0


@dataclass(frozen=True)
class IndexStatus:
    num_pages: int
    free: int
    writing: int
    ready: int
    held: int
    clients: int
    pages_per_namespace: dict[str, int]
    lookups: int
    hit_pages: int
    published_pages: int
    evicted_pages: int
    dropped_writes: int
    expired_leases: int
    corrupt_pages: int
    parked_pages: int
    adoption_held: int  # of ``held``: pages held only by a restarted service's adoption (its grace period)
    finds: int = 0
    found_objects: int = 0
    #: unheld pages evicted past the tenants' TTL (apart from ``evicted_pages``)
    expired_pages: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class NamespacePages:
    """One namespace's pages now: ``published`` (READY under one of its keys: offered to its lookups),
    ``held`` (READY and held by a client of it) and ``leased`` (being written by a client of it)."""

    published: int = 0
    held: int = 0
    leased: int = 0


class RegionPages:
    """The region's page ids, ``pools`` pools of ``per_pool`` each (ids region-wide), as one allocator's books to the
    index: what is free, allocated and parked over every pool, and allocations from one pool."""

    def __init__(self, per_pool: int, pools: int = 1):
        self.per_pool = per_pool
        self.pools = [PageAllocator(per_pool, "node service region" if k == 0 else f"node service region, object pool {k}")
                      for k in range(pools)]
        self.num_pages = per_pool * pools

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.pools)

    def num_free_in(self, pool: int) -> int:
        return self.pools[pool].num_free

    def alloc(self, n: int, pool: int = 0) -> list[int]:
        base = pool * self.per_pool
        return [base + p for p in self.pools[pool].alloc(n).pages]

    def _split(self, pages) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for page in pages:
            k, p = divmod(page, self.per_pool)
            out.setdefault(k, []).append(p)
        return out

    def free(self, pages: list[int]) -> None:
        for k, mine in self._split(pages).items():
            self.pools[k].free(mine)

    def take(self, pages: list[int]) -> None:
        for k, mine in self._split(pages).items():
            self.pools[k].take(mine)

    def hold(self, pages) -> None:
        for k, mine in self._split(pages).items():
            self.pools[k].hold(mine)

    def release_hold(self, pages) -> None:
        for k, mine in self._split(pages).items():
            self.pools[k].release_hold(mine)

    @property
    def parked(self) -> set[int]:
        return {k * self.per_pool + p for k, a in enumerate(self.pools) for p in a.parked}

    def allocated_pages(self) -> set[int]:
        return {k * self.per_pool + p for k, a in enumerate(self.pools) for p in a.allocated_pages()}


class HostIndex:
    """See the module docstring. Clients are named by the caller's ids (the server's connection ids).
    ``num_pages``: the region's pages; ``pools``: its pools, each of that many ids (pool 0 the pages); ``tenants``:
    the tenants' rows and bounds (:mod:`kvtier.service.tenants`; None: not accounted); ``clock``: seconds, for TTLs."""

    def __init__(self, num_pages: int, watcher: PageWatcher | None = None, pools: int = 1, *,
                 tenants: RegionTenants | None = None, clock: Callable[[], float] = time.monotonic):
        self.alloc = RegionPages(num_pages, pools)
        self.num_pages = num_pages
        self.watcher = watcher
        self.clients: dict[int, Client] = {}
        self._writer: dict[int, int] = {}  # WRITING page -> client
        self._key_of: dict[int, Key | None] = {}  # READY page -> its key (None: a duplicate, its publisher's alone)
        self._page_of: dict[Key, int] = {}
        self._holders: dict[int, set[int]] = {}  # READY page -> clients holding it (absent: nobody)
        # READY, held by nobody, per pool: least recently released first (-> when it was released)
        self._unheld: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(pools)]
        self.tenants = tenants
        self._clock = clock
        self.lookups = self.hit_pages = self.published_pages = self.evicted_pages = self.dropped_writes = 0
        #: of the pages evicted, those nobody had held for the tenants' TTL (counted apart from ``evicted_pages``)
        self.expired_pages = 0
        #: finds answered, and the objects they offered (a hybrid model's: apart from the pages' lookups and hits)
        self.finds = self.found_objects = 0
        #: of ``dropped_writes``: pages whose writer's process had died (its lease expired rather than being given up)
        self.expired_leases = 0
        #: READY pages the watcher refused to offer (their bytes changed after their write completed): dropped
        self.corrupt_pages = 0
        #: per namespace: pages its lookups were offered, and keys they asked for that were not (the run stopped before them)
        self.hit_pages_of: Counter[str] = Counter()
        self.miss_pages_of: Counter[str] = Counter()
        #: per namespace: pages indexed (offered to its lookups) and pages some client holds, kept as they change
        #: so a metrics scrape costs as many steps as there are namespaces, not pages
        self._published_of: Counter[str] = Counter()
        self._held_of: Counter[str] = Counter()

    # ---- clients ---------------------------------------------------------------------------
    def attach(self, client: int, namespace: str) -> None:
        assert client not in self.clients, client
        self.clients[client] = Client(namespace)

    def holds_anything(self, client: int) -> bool:
        """Whether the client writes or holds any page (a dropped one that does not is simply detached)."""
        c = self.clients[client]
        return bool(c.writing or c.held)

    def detach(self, client: int, *, died: bool = False) -> None:
        """The client's connection is gone: its writes are dropped unpublished, its holds released.
        ``died``: its process is gone (its leases expired: counted apart)."""
        c = self.clients[client]
        self.dropped_writes += len(c.writing)
        self.expired_leases += len(c.writing) if died else 0
        for page in c.writing:
            del self._writer[page]
        self._free(sorted(c.writing))
        for page in reversed(list(c.held)):
            self._unhold(client, page)
        del self.clients[client]

    # ---- what clients ask --------------------------------------------------------------------
    def lookup(self, client: int, keys: list[bytes]) -> list[int]:
        """The pages of the leading run of ``keys`` published in the client's namespace, now held for it
        (the run stops at a page it holds already: its own tree has that one)."""
        self.lookups += 1
        pages = self._run(client, keys)
        self.miss_pages_of[self.clients[client].namespace] += len(keys) - len(pages)
        return pages

    def extend(self, client: int, keys: list[bytes]) -> list[int]:
        """A lookup's run continued over ``keys`` (those after it, which it counted as misses): what an L3
        load brought into the region since, held for the client and counted as hits instead."""
        pages = self._run(client, keys)
        self.miss_pages_of[self.clients[client].namespace] -= len(pages)
        return pages

    def find(self, client: int, keys: list[bytes], pool: int, *, again: bool = False) -> list[int]:
        """Each of ``keys`` published in the client's namespace in pool ``pool``: its page, now held for the client,
        or -1 (absent, of another pool, or held by the client already). ``again``: the same find's misses asked once
        more (what an L3 load brought in since): not counted as another find."""
        c = self.clients[client]
        lo, hi = pool * self.num_pages, (pool + 1) * self.num_pages
        out, found = [], {}
        for key in keys:
            page = self._page_of.get((c.namespace, key), -1)
            if not lo <= page < hi or page in c.held or page in found:
                page = -1
            elif self.watcher is not None and not self.watcher.offered(page):
                self._drop(page)
                page = -1
            out.append(page)
            if page >= 0:
                found[page] = None
        self._hold(client, c, list(found))
        c.hit_pages += len(found)
        self.finds += not again
        self.found_objects += len(found)
        return out

    def _run(self, client: int, keys: list[bytes]) -> list[int]:
        c = self.clients[client]
        pages: list[int] = []
        seen: set[int] = set()
        n = self.num_pages
        for key in keys:
            page = self._page_of.get((c.namespace, key))
            if page is None or page >= n or page in c.held or page in seen:  # (a run is of pages, of pool 0, each once)
                break
            seen.add(page)
            if self.watcher is not None and not self.watcher.offered(page):
                self._drop(page)
                break
            pages.append(page)
        self._hold(client, c, pages)
        c.hit_pages += len(pages)
        self.hit_pages += len(pages)
        if self.tenants is not None:
            self.tenants.hit(pages)
        self.hit_pages_of[c.namespace] += len(pages)
        return pages

    def reserve(self, client: int, n: int, pool: int = 0) -> list[int]:
        """Up to ``n`` pages of ``pool`` for the client to write, evicting pages of it nobody holds if needed."""
        if not 0 <= pool < len(self._unheld):
            raise ServiceProtocolError(f"reserve: pool {pool} is not one of the region's {len(self._unheld)}")
        c = self.clients[client]
        short = n - self.alloc.num_free_in(pool)
        unheld = self._unheld[pool]
        if short > 0 and self.tenants is not None and self.tenants.bounds.guaranteed_pages:
            allowed = self.tenants.evictable()
            for page in list(islice((p for p in unheld if allowed(p)), short)):  # (in order: the filter counts what it lets go)
                self._evict(page, "evicted_pages")
        else:
            while short > 0 and unheld:
                self._evict(next(iter(unheld)), "evicted_pages")
                short -= 1
        got = self.alloc.alloc(min(n, self.alloc.num_free_in(pool)), pool)
        if self.watcher is not None:
            self.watcher.reserved(got, client)
        for page in got:
            self._writer[page] = client
        c.writing.update(got)
        return got

    def publish(self, client: int, pages: list[int], keys: list[bytes], owners: list[int] | None = None) -> list[int]:
        """The client wrote ``pages``: each is READY under ``keys[i]``, held by the client. Checked whole
        before anything changes: every page must be one it is writing. Returns the pages now indexed
        (not duplicates of a key published before, nor pages past their tenant's cap). ``owners``: each
        page's tenant (:func:`~kvtier.service.tenants.owner_id`; None: the namespace's own)."""
        c = self.clients[client]
        self._check_pages(client, pages, c.writing, "publish", "it is not writing (reserve it first)")
        tenants = self.tenants
        indexed_pages = []
        for i, (page, key) in enumerate(zip(pages, keys)):
            c.writing.discard(page)
            del self._writer[page]
            k = (c.namespace, key)
            indexed = k not in self._page_of
            owner = NAMESPACE_OWNER if owners is None else owners[i]
            if indexed and tenants is not None:
                row = tenants.row(c.namespace, owner)
                indexed = self._room_for(row)
                if indexed:
                    tenants.indexed(page, row)
            if indexed:
                self._page_of[k] = page
                self._published_of[c.namespace] += 1
                indexed_pages.append(page)
                if self.watcher is not None:
                    self.watcher.indexed(page, c.namespace, key, owner)
            self._key_of[page] = k if indexed else None
            self._holders[page] = {client}
            self._held_of[c.namespace] += 1
            c.held[page] = None
        self.published_pages += len(pages)
        return indexed_pages

    def _room_for(self, row: int) -> bool:
        """Whether a page of tenant ``row`` may be indexed: below its cap, once its oldest unheld pages are evicted (as
        many as put it at or past its cap: one, or more where the cap was lowered across a restart)."""
        tenants = self.tenants
        while tenants.at_cap(row):
            victim = tenants.oldest_unheld(row)
            if victim is None:
                tenants.rows[row].capped_pages += 1
                return False
            self._evict(victim, "evicted_pages")
        return True

    def expire(self) -> int:
        """Evict the pages nobody has held for the tenants' TTL (``kvtier serve --tenant-ttl-s``); how many."""
        ttl = None if self.tenants is None else self.tenants.bounds.ttl_s
        if ttl is None:
            return 0
        before, n = self._clock() - ttl, 0
        for unheld in self._unheld:
            while unheld:
                page, released = next(iter(unheld.items()))
                if released > before:
                    break
                self._evict(page, "expired_pages")
                n += 1
        return n

    def adopt(self, pages: list[tuple[int, str, bytes]] | list[tuple[int, str, bytes, int]], parked: list[int]) -> None:
        """Start from a region a killed service left: ``pages`` (page, namespace, key[, owner]; one page per key) READY,
        offered to lookups, but held (by a client of the adoption's, one per namespace) so that none is evicted
        and rewritten while an engine of the old service may still be reading it, until :meth:`release_adopted`;
        ``parked`` out of circulation until :meth:`unpark`. Only on a fresh index."""
        assert not self.clients and self.alloc.num_free == self.alloc.num_pages, "adopt() is for a fresh index"
        self.alloc.take([page for page, *_rest in pages] + parked)
        by_namespace: dict[str, list[int]] = {}
        for page, ns, key, *owner in pages:
            self._key_of[page] = (ns, key)
            self._page_of[(ns, key)] = page
            self._published_of[ns] += 1
            by_namespace.setdefault(ns, []).append(page)
            if self.tenants is not None:  # (above a cap now lowered: evicted by the next publishes, as they come)
                self.tenants.indexed(page, self.tenants.row(ns, owner[0] if owner else NAMESPACE_OWNER))
        for i, (ns, held) in enumerate(sorted(by_namespace.items())):
            cid = ADOPTION_CLIENTS - i
            self.attach(cid, ns)
            self._hold(cid, self.clients[cid], held)
        self.alloc.hold(parked)
        self.alloc.free(parked)  # (held: parked, allocated until unpark)

    def release_adopted(self) -> int:
        """The adoption's holds end: its pages are held by whoever looked them up since, or evictable; how many."""
        released = 0
        for cid in [c for c in self.clients if c <= ADOPTION_CLIENTS]:
            released += len(self.clients[cid].held)
            self.detach(cid)
        return released

    def unpark(self, pages: list[int]) -> None:
        """Return parked ``pages`` to the free list."""
        self._vacated(pages)
        self.alloc.release_hold(pages)
        self._cleared(pages)

    def _free(self, pages: list[int]) -> None:
        """Free pages nobody will write or read now (not an evicted one: its bytes are still its key's)."""
        self._vacated(pages)
        self.alloc.free(pages)
        self._cleared(pages)

    def _vacated(self, pages: list[int]) -> None:
        """Tell the watcher: ``pages``' bytes are nobody's now (it may zero them before another writer gets them)."""
        if self.watcher is not None and pages:
            self.watcher.vacated(pages)

    def _cleared(self, pages: list[int]) -> None:
        """Tell the watcher: a restarted service must not take these for pages mid-write (their writers are done)."""
        if self.watcher is not None:
            for page in pages:
                self.watcher.cleared(page)

    def hold(self, client: int, pages: list[int]) -> None:
        """The client holds READY ``pages`` it does not hold yet (the service's own L3 saves read them)."""
        assert all(page in self._key_of for page in pages), pages
        self._hold(client, self.clients[client], pages)

    def has(self, namespace: str, key: bytes) -> bool:
        """Whether ``key`` is published in ``namespace``."""
        return (namespace, key) in self._page_of

    def release(self, client: int, pages: list[int]) -> None:
        """The client is done with ``pages``: each one it holds or writes. Checked whole first."""
        c = self.clients[client]
        self._check_pages(client, pages, c.writing.union(c.held), "release", "it neither holds nor writes")
        for page in pages:
            if page in c.writing:
                c.writing.discard(page)
                del self._writer[page]
                self._free([page])
            else:
                self._unhold(client, page)

    def status(self) -> IndexStatus:
        per_ns = dict(+self._published_of)
        return IndexStatus(self.alloc.num_pages, self.alloc.num_free, len(self._writer), len(self._key_of), len(self._holders),
                           len(self.clients), per_ns, self.lookups, self.hit_pages, self.published_pages, self.evicted_pages,
                           self.dropped_writes, self.expired_leases, self.corrupt_pages, len(self.alloc.parked),
                           sum(len(h) == 1 and next(iter(h)) <= ADOPTION_CLIENTS for h in self._holders.values()),
                           self.finds, self.found_objects, self.expired_pages)

    def pages_by_namespace(self) -> dict[str, NamespacePages]:
        """Every namespace's pages now, from the counts kept as they change (and one pass over the pages being
        written). A duplicate page (unindexed) counts as held in its holder's namespace."""
        out: dict[str, NamespacePages] = {}
        for ns, n in self._published_of.items():
            if n:
                out.setdefault(ns, NamespacePages()).published = n
        for ns, n in self._held_of.items():
            if n:
                out.setdefault(ns, NamespacePages()).held = n
        for client in self._writer.values():
            out.setdefault(self.clients[client].namespace, NamespacePages()).leased += 1
        return out

    def _walk_namespaces(self) -> tuple[Counter[str], Counter[str]]:
        """Pages published and held per namespace, counted from the maps (what the kept counts must say)."""
        published = Counter(ns for ns, _key in self._page_of)
        held = Counter(self._namespace_of(page, self.clients[next(iter(holders))]) for page, holders in self._holders.items())
        return published, held

    # ---- internals ----------------------------------------------------------------------------
    def _check_pages(self, client: int, pages: list[int], mine: set[int], what: str, why: str) -> None:
        n = self.alloc.num_pages
        seen = set()
        for page in pages:
            if not 0 <= page < n:
                raise ServiceProtocolError(f"{what}: page {page} is outside the region (pages 0 to {n - 1})")
            if page not in mine:
                raise ServiceProtocolError(f"{what}: page {page} is not this client's: {why}")
            if page in seen:
                raise ServiceProtocolError(f"{what}: page {page} is listed twice")
            seen.add(page)

    def _hold(self, client: int, c: Client, pages: list[int]) -> None:
        unheld, n = self._unheld, self.num_pages
        tenants = self.tenants
        for page in pages:
            if unheld[page // n].pop(page, None) is not None and tenants is not None:
                tenants.held(page)
            holders = self._holders.get(page)
            if holders is None:
                holders = self._holders[page] = set()
                self._held_of[self._namespace_of(page, c)] += 1
            holders.add(client)
            c.held[page] = None

    def _namespace_of(self, page: int, holder: Client) -> str:
        """A READY page's namespace: its key's, or (a duplicate, held by its publisher alone) its holder's."""
        key = self._key_of[page]
        return key[0] if key is not None else holder.namespace

    def _unhold(self, client: int, page: int) -> None:
        c = self.clients[client]
        del c.held[page]
        holders = self._holders[page]
        holders.discard(client)
        if holders:
            return
        del self._holders[page]
        self._held_of[self._namespace_of(page, c)] -= 1
        if self._key_of[page] is None:  # a duplicate nobody can look up: its bytes are of no use now
            del self._key_of[page]
            self._free([page])
        else:
            self._unheld[page // self.num_pages][page] = self._clock()
            if self.tenants is not None:
                self.tenants.unheld(page)

    def _drop(self, page: int) -> None:
        """A READY page the watcher refused: unindexed now; freed now if nobody holds it, else once its holders
        release it (as a duplicate is)."""
        key = self._key_of[page]
        if key is None:
            return
        self.corrupt_pages += 1
        if page in self._unheld[page // self.num_pages]:
            self._evict(page)  # (counted as corrupt, not as evicted)
            return
        del self._page_of[key]
        self._published_of[key[0]] -= 1
        self._key_of[page] = None
        if self.tenants is not None:
            self.tenants.unindexed(page)

    def _evict(self, page: int, counter: str | None = None) -> None:
        """Evict an unheld page. ``counter``: why, counted in the index and in its tenant's row alike -- "evicted_pages"
        (room made), "expired_pages" (past the TTL); None: its caller counts it (a corrupt page)."""
        del self._unheld[page // self.num_pages][page]
        key = self._key_of.pop(page)
        del self._page_of[key]
        self._published_of[key[0]] -= 1
        if self.tenants is not None:
            self.tenants.unindexed(page, counter)
        self._vacated([page])
        self.alloc.free([page])
        if counter is not None:
            setattr(self, counter, getattr(self, counter) + 1)

    def check_integrity(self) -> None:
        """Every page is in exactly one state, and the maps agree with the clients' own books."""
        parked = set(self.alloc.parked)
        free = set(range(self.alloc.num_pages)) - self.alloc.allocated_pages()
        writing, ready = set(self._writer), set(self._key_of)
        assert not (free & writing or free & ready or writing & ready or parked & (free | writing | ready)), "a page is in two states"
        assert free | writing | ready | parked == set(range(self.alloc.num_pages)), "a page is in no state"
        unheld = {p for pool in self._unheld for p in pool}
        assert all(p // self.num_pages == k for k, pool in enumerate(self._unheld) for p in pool), "an unheld page in another pool's order"
        assert set(self._holders) | unheld == ready and not set(self._holders) & unheld
        assert {p: k for k, p in self._page_of.items()} == {p: k for p, k in self._key_of.items() if k is not None}
        assert all(self._key_of[p] is not None for p in unheld), "an unindexed page outlived its holders"
        for cid, c in self.clients.items():
            assert all(self._writer[p] == cid for p in c.writing)
            assert all(cid in self._holders[p] for p in c.held)
        assert sum(len(h) for h in self._holders.values()) == sum(len(c.held) for c in self.clients.values())
        published, held = self._walk_namespaces()
        assert +self._published_of == published and +self._held_of == held, "the per-namespace counts drifted from the maps"
        if self.tenants is not None:
            self.tenants.check(set(self._page_of.values()), unheld)
