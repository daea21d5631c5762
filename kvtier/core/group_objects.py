"""A hybrid model's other KV groups on the prefix tree: sliding-window pages and state snapshots.

The tree's own pages are the full-attention group's (every page of a prefix is
needed). Each other group (:mod:`kvtier.groups`) is a :class:`Component`: objects
of its own pools, per tier, attached to tree nodes (their ids kept in slots of the
nodes themselves, :mod:`~kvtier.core.node_objects`); what a boundary reads of it,
and how its objects rank, is its kind's business (:mod:`~kvtier.core.group_kinds`).

:class:`Groups` is a part the core holds (``core.groups``), built with explicit
inputs; a model of full attention only gets :data:`NO_GROUPS` instead, whose
calls do nothing, so that choice is made once, at construction. Rules that keep
this small and safe:

* **An object lives in a tier only beside its node's page there.** When a node's
  page leaves a tier (evicted, a failed copy, a failed load), its objects in that
  tier leave with it (:meth:`Groups.left`, called wherever the core clears a
  page); a failed load's objects are quarantined with its pages.
* **Objects move in the plan that moves their node's page** (a
  :class:`~kvtier.core.plans.GroupRun` on the same :class:`~kvtier.core.plans.Transfer`),
  so they are readable exactly when that page is: no second completion to join.
  A load back moves only the objects the request's boundary reads (its window,
  its snapshot); a backup moves every object the node holds on device.
* **An object a request reads is held** (:meth:`Groups.hold`) until the request
  ends; objects a plan in flight moves are never taken either. Other objects go
  under their own pool's pressure, least recently used first (:meth:`Groups.evict`).
* **A window page the size of a full page may share the full pages' pools**
  (pass the core's own allocators): one budget per tier, where the core weighs
  pages and window pages in one least-recently-used order
  (:meth:`~kvtier.core.device_space.DeviceSpace._make_room`). A window page's
  recency is its own (written, or read as a boundary's window), one stamp
  whichever tiers hold it, so a prefix's inner window pages age out while its
  pages stay.
* **A device page whose object was evicted there** gets it back from its host
  copy beside the next load (the load's *fills*); a failed fill quarantines the
  objects it brought.
* **On the node service** (a core whose host tier is shared, :mod:`~kvtier.core.shared_host`)
  each group's host objects are leased from the service too (an object pool of the region, or the
  pages' own pool where they share it), under their :func:`~kvtier.hashing.group_object_key`: a
  finished copy to host publishes the objects it wrote (:meth:`Groups.publish`), and pages adopted
  from other engines bring the objects the service holds for them (:meth:`Groups.adopt_shared`).
  An object so published is never written again (others may read it).

Tensorless: ids only, the executors move the bytes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import compress, repeat
from operator import is_not
from types import MappingProxyType

from kvtier.alloc import PageAllocator
from kvtier.core.group_component import TIERS, Component
from kvtier.core.group_kinds import HybridPrefix, kind_of, usable_prefix
from kvtier.core.node_objects import NodeObjects
from kvtier.core.plans import GroupRun, Tier
from kvtier.core.tags import GroupLoad
from kvtier.errors import ConfigError, PageIndexError, PageOwnershipError, UnknownNameError
from kvtier.groups import ModelSpec
from kvtier.hashing import PageHash, group_object_key
from kvtier.pages import first_duplicate
from kvtier.radix import NO_PAGE, SAVING, PageNode, PrefixTree, node_type_with
from kvtier.spec import KVSpec

#: questions to L3 about group objects per match, at most (a bound on a lookup's round trips)
L3_PROBES = 8
_NO_LOADS: Mapping[PageNode, int] = MappingProxyType({})


class NoGroups(tuple):
    """A model of full attention only: no other group, every call a no-op. Falsy, so a core that must
    build arguments for :class:`Groups` first asks ``if self.groups`` -- and an empty tuple, so that asking
    costs a C-level length test, not a Python call, on every hot path of a full-attention model
    (:class:`Groups` is truthy the same way: it defines no ``__bool__``)."""

    __slots__ = ()
    components: tuple = ()
    sharing: tuple = ()

    def component(self, name: str) -> Component:
        raise UnknownNameError("KV group beside full attention", name, [])

    def check_given(self, groups: dict, num_pages: int) -> None:
        """Objects handed in for groups this model does not have: the first is an :class:`UnknownNameError`."""
        for name in groups:
            self.component(name)

    def left(self, tier: Tier, nodes: Iterable[PageNode]) -> None:
        """(Pages left ``tier``: no objects beside them.)"""

    def publish(self, nodes: Iterable[PageNode], moved: Mapping[str, Sequence[PageNode]] | None = None,
                labels: Sequence[str] | None = None) -> None:
        """(No objects to publish.)"""

    def adopt_shared(self, nodes: Sequence[PageNode]) -> None:
        """(No objects to adopt.)"""

    def hold_late(self, op: int, nodes: Iterable[PageNode]) -> None:
        """(A plan given up on: no objects of its pages to hold.)"""

    def released_late(self, op: int) -> None:
        """(Its late answer came: nothing was held.)"""

    def shared_ids(self, tier: Tier, caller=None, quarantined=None) -> set[int]:
        return set()


NO_GROUPS = NoGroups()


class Groups:
    """Every non-full group's objects (see the module docstring).

    ``pools``: each group's (device allocator or None when the engine owns the device, host allocator);
    the core's own allocators (``device``, ``host``) given for a group mean its objects share the
    full pages' pools. ``loading``: the core's device loads in flight (node -> op; their objects come
    with them). ``make_room(tier, n)``: the core frees ``n`` ids of a pool shared with its pages."""

    def __init__(self, model: ModelSpec, pools: dict[str, tuple[PageAllocator | None, PageAllocator]], *, tree: PrefixTree,
                 page_size: int, state_every: int, device: PageAllocator | None, host: PageAllocator,
                 loading: Mapping[PageNode, int] = _NO_LOADS, make_room: Callable[[Tier, int], None] | None = None):
        if type(state_every) is not int or state_every < 1:
            raise ConfigError(f"state_every must be a whole number of pages >= 1, got {state_every!r}")
        others = [g for g in model.groups if g.kind != "full"]
        for g in others:
            if g.name not in pools:
                raise ConfigError(f"KV group {g.name!r} ({g.kind}) of model {model.name!r} has no pools: pass "
                                  f"group_pools={{{g.name!r}: (device allocator, host allocator)}}")
        unknown = set(pools) - {g.name for g in others}
        if unknown:
            raise ConfigError(f"group_pools names {sorted(unknown)}, which are not groups of {model.name!r} beside full attention")
        self.model = model
        self.page_size = page_size
        self.state_every = state_every
        self.tree = tree
        self.loading = loading
        self.make_room = make_room
        #: node -> how many requests read its objects now (never evicted while held)
        self.holds: dict[PageNode, int] = {}
        #: plans given up on (a prefetch past its budget, a timeout) -> the host object ids they may still write
        self.held_for: dict[int, dict[str, list[int]]] = {}
        # each group's object ids, per tier, in slots of the tree's nodes
        slot = {(k, tier): f"objects_{k}_{tier.name.lower()}" for k in range(len(others)) for tier in TIERS}
        node_type = node_type_with(tuple(slot.values()))
        tree.use_node_type(node_type)
        self.components: list[Component] = []
        for k, g in enumerate(others):
            at = {tier: NodeObjects(slot[k, tier], node_type, tree.nodes) for tier in TIERS}
            self.components.append(Component(g, kind_of(g, page_size), *pools[g.name], at))
        self.kinds = [c.kind for c in self.components]
        self.by_name = {c.name: c for c in self.components}
        for c in self.components:
            self._check_sharing(c, device, host)
        #: the groups whose objects take the full pages' ids
        self.sharing = [c for c in self.components if c.sharing]
        #: whether the host tier is the node service's (set by the core): objects are published and adopted
        self.shared_host = False

    # ---- objects on a shared host tier (the node service) ------------------------------------------
    def check_shared(self) -> None:
        """On the node service, each group's host objects must be the service's too (an object pool's lease, or the
        pages' own pool): a :class:`ConfigError` before anything is built on a host pool of this process's own."""
        for c in self.components:
            if not callable(getattr(c.alloc[Tier.HOST], "find", None)):
                raise ConfigError(f"KV group {c.name!r}: on the node service its host objects must be the service's too (the "
                                  "allocator of its object pool, LeasedPages.objects, or the pages' own); build the cache with "
                                  "build_hybrid_cache and TierConfig.service")
        self.shared_host = True

    def publish(self, nodes: Iterable[PageNode], moved: Mapping[str, Sequence[PageNode]] | None = None,
                labels: Sequence[str] | None = None) -> None:
        """Copies to host completed: the host objects they wrote are offered to other engines -- every object ``nodes``
        hold on host (a backup of their pages brought them all), or ``moved``'s alone (a copy of objects on their own).
        ``labels``: the tenants' labels by owner id (each object is its page's tenant's)."""
        if not self.shared_host:
            return
        nodes = list(nodes)
        for c in self.components:
            mine = (moved or {}).get(c.name, ()) if moved is not None else nodes
            host = c.at[Tier.HOST].id_of
            at = [(n, host(n)) for n in mine]
            at = [(n, i) for n, i in at if i is not None]
            if at:
                c.alloc[Tier.HOST].publish([group_object_key(n.key, c.name) for n, _ in at], [i for _, i in at],
                                           None if labels is None else [labels[n.owner] for n, _ in at])

    def adopt_shared(self, nodes: Sequence[PageNode]) -> None:
        """``nodes`` are pages just adopted from other engines (readable host pages): their objects the service holds
        hang on them too, as readable host objects (as many as each group's share has room for)."""
        if not self.shared_host or not nodes:
            return
        for c in self.components:
            alloc = c.alloc[Tier.HOST]
            found = alloc.find([group_object_key(n.key, c.name) for n in nodes])
            at = [(n, i) for n, i in zip(nodes, found) if i is not None]
            if not at:
                continue
            n_booked = alloc.adopt([i for _, i in at])
            at = at[:n_booked]
            if not at:
                continue
            hung = [n for n, _ in at]
            c.at[Tier.HOST].attach_new(hung, [i for _, i in at])
            c.note(Tier.HOST, hung)
            c.adopted += len(hung)
            if c.sharing:
                self.used(hung)

    def _check_sharing(self, c: Component, device: PageAllocator | None, host: PageAllocator) -> None:
        shares = (device is not None and c.alloc[Tier.DEVICE] is device, c.alloc[Tier.HOST] is host)
        if not any(shares):
            return
        where = f"KV group {c.name!r} ({c.group.kind}) shares the full pages' pool"
        if device is None:
            raise ConfigError(f"{where}: with the engine owning the device, a group's host objects keep a pool of their own; "
                              "pass a host allocator that is not the cache's")
        if not all(shares):
            raise ConfigError(f"{where} in one tier only: pass the cache's own allocators for both tiers, or neither")
        obj = c.group.object_spec()
        page_bytes = self.model.full_group().attention.page_bytes
        if c.group.keeps != "attention" or obj.page_bytes > page_bytes:
            raise ConfigError(f"{where}, but its objects are {obj.page_bytes} bytes and a page {page_bytes}: only "
                              "sliding-window groups whose page fits a full page's slot can share it; split the group's layers "
                              "(as vLLM's hybrid allocator does) or give it a pool of its own")
        c.sharing = True

    def component(self, name: str) -> Component:
        c = self.by_name.get(name)
        if c is None:
            raise UnknownNameError("KV group beside full attention", name, [c.name for c in self.components])
        return c

    def holds_object(self, name: str, node: PageNode, gid: int) -> bool:
        """Whether ``node`` still holds device object ``gid`` of group ``name`` (a failed load takes them)."""
        return self.component(name).at[Tier.DEVICE].get(node) == gid

    # ---- the prefix every group can continue from -----------------------------------------
    def prefix(self, path: Sequence[PageNode], n_dev: int, full: int, *, fill: list[bool] | None = None) -> HybridPrefix:
        """The longest prefix of ``path[:full]`` usable in every group: an object counts where its node's
        page is usable -- on device for the first ``n_dev`` nodes, a readable host copy after them
        (the load back brings it along). ``fill``: a device node's object counts from a readable host
        copy too (its page stayed on device, the object was evicted there: the load back brings it),
        and ``fill[0]`` is set once one did."""
        if full <= n_dev:  # the usual case, in C per group: every object the whole prefix reads is on device
            for c in self.components:
                if None in map(c.at[Tier.DEVICE].id_of, path[c.kind.places(full).start : full]):
                    break
            else:
                return HybridPrefix(full, None)
        return usable_prefix(full, self.kinds, self.tree_has(path, n_dev, fill))

    def usable(self, pages: int, has: dict[str, Callable[[int], bool]]) -> int:
        """The longest prefix of ``pages`` pages every group continues from, presence asked per place."""
        return usable_prefix(pages, self.kinds, has).pages

    def first_read(self, pages: int) -> int:
        """Where the run of pages whose objects a prefix of ``pages`` pages reads starts: every group's
        places end with the prefix."""
        return min([c.kind.places(pages).start for c in self.components], default=pages)

    def given_objects(self, nodes: Sequence[PageNode]) -> tuple[dict[str, dict[int, int]], list[PageNode]]:
        """The device objects a request continuing from the end of ``nodes`` reads (group -> place -> id),
        and the nodes they hang on, held for it (:meth:`hold`)."""
        given: dict[str, dict[int, int]] = {}
        for c in self.components:
            places = c.kind.places(len(nodes))
            mine = nodes[places.start :]
            given[c.name] = dict(zip(places, map(c.at[Tier.DEVICE].id_of, mine)))  # (each is there: the prefix is usable)
            if c.sharing:
                self.used(mine)
        held = list(nodes[self.first_read(len(nodes)) :])
        self.hold(held)
        return given, held

    def handed_places(self, name: str, first: int, pages: int, *, at_end: bool = True) -> Sequence[int]:
        """Where the cache wants group ``name``'s objects of a request that computes pages ``first .. pages-1``."""
        return self.component(name).kind.handed_places(first, pages, self.state_every, at_end=at_end)

    # ---- objects handed in ----------------------------------------------------------------------
    def check_given(self, groups: dict[str, Sequence[int | None]], num_pages: int) -> None:
        """An insert's check of the other groups' ids, before anything changes: known groups, one entry
        per page, ids of the group's device pool that are allocated, not the cache's, each once."""
        for name, ids in groups.items():
            c = self.component(name)
            where = f"insert, KV group {name!r}"
            if not isinstance(ids, (list, tuple)) or len(ids) != num_pages:
                raise PageOwnershipError(f"{where}: pass a list of one entry per full page ({num_pages}): an id of the "
                                         f"group's device pool, or None; got {type(ids).__name__}")
            given = [i for i in ids if i is not None]
            alloc = c.alloc[Tier.DEVICE]
            bad = [i for i in given if type(i) is not int or not 0 <= i < alloc.num_pages]
            if bad:
                raise PageIndexError(f"{where}: {bad[0]!r} is not an id of its device pool of {alloc.num_pages}")
            if len(set(given)) != len(given):
                raise PageOwnershipError(f"{where}: id {first_duplicate(given)} is listed twice")
            owned = set(c.at[Tier.DEVICE].values())
            for i in given:
                if i in owned or not alloc.is_allocated(i):
                    raise PageOwnershipError(f"{where}: id {i} is not the caller's (the cache holds it, or it was never "
                                             f"allocated): pass ids from alloc_group")

    def attach(self, nodes: Sequence[PageNode], groups: dict[str, Sequence[int | None]], fresh: int) -> list[PageNode]:
        """Hang the caller's objects on ``nodes`` (all on device now; ``nodes[fresh:]`` new, holding none);
        where a node holds one already, the caller's copy goes back to the pool. Returns the nodes the
        cache had already that got an object."""
        new_nodes = nodes[fresh:]  # (made with this insert's stamp: as recent as their pages, no used() needed)
        gained: dict[PageNode, None] = {}
        for name, ids in groups.items():
            c = self.component(name)
            dev = c.at[Tier.DEVICE]
            new_ids = ids[fresh:]
            if None in new_ids:  # (in C too: the nodes whose id is not None)
                keep = list(map(is_not, new_ids, repeat(None)))
                attached = list(compress(new_nodes, keep))
                dev.attach_new(attached, list(compress(new_ids, keep)))
                c.note(Tier.DEVICE, attached)
            else:  # the usual case, in C: an object for every new page
                dev.attach_new(new_nodes, new_ids)
                c.note(Tier.DEVICE, new_nodes)
            old_ids = ids[:fresh]
            if old_ids.count(None) == fresh:  # the usual case: nothing handed for pages the cache had
                continue
            dup = []
            for node, i in compress(zip(nodes[:fresh], old_ids), map(is_not, old_ids, repeat(None))):
                have = dev.get(node)
                if have is None:
                    dev[node] = i
                    c.note(Tier.DEVICE, (node,))
                    if c.sharing:
                        self.used((node,))
                    gained[node] = None
                elif have != i:
                    dup.append(i)
            if dup:
                c.alloc[Tier.DEVICE].free(dup)
        return list(gained)

    # ---- holds --------------------------------------------------------------------------------
    def hold(self, nodes: Sequence[PageNode]) -> None:
        """Keep the objects of ``nodes`` (every group) from eviction until :meth:`release`."""
        holds = self.holds
        for n in nodes:
            holds[n] = holds.get(n, 0) + 1

    def release(self, nodes: Sequence[PageNode]) -> None:
        holds = self.holds
        for n in nodes:
            left = holds[n] - 1
            if left:
                holds[n] = left
            else:
                del holds[n]

    def hold_late(self, op: int, nodes: Iterable[PageNode]) -> None:
        """Plan ``op`` was given up on and may still write its nodes' host objects: their ids stay out of the
        pools, freed or not, until :meth:`released_late`."""
        nodes = list(nodes)
        held = {}
        for c in self.components:
            host = c.at[Tier.HOST]
            ids = [host[n] for n in nodes if n in host]
            if ids:
                c.alloc[Tier.HOST].hold(ids)
                held[c.name] = ids
        if held:
            self.held_for[op] = held

    def released_late(self, op: int) -> None:
        for name, ids in self.held_for.pop(op, {}).items():
            self.component(name).alloc[Tier.HOST].release_hold(ids)

    # ---- objects moving with their pages ----------------------------------------------------------
    def runs(self, nodes: Sequence[PageNode], src: Tier, dst: Tier, wanted: dict[str, list[int]] | None = None) -> tuple[GroupRun, ...]:
        """The objects of ``nodes`` held in ``src`` (``wanted``: only these places, per group), each given
        an id in ``dst`` (as many as that pool can give after eviction; the rest stay behind) and attached
        there at once: readable when their nodes' pages are, which this plan decides.

        L3: a save takes every object its nodes hold on host, named by its key; a fetch brings the
        ``wanted`` places (the store was asked that they are there) into new host ids."""
        runs = []
        for c in self.components:
            places = wanted.get(c.name, ()) if wanted is not None else range(len(nodes))
            unready = c.unready
            if dst is Tier.STORAGE:
                have = c.at[src].id_of  # (attrgetters: no Python call per node)
                at = [i for i in places if have(nodes[i]) is not None and nodes[i] not in unready]
                if at:
                    runs.append(GroupRun(c.name, tuple(at), tuple([have(nodes[i]) for i in at]), (),
                                         tuple([group_object_key(nodes[i].key, c.name) for i in at])))
                    c.saved += len(at)
                continue
            there = c.at[dst].id_of
            if src is Tier.STORAGE:
                at = [i for i in places if there(nodes[i]) is None]
            else:
                have = c.at[src].id_of
                at = [i for i in places if have(nodes[i]) is not None and there(nodes[i]) is None and nodes[i] not in unready]
            if not at:
                continue
            ids = self.alloc(c, dst, len(at))  # (a load back holds the objects it reads: room never takes them)
            at = at[: len(ids)]
            if not at:
                continue
            moved = [nodes[i] for i in at]
            c.at[dst].attach_new(moved, ids)  # (none of them holds one in dst: filtered above)
            c.note(dst, moved)
            if c.sharing and src is not Tier.DEVICE:  # a load back or a fetch reads them now (a copy to host keeps their recency)
                self.used(moved)
            if src is Tier.STORAGE:
                runs.append(GroupRun(c.name, tuple(at), (), tuple(ids), tuple([group_object_key(nodes[i].key, c.name) for i in at])))
                c.fetched += len(at)
                continue
            runs.append(GroupRun(c.name, tuple(at), tuple(map(have, moved)), tuple(ids)))
            if dst is Tier.HOST:  # (a load counts when it completes: count_loads)
                c.backed_up += len(at)
        return tuple(runs)

    def wanted(self, boundary: int, first: int, end: int) -> dict[str, list[int]]:
        """Per group, the objects a prefix of ``boundary`` pages reads that fall among pages
        ``first .. end - 1``, as places counted from ``first``."""
        return {c.name: [i - first for i in c.kind.places(boundary) if first <= i < end] for c in self.components}

    def load_runs(self, path: Sequence[PageNode], start: int, first: int,
                  served: int) -> tuple[tuple[GroupRun, ...], tuple[PageNode, ...], tuple[GroupLoad, ...]]:
        """What a load back of ``path[first : first + served]`` brings beside its pages for the boundary
        ``len(path)``: the objects it reads among them, and the fills -- objects of the device pages
        ``path[start:first]`` that only a host copy holds (not of a page another load is still bringing:
        its objects come with it, or not at all). A fill rides on the first page loaded (on a plan of
        no pages: on the plan). Returns the runs, the nodes filled and what it brings of each group."""
        span = path[start : first + served]
        above = first - start
        wanted = self.wanted(len(path), start, first + served)
        if above and self.loading:
            loading = self.loading
            wanted = {name: [i for i in places if i >= above or span[i] not in loading] for name, places in wanted.items()}
        runs = self.runs(span, Tier.HOST, Tier.DEVICE, wanted)
        counts = tuple([GroupLoad(run.group, len(run.at) - bisect_left(run.at, above), bisect_left(run.at, above)) for run in runs])
        if not above:
            return runs, (), counts
        fills = tuple([span[i] for i in sorted({i for run in runs for i in run.at if i < above})])
        return tuple([replace(run, at=tuple([max(0, i - above) for i in run.at]) if served else ()) for run in runs]), fills, counts

    def count_loads(self, loads: Sequence[GroupLoad], done: bool) -> None:
        """A load's completion: the objects it brought count as loaded (or filled), or, had it failed, apart."""
        for load in loads:
            c = self.by_name[load.group]
            if done:
                c.loaded += load.loaded
                c.filled += load.filled
            else:
                c.load_failed += load.loaded + load.filled

    def prefetch_runs(self, first: int, nodes: Sequence[PageNode]) -> tuple[GroupRun, ...]:
        """A prefetch of ``nodes`` (the pages after the match's first ``first``) brings the objects its
        boundary reads that fall among them: the window's pages, the snapshot at its end."""
        end = first + len(nodes)
        return self.runs(nodes, Tier.STORAGE, Tier.HOST, self.wanted(end, first, end))

    def usable_arrived(self, last: PageNode, arrived: int) -> int:
        """A prefetch brings the objects its last boundary reads: cut short with ``arrived`` pages in, ending at
        node ``last``, it can be continued from only as far as every group's objects are there (often not at all)."""
        path = list(last.path_to_root())[::-1]
        above = len(path) - arrived
        return max(0, self.prefix(path, self.tree.device_prefix(path), len(path)).pages - above)

    def objects_to_copy(self, nodes: Sequence[PageNode], sources: dict[str, dict[PageNode, int]] | None = None
                        ) -> tuple[tuple[GroupRun, ...], list[PageNode], dict[str, list[PageNode]]]:
        """``nodes`` (their host copies ready) have device objects those copies lack -- objects attached
        after the page went to host, a shorter prompt's last snapshot on a shared prefix, an engine's
        window pages beside pages cached without them: host ids for those alone, from the tree's device
        objects or (``sources``, an engine's) the ids given per group and node, attached and not readable
        until :meth:`copied`. Returns the runs of a plan of no pages, the nodes they hang on, and per
        group the nodes whose objects it writes (what :meth:`copied` decides)."""
        runs, moving, moved = [], {}, {}
        for c in self.components:
            dev, host = c.at[Tier.DEVICE] if sources is None else sources.get(c.name, {}), c.at[Tier.HOST]
            todo = [n for n in nodes if n in dev and n not in host]
            if not todo:
                continue
            ids = self.alloc(c, Tier.HOST, len(todo))
            todo = todo[: len(ids)]
            if not todo:
                continue
            host.update(zip(todo, ids))
            c.note(Tier.HOST, todo)
            c.unready.update(todo)
            c.backed_up += len(todo)
            runs.append(GroupRun(c.name, (), tuple([dev[n] for n in todo]), tuple(ids)))
            moving.update(dict.fromkeys(todo))
            moved[c.name] = todo
        return tuple(runs), list(moving), moved

    def copied(self, moved: Mapping[str, Sequence[PageNode]], ok: bool) -> None:
        """:meth:`objects_to_copy`'s plan completed: the host objects it wrote (``moved``: per group, the
        nodes they hang on) are readable, or (failed) freed. Its own only: another group's object of the
        same page may be on its way to host in a plan of its own (an engine's snapshot copied out beside
        a page, its window page by a later offload), and that plan's completion decides it."""
        for name, nodes in moved.items():
            c = self.by_name[name]
            mine = [n for n in nodes if n in c.unready]
            c.unready.difference_update(mine)
            if not ok:  # the host objects hold nothing good: back to the pool
                c.alloc[Tier.HOST].free(c.take(Tier.HOST, mine))

    def stored_usable(self, path: Sequence[PageNode], n_dev: int, keys: Sequence[PageHash], stored: int,
                      stored_prefix: Callable[[list[bytes]], int]) -> int:
        """Of the ``stored`` pages after ``path`` (all of it usable) that L3 holds, how many a request can
        continue from: the longest prefix whose objects are present -- in the tree for its nodes, in
        L3 (``stored_prefix``: how many leading keys the store holds; a few keys per question, at most
        ``L3_PROBES`` questions) after them."""
        start = len(path)
        known: dict[tuple[str, int], bool] = {}
        probes = [0]
        tree_has = self.tree_has(path, n_dev)

        def in_store(c: Component, i: int, span: int) -> bool:
            """Whether L3 holds ``c``'s object for place ``i``: asked with the places below it, up to
            ``span`` of them (a window's worth: one question usually answers a whole window)."""
            lo = max(start, i - span + 1)
            while (c.name, i) not in known:
                if probes[0] >= L3_PROBES:
                    return False  # asked enough: the rest counts as absent
                probes[0] += 1
                asked = keys[lo : i + 1]
                n = stored_prefix([group_object_key(k, c.name) for k in asked])
                for j in range(n):
                    known[(c.name, lo + j)] = True
                if n < len(asked):
                    known[(c.name, lo + n)] = False
                lo += n + 1
            return known[(c.name, i)]

        has = {}
        for c in self.components:
            span = len(c.kind.places(start + stored))
            has[c.name] = lambda i, c=c, inside=tree_has[c.name], span=span: inside(i) if i < start else in_store(c, i, span)
        return usable_prefix(start + stored, self.kinds, has).pages - start

    def tree_has(self, path: Sequence[PageNode], n_dev: int, fill: list[bool] | None = None) -> dict[str, Callable[[int], bool]]:
        """Per group, whether the object at a place of ``path`` is in the tree where it counts: on device for
        the first ``n_dev`` nodes (``fill``: or on host, noted in ``fill[0]``), on host after them."""
        has = {}
        loading = self.loading  # (a page still being loaded gets its objects from that load, not from a fill)
        for c in self.components:
            dev, host = c.at[Tier.DEVICE].id_of, c.at[Tier.HOST].id_of
            unready = c.unready

            def at(i: int, dev=dev, host=host, unready=unready) -> bool:
                node = path[i]
                if i >= n_dev:
                    return host(node) is not None and node not in unready
                if dev(node) is not None:
                    return True
                if fill is None or host(node) is None or node in unready or node in loading:
                    return False
                fill[0] = True
                return True

            has[c.name] = at
        return has

    def object_fills(self, nodes: Sequence[PageNode], n_dev: int) -> int | None:
        """The first of ``nodes[:n_dev]`` (device pages, none still being loaded) whose object a request
        continuing from the end of ``nodes`` reads is not on device (None: all are): the load back
        brings it from its host copy."""
        first, loading = None, self.loading
        for c in self.components:
            dev = c.at[Tier.DEVICE]
            for i in c.kind.places(len(nodes)):
                if i < n_dev and nodes[i] not in dev and nodes[i] not in loading and (first is None or i < first):
                    first = i
                    break
        return first

    def left(self, tier: Tier, nodes: Iterable[PageNode]) -> None:
        """``nodes``' pages left ``tier``: so do their objects there (their ids go back to the pools)."""
        for c in self.components:
            if c.at[tier]:
                gone = c.take(tier, nodes)
                if gone:
                    c.alloc[tier].free(gone)

    def quarantined(self, nodes: Iterable[PageNode]) -> dict[str, list[int]]:
        """A failed load's nodes: their device objects leave the tree, ids kept until the quarantine ends."""
        out = {}
        for c in self.components:
            gone = c.take(Tier.DEVICE, nodes)
            if gone:
                out[c.name] = gone
        return out

    def free_ids(self, tier: Tier, ids: dict[str, list[int]]) -> None:
        for name, pages in ids.items():
            self.component(name).alloc[tier].free(pages)

    # ---- objects' own recency, in a pool they share with the full pages ---------------------------
    def used(self, nodes: Sequence[PageNode]) -> None:
        """``nodes``' window pages in a shared pool were written or read now. One stamp per node
        (``PageNode.window_used``) whichever tier holds the page, as the tree keeps one per page; the
        window groups sharing a pool share it (a boundary reads all their windows at once)."""
        now = self.tree.now
        for node in nodes:
            node.window_used = now

    # ---- each group's own pool pressure ---------------------------------------------------------
    def alloc(self, c: Component, tier: Tier, n: int) -> list[int]:
        """Up to ``n`` ids of ``c``'s pool in ``tier``, evicting its unheld objects, LRU first, if needed
        (a pool shared with the full pages: the core makes room, weighing pages and objects)."""
        alloc = c.alloc[tier]
        if alloc.num_free < n:
            if c.sharing:
                self.make_room(tier, n - alloc.num_free)
            else:
                self.evict(c, tier, n - alloc.num_free)
        return alloc.alloc(min(n, alloc.num_free)).pages

    def movable(self, node: PageNode, tier: Tier, c: Component) -> bool:
        """An object of ``node`` in ``tier`` that no plan in flight reads or writes and no request holds."""
        if node in self.holds or node in self.loading or node in c.unready:
            return False
        if tier is Tier.HOST and node.stored == SAVING:  # an L3 save reads it
            return False
        # a host copy being made (a backup reads the device object, writes the host one) is not readable yet
        return node.host_page == NO_PAGE or node.host_ready

    def evict(self, c: Component, tier: Tier, n: int, up_to: int | None = None) -> int | None:
        """Free ``n`` of ``c``'s ids in ``tier`` (:meth:`Component.evict`), taking only objects no plan in
        flight moves and no request holds; returns the recency of the next object that could go."""
        return c.evict(tier, n, self.movable, up_to)

    # ---- accounting ------------------------------------------------------------------------------
    def check(self, caller: dict[str, set[int]], quarantined: dict[str, set[int]], idle: bool) -> None:
        if idle:
            assert not self.holds, f"idle, yet {len(self.holds)} nodes' group objects are held"
            assert not any(c.unready for c in self.components), "idle, yet a group object's copy to host is recorded in flight"
        spare = self.tree.spare_nodes()
        for c in self.components:
            c.check(spare, caller.get(c.name, set()), quarantined.get(c.name, set()))

    def shared_ids(self, tier: Tier, caller: dict[str, set[int]] | None = None,
                   quarantined: dict[str, set[int]] | None = None) -> set[int]:
        """The ids of ``tier``'s own pool that other groups' objects hold (the tree's, a caller's, the
        quarantine's): the tier's accounting adds them to its pages."""
        out: set[int] = set()
        for c in self.sharing:
            out.update(c.at[tier].values())
            out.update((caller or {}).get(c.name, ()))
            out.update((quarantined or {}).get(c.name, ()))
        return out


def groups_for(model: ModelSpec | None, pools: dict[str, tuple[PageAllocator | None, PageAllocator]] | None, spec: KVSpec,
               **inputs) -> Groups | NoGroups:
    """The groups part of a core whose tree keeps ``spec``'s pages: :data:`NO_GROUPS` for a model of full
    attention only (or none), else :class:`Groups` over ``pools`` (``inputs``: its keyword inputs). A
    model whose full group ``spec`` is not, or pools without a model, are a :class:`ConfigError`."""
    if model is None:
        if pools:
            raise ConfigError(f"group_pools for {sorted(pools)} given without model=: a group's pools serve a hybrid model's "
                              "KV groups; pass the model's ModelSpec")
        return NO_GROUPS
    full = model.full_group()
    if full.attention.fingerprint() != spec.fingerprint():
        raise ConfigError(f"the cache's pools hold {spec.attention} pages of {spec.page_size} tokens over {spec.num_layers} layers "
                          f"(fingerprint {spec.fingerprint()}), not model {model.name!r}'s full-attention group {full.name!r} "
                          f"({full.attention.attention}, {full.attention.page_size} tokens, {full.attention.num_layers} layers, "
                          f"fingerprint {full.attention.fingerprint()}): build the pools from model.full_group().attention")
    if not model.is_hybrid:
        if pools:
            raise ConfigError(f"group_pools for {sorted(pools)} given, and model {model.name!r} has no KV group beside full attention")
        return NO_GROUPS
    return Groups(model, pools or {}, page_size=spec.page_size, **inputs)
