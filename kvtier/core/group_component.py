"""One of a hybrid model's other KV groups on the prefix tree: its kind's rules, its pools' ids, and its
objects per tier, kept in slots of the nodes (:mod:`~kvtier.core.node_objects`), with its own eviction
order (a lazy heap per tier) and integrity check. The groups part (:mod:`~kvtier.core.group_objects`)
holds one per group and decides when its objects move."""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Callable, Iterable

from kvtier.alloc import PageAllocator
from kvtier.core.group_kinds import GroupKind
from kvtier.core.node_objects import NodeObjects
from kvtier.core.plans import Tier
from kvtier.groups import KVGroup
from kvtier.radix import NO_PAGE, PageNode

_last_access = operator.attrgetter("last_access")
_window_used = operator.attrgetter("window_used")

#: the tiers whose object ids a component keeps (L3 objects are named by their keys)
TIERS = (Tier.DEVICE, Tier.HOST)


class Component:
    """One non-full KV group: its kind's rules, its pools' page ids and, per tier, node -> object id (kept
    on the nodes: :mod:`~kvtier.core.node_objects`)."""

    __slots__ = ("group", "name", "kind", "alloc", "at", "heap", "fresh", "seq", "unready", "loaded", "backed_up", "evicted", "limited",
                 "saved", "fetched", "adopted", "filled", "load_failed", "sharing")

    def __init__(self, group: KVGroup, kind: GroupKind, device: PageAllocator | None, host: PageAllocator, at: dict[Tier, NodeObjects]):
        self.group = group
        self.name = group.name
        self.kind = kind
        #: (device None: the engine owns the group's device blocks)
        self.alloc = {Tier.DEVICE: device, Tier.HOST: host}
        self.at = at
        #: per tier, a lazy heap of (recency, seq, node) for eviction (None until the first eviction needs
        #: it, then built from what the tier holds), and the nodes attached since (pushed when next needed)
        self.heap: dict[Tier, list | None] = {Tier.DEVICE: None, Tier.HOST: None}
        self.fresh: dict[Tier, list[PageNode]] = {Tier.DEVICE: [], Tier.HOST: []}
        self.seq = itertools.count()
        #: host objects being copied on their own (their pages were on host already): not readable yet
        self.unready: set[PageNode] = set()
        #: objects moved host -> device (counted as their load completes, as the full pages are: beside the
        #: pages it loaded) / planned device -> host, evicted under the pool's pressure, and matches this
        #: group stopped short of what the full groups had
        self.loaded = self.backed_up = self.evicted = self.limited = 0
        #: objects planned into L3 and out of it; objects other engines published to the node service, adopted
        #: beside their pages (:meth:`~kvtier.core.group_objects.Groups.adopt_shared`)
        self.saved = self.fetched = self.adopted = 0
        #: objects completed loads brought back beside pages that had stayed on device (their object had
        #: not), and objects of loads that failed (beside pages or fills): apart from ``loaded``
        self.filled = self.load_failed = 0
        #: whether its ids are the full pages' own, in both tiers (one pool, one budget); its objects'
        #: recency is then their node's ``window_used``, not the node's own
        self.sharing = False

    def note(self, tier: Tier, nodes: Iterable[PageNode]) -> None:
        """``nodes``' objects just arrived in ``tier``: the eviction heap learns of them when next needed.
        Nothing is kept while no heap exists (a cache whose pool never fills pays nothing), and a
        backlog larger than the tier is dropped for a rebuild."""
        if self.heap[tier] is None:
            return
        fresh = self.fresh[tier]
        fresh.extend(nodes)
        if len(fresh) > 2 * len(self.at[tier]) + 64:
            self.heap[tier] = None
            fresh.clear()

    def stats(self) -> dict[str, int]:
        return {"device_objects": len(self.at[Tier.DEVICE]), "host_objects": len(self.at[Tier.HOST]), "loaded": self.loaded,
                "backed_up": self.backed_up, "saved": self.saved, "fetched": self.fetched, "adopted": self.adopted, "filled": self.filled,
                "load_failed": self.load_failed, "evicted": self.evicted, "limited_matches": self.limited}

    def take(self, tier: Tier, nodes: Iterable[PageNode]) -> list[int]:
        """Detach ``nodes``' objects in ``tier``; returns their ids (the caller frees or keeps them)."""
        at = self.at[tier]
        return [at.pop(n) for n in nodes if n in at]

    def evict(self, tier: Tier, n: int, movable: Callable[[PageNode, Tier, Component], bool], up_to: int | None = None) -> int | None:
        """Free ``n`` of this group's ids in ``tier``: least recently used unheld objects first (by their own
        recency in a shared pool, else their node's; a lazy heap as the tree keeps per tier); objects
        the kind keeps last (a state group's snapshots on leaves -- the last snapshot a cached prefix
        ends on) only after every other. ``up_to``: only objects used no later than that. Returns the
        recency of the next object that could go (None: none), so ``n=0`` only looks. ``movable(node, tier,
        self)``: whether nothing in flight moves, and no request holds, the object (the groups part knows)."""
        heap, at, seq = self.heap[tier], self.at[tier], self.seq
        stamp_of = _window_used if self.sharing else _last_access
        kept_last = self.kind.kept_last
        fresh = self.fresh[tier]
        if heap is None or len(heap) + len(fresh) > 2 * len(at) + 64:  # none yet, or mostly stale: built from the tier
            heap = self.heap[tier] = [(stamp_of(node), next(seq), node) for node in at]
            heapq.heapify(heap)
        else:
            for node in fresh:
                if node in at:  # (else it left since)
                    heapq.heappush(heap, (stamp_of(node), next(seq), node))
        fresh.clear()
        victims: dict[PageNode, None] = {}
        aside, last = [], []
        following = None
        while heap:
            entry = heap[0]
            stamp, _, node = entry
            if node not in at or node in victims:
                heapq.heappop(heap)
                continue  # stale: the object left (or is taken already)
            if stamp != stamp_of(node):
                heapq.heapreplace(heap, (stamp_of(node), next(seq), node))  # used since: back in at its new place
                continue
            if not movable(node, tier, self):
                aside.append(heapq.heappop(heap))
            elif len(victims) >= n or (up_to is not None and stamp > up_to):
                following = stamp
                break
            elif kept_last(node.num_children > 0):
                last.append(heapq.heappop(heap))
            else:
                heapq.heappop(heap)
                victims[node] = None
        for entry in last:
            if len(victims) < n:
                victims[entry[2]] = None
            else:
                aside.append(entry)
                following = entry[0] if following is None else min(following, entry[0])
        for entry in aside:
            heapq.heappush(heap, entry)
        if victims:
            self.alloc[tier].free(self.take(tier, victims))
            self.evicted += len(victims)
        return following

    def check(self, spare: Iterable[PageNode], caller: set[int], quarantined: set[int]) -> None:
        """Integrity per tier: ids owned once, each beside its node's page there, none also a caller's or the
        quarantine's (``caller``, ``quarantined``: this group's device ids they hold), and -- in a pool of its
        own -- the allocator's allocated ids exactly those (a pool shared with the pages is counted by
        the core's own accounting)."""
        for tier in TIERS:
            if self.alloc[tier] is None:  # the engine owns the group's device blocks
                continue
            at = self.at[tier]
            at.check(spare)
            ids = list(at.values())
            where = f"group {self.name}: a {tier.name.lower()} object"
            assert len(ids) == len(set(ids)), f"{where} is owned by two nodes"
            for node in at:  # (the tree's nodes: at.check counted those that left it)
                page = node.device_page if tier is Tier.DEVICE else node.host_page
                assert page != NO_PAGE, f"{where} without its node's page there"
            mine = caller if tier is Tier.DEVICE else set()
            held = quarantined if tier is Tier.DEVICE else set(self.alloc[tier].parked)
            assert not set(ids) & (mine | held), f"{where} owned by the tree and a caller or the quarantine"
            if self.sharing:  # the tier's own accounting counts them (Groups.shared_ids)
                assert all(hasattr(node, "window_used") for node in at), f"{where} without its recency"
                continue
            assert set(ids) | mine | held == self.alloc[tier].allocated_pages(), (
                f"group {self.name}: its {tier.name.lower()} allocator and the tree disagree (leak or foreign id)")
