"""Replay a trace through the policy core itself, on executors that move no bytes.

The real policy (:class:`~kvtier.core.CacheCore`: LRU per tier, write
policies, L3 saves and wait_complete prefetch) over page ids alone, one core
per node, each on an :class:`~kvtier.executors.accounting.AccountingExecutor`,
all sharing one :class:`~kvtier.executors.accounting.AccountingStore` as their
L3. Every configuration runs here, through the request API an engine uses
(``begin`` / ``alloc`` / ``commit``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import CacheCore, Tier
from kvtier.executors.accounting import AccountingExecutor, AccountingStore
from kvtier.hashing import Namespace, PageHash
from kvtier.app.plan.config import (L3_BATCH_PAGES, Capacity, PlanConfig, ReplayCounts, group_capacity, planning_model, planning_spec,
                                    window_groups)
from kvtier.groups import ModelSpec
from kvtier.spec import KVSpec
from kvtier.app.workloads.mooncake import TraceRequest

#: what a request hands over beside its pages at commit: ``(core, request, usable pages, pages) -> {group: ids}``
Handover = Callable[[CacheCore, object, int, int], dict[str, list[int | None]]]


@dataclass(frozen=True)
class NodeShape:
    """What each node's core is built from, and how its engine hands a hybrid model's objects over.

    The planner's (:meth:`of_plan`): the plan's model at one page per trace block. An engine's
    (``kvtier plan --validate``): that engine's model and page, its own handover -- so the replay
    makes exactly the calls the engine makes."""

    spec: KVSpec
    model: ModelSpec | None = None
    #: sliding-window groups whose pages take the full pages' slots
    shared: tuple[str, ...] = ()
    #: the other groups with pools of their own, one object id per slot of a tier
    own: tuple[str, ...] = ()
    state_every: int = 1
    #: None: the planner's engine (:func:`_group_objects`)
    handover: Handover | None = None

    @classmethod
    def of_plan(cls, cfg: PlanConfig) -> NodeShape:
        model = planning_model(cfg)
        own = tuple(group_capacity(cfg, Capacity(1, 1, None)))
        return cls(planning_spec(cfg), model, tuple(window_groups(cfg)), own, cfg.state_every)

    @property
    def slots_per_block(self) -> int:
        """The most slots one cached block takes: its full page and a page of each window group sharing the pool."""
        return 1 + len(self.shared)


def _block_keys(requests: list[TraceRequest]) -> dict[int, PageHash]:
    """One 128-bit key per distinct trace block id (the trace's ids are already chained hashes), made once."""
    return {h: PageHash(h.to_bytes(16, "little", signed=False)) for h in {h for r in requests for h in r.hash_ids}}


def _node_cache(shape: NodeShape, cap: Capacity, storage: AccountingStore | None, cache_cfg: CacheConfig) -> CacheCore:
    device, host = PageAllocator(cap.device, "device"), PageAllocator(cap.host, "host")
    pools = {name: (device, host) for name in shape.shared}  # these window pages take the full pages' slots
    for name in shape.own:  # one object id per slot: objects never compete for their pool
        pools[name] = (PageAllocator(cap.device, f"{name} device"), PageAllocator(cap.host, f"{name} host"))
    spec, model = shape.spec, shape.model
    # no preallocated nodes: they keep a long-running server's collector idle, while a replay would
    # build one per page of every node's pools up front (16 nodes: ~400k) for a trace that needs fewer
    return CacheCore(
        spec,
        device,
        host,
        AccountingExecutor(storage),
        replace(cache_cfg, preallocate_nodes=False),
        StorageConfig(url="memory://"),
        namespace=Namespace(spec.name, (model or spec).fingerprint()),
        model=model,
        group_pools=pools,
        state_every=shape.state_every,
    )


@contextmanager
def collector_paused() -> Iterator[None]:
    """CPython's cyclic collector off for a replay (back on after, if it was on).

    Why: a replay builds tens of thousands of long-lived tree nodes per node, and each full
    collection walks the whole heap (torch's objects included: ~130 ms on the shipped trace, a
    fifth of a replay), yet a replay makes no cyclic garbage while it runs -- what it drops,
    reference counting frees -- so those walks find nothing. Its cores, which do hold cycles,
    are collected once it ends (tests/test_plan.py checks both)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def replay_cache(
    requests: list[TraceRequest],
    shape: NodeShape,
    cache_cfg: CacheConfig,
    cap: Capacity,
    nodes_of: Sequence[int],
    nodes: int,
    *,
    per_request: bool = False,
    moves: bool = False,
) -> ReplayCounts:
    """``requests`` through ``nodes`` cores of ``shape``, request ``i`` on node ``nodes_of[i]``, tiers of
    ``cap`` (``cap.storage``: one L3 of that many slots for all nodes, None: no L3). ``per_request``:
    also what each request was served (:attr:`ReplayCounts.per_request`); ``moves``: and what its tiers
    moved besides (:attr:`ReplayCounts.moves`), each request's plans then settled before the next
    begins, as an engine that drains its tiers does (the hits are the same either way: the planner's
    executors complete every plan at once)."""
    block = shape.spec.page_size
    # the store is one LRU of keys, sized in slots: a shared window's page takes one; beside each block it
    # holds at most one object of each group with a pool of its own
    storage = AccountingStore(cap.storage * (1 + len(shape.own)), L3_BATCH_PAGES) if cap.storage is not None else None
    # a node's pools are sized from the blocks routed to it (and their window pages): it can never hold
    # more, so larger pools change nothing and would only be allocated (1000 TB of host is 2e9 page
    # ids; 4096 nodes, 4096 cores)
    blocks = np.bincount(np.asarray(nodes_of, dtype=np.int64), weights=[len(r.hash_ids) for r in requests], minlength=nodes)
    per_block = shape.slots_per_block
    need = [1 + int(b) * per_block for b in blocks]
    caches = [_node_cache(shape, Capacity(min(cap.device, n), min(cap.host, n), cap.storage), storage, cache_cfg) if n > 1 else None
              for n in need]
    out = ReplayCounts(per_request=[] if per_request or moves else None, moves=[] if moves else None)
    with collector_paused():
        _replay(requests, caches, nodes_of, block, out, shape.handover or _group_objects)
    # read before close: close() applies the last backups, which the replay never waited for
    used = [c for c in caches if c is not None]
    out.backed_up_blocks = sum(c.stats.backed_up_pages for c in used)
    out.storage_saved_blocks = sum(c.stats.storage_saved_pages for c in used)
    for c in used:
        for comp in c.components:
            moved = out.groups.setdefault(comp.name, {})
            for k, v in comp.stats().items():
                if k not in ("device_objects", "host_objects"):
                    moved[k] = moved.get(k, 0) + v
    for c in used:
        c.close()
    return out


def _group_objects(node: CacheCore, req, usable: int, total: int) -> dict[str, list[int | None]]:
    """What an engine hands over for a hybrid model: a window page for every block it computed (vLLM and
    SGLang keep them until their block goes), and a snapshot at each ``state_every``-th boundary --
    not at the prompt's end, which the core would also take: the tiers' snapshot bytes are then
    exactly one per ``state_every`` blocks, as :func:`~kvtier.app.plan.config.block_bytes` reserves."""
    full = len(req.keys)
    out = {}
    for c in node.components:
        ids: list[int | None] = [None] * full
        places = node.groups.handed_places(c.name, usable, full, at_end=False)
        for place, gid in zip(places, req.alloc_group(c.name, len(places))):
            ids[place] = gid
        out[c.name] = ids
    return out


def _replay(requests: list[TraceRequest], caches: list[CacheCore], nodes_of: Sequence[int], block: int, out: ReplayCounts,
            handover: Handover) -> None:
    """Each request through its node's core, as an engine drives it: begin, alloc, commit."""
    hits = out.hit_blocks
    key_of = _block_keys(requests).__getitem__
    moves = out.moves
    for r, j in zip(requests, nodes_of):
        node = caches[j]
        keys = list(map(key_of, r.hash_ids[: r.input_length // block]))
        usable_max = (r.input_length - 1) // block
        if moves is not None:
            st = node.stats
            before = st.backed_up_pages, st.storage_saved_pages
        req = node.begin(keys, usable_pages=usable_max, prefetch_policy="wait_complete")
        usable = req.usable(usable_max)
        total = -(-r.input_length // block)
        new = req.alloc(total - usable)
        if new.ok:
            req.commit(req.cached_pages[:usable] + new.pages, handover(node, req, usable, total) if node.groups else None)
        else:
            req.abort()
        served = req.served(usable)
        for tier, n in zip(("device", "host", "storage"), served):
            hits[tier] += n
        if out.per_request is not None:
            out.per_request.append(served)
        if moves is not None:
            during = st.backed_up_pages - before[0]  # device pages backed up to make room (write_back): inside the request
            node.wait_idle()  # its own backups and L3 saves, applied before the next request
            moves.append((during, st.backed_up_pages - before[0] - during, st.storage_saved_pages - before[1]))
        if node.groups:  # the most objects (and, beside window pages sharing the pool, pages) a node's tiers held at once
            dev_used, host_used = node.dev_alloc.num_used, node.host_alloc.num_used
            for c in node.groups.components:
                n_dev, n_host = len(c.at[Tier.DEVICE]), len(c.at[Tier.HOST])
                peak = out.peaks.setdefault(c.name, [0, 0])
                peak[0], peak[1] = max(peak[0], n_dev), max(peak[1], n_host)
                if c.sharing:
                    dev_used, host_used = dev_used - n_dev, host_used - n_host
            peak = out.peaks.setdefault("full", [0, 0])
            peak[0], peak[1] = max(peak[0], dev_used), max(peak[1], host_used)
        out.input_tokens += r.input_length
