"""Fast replay: the policy core's policy as ordered dicts, for whole traces in a fraction of a second.

``kvtier plan`` replays thousands of requests of ~30 blocks, each evicting
about as many; through the prefix tree that costs ~1,500 Python calls per
request. This module keeps, per node, two recency lists of block ids
(``OrderedDict``, least recent first) and one for the shared L3, and moves
blocks between them with bulk C-level dict operations.

Why this is the same policy, not an approximation (``tests/test_plan.py``
checks it request by request against :mod:`kvtier.app.plan.replay_cache`):

* The tree's LRU gives a node the stamp of the newest use in its subtree and
  evicts leaves only. Every use of a block passes through all its ancestors, so
  a block's recency is the last request whose path held it, and an ancestor is
  never older than its descendants. A list ordered by last request, and within
  a request deepest block first, is therefore already leaves-first: its head is
  the least recent leaf of its tier. (No two leaves of a tier tie: one request
  stamps one root path, and a path holds one leaf per tier.)
* The request being served is locked in the tree; here it is touched to the
  tail at match time, so evictions from the head never reach it.
* Outside the regime :func:`lru_model_gap` admits (host write policies other
  than write_through; a host too small to hold a copy of every device page plus
  two requests, where backups get skipped and eviction takes the tree's
  backup-and-drop path), the tree's behaviour is not modelled: ``plan`` replays
  through the cache itself instead.

Timing quirks of the reference are kept on purpose, so both give equal figures:
backups started by a request's insert land (and are saved to L3) when the same
node serves its next request, and L3 saves evict per batch of pages.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import islice, repeat

from kvtier.config import CacheConfig
from kvtier.app.plan.config import L3_BATCH_PAGES, Capacity, PlanConfig, ReplayCounts, attribute_hits
from kvtier.radix import leading_present
from kvtier.spec import KVSpec
from kvtier.app.workloads.mooncake import TraceRequest


def lru_model_gap(cache_cfg: CacheConfig, cap: Capacity, max_request_blocks: int) -> str | None:
    """Why the fast model would not match the cache for this configuration; None when it is exact."""
    if cache_cfg.write_policy != "write_through":
        return f"cache write_policy {cache_cfg.write_policy!r} (the fast model covers write_through)"
    if cap.host < cap.device + 2 * max_request_blocks:
        return (f"host tier of {cap.host} blocks is smaller than the device's {cap.device} plus two of the longest request "
                f"({max_request_blocks} blocks): host copies get skipped, which the fast model does not cover")
    return None


_consume = deque(maxlen=0).extend


def _run(d, keys: Sequence[int], start: int) -> int:
    """How many of ``keys[start:]`` lead in ``d`` (L3 presence is not prefix-closed: it evicts any page)."""
    n = start
    end = len(keys)
    while n < end and keys[n] in d:
        n += 1
    return n - start


def _to_tail(d: OrderedDict, new: Sequence[int], present: Sequence[int]) -> None:
    """Make ``new`` (absent from ``d``) then ``present`` (in ``d``) its most recent entries, in that order.

    Callers pass both deepest block first. ``move_to_end`` is ~5x cheaper than re-inserting."""
    if new:
        _consume(map(d.setdefault, new))
    _consume(map(d.move_to_end, present))


class _Node:
    __slots__ = ("dev", "host", "pending")

    def __init__(self) -> None:
        #: blocks on device, least recent first
        self.dev: OrderedDict[int, None] = OrderedDict()
        #: every cached block (each has a host copy in this regime), least recent first
        self.host: OrderedDict[int, None] = OrderedDict()
        #: blocks whose write_through backup the last insert started; it lands at this node's next request
        self.pending: Sequence[int] = ()


def _evict_host(node: _Node, n: int, n_current: int) -> None:
    """Drop the ``n`` least recent host-only blocks; the request's own ``n_current`` (at the tail) are locked."""
    dev, host = node.dev, node.host
    victims = []
    for k in islice(host, len(host) - n_current):
        if k not in dev:  # a block with a device copy keeps its host copy
            victims.append(k)
            if len(victims) == n:
                break
    if len(victims) < n:
        raise AssertionError(f"fast plan model left its regime: {n} host blocks needed, {len(victims)} evictable")
    _consume(map(host.pop, victims))


def _host_room(node: _Node, cap: int, n: int, n_current: int) -> None:
    short = n - (cap - len(node.host))
    if short > 0:
        _evict_host(node, short, n_current)


def _dev_room(dev: OrderedDict, cap: int, n: int, n_locked: int) -> int:
    """Free device blocks for ``n``, least recent first, never the locked tail; returns blocks free."""
    short = n - (cap - len(dev))
    if short > 0:
        _consume(map(dev.popitem, repeat(False, min(short, len(dev) - n_locked))))
    return cap - len(dev)


def _save(store: OrderedDict, cap: int, keys: Sequence[int]) -> int:
    """A write_through L3 save: skip the leading blocks the store has, set the rest (LRU, per batch)."""
    todo = keys[_run(store, keys, 0):]
    for s in range(0, len(todo), L3_BATCH_PAGES):
        batch = todo[s : s + L3_BATCH_PAGES]
        _consume(map(store.setdefault, batch))  # set() appends a new key ...
        _consume(map(store.move_to_end, batch))  # ... and moves a present one to the tail
        if len(store) > cap:
            _consume(map(store.popitem, repeat(False, len(store) - cap)))
    return len(todo)


def replay_lru(requests: list[TraceRequest], cfg: PlanConfig, cache_cfg: CacheConfig, spec: KVSpec, cap: Capacity,
               nodes_of: Sequence[int], *, per_request: bool = False) -> ReplayCounts:
    block = spec.page_size
    dev_cap, host_cap, sto_cap = cap.device, cap.host, cap.storage
    store: OrderedDict[int, None] | None = OrderedDict() if sto_cap is not None else None
    nodes = [_Node() for _ in range(cfg.nodes)]
    out = ReplayCounts("lru", per_request=[] if per_request else None)
    dev_hits = host_hits = sto_hits = backed = saved = tokens = 0
    log = out.per_request
    for r, j in zip(requests, nodes_of):
        node = nodes[j]
        dev, host = node.dev, node.host
        length = r.input_length
        keys = r.hash_ids[: length // block]
        n_keys = len(keys)
        usable_max = (length - 1) // block
        if node.pending:  # the last insert's backups land: count them, write them through to L3
            backed += len(node.pending)
            if store is not None:
                saved += _save(store, sto_cap, node.pending)
            node.pending = ()
        # match: the cached prefix, its device part, then what L3 holds after it
        n_path = leading_present(host, keys, n_keys)
        n_dev = leading_present(dev, keys, n_path)
        if n_path:
            _consume(map(host.move_to_end, keys[:n_path][::-1]))
            if n_dev:
                _consume(map(dev.move_to_end, keys[:n_dev][::-1]))
        on_host = n_path - n_dev
        if store is not None and n_path < n_keys and n_path < usable_max:
            n_sto = _run(store, keys, n_path)
            if n_sto:  # prefetch (wait_complete): every present block arrives and becomes a host block
                _host_room(node, host_cap, n_sto, n_path)
                fetched = keys[n_path : n_path + n_sto]
                _consume(map(store.move_to_end, fetched))  # a get refreshes the L3 entry
                _to_tail(host, fetched[::-1], keys[:n_path][::-1])
                n_path += n_sto
        # load back the host run after the device prefix, as far as the device has room
        loaded = 0
        if n_path > n_dev:
            loaded = min(n_path - n_dev, _dev_room(dev, dev_cap, n_path - n_dev, n_dev))
            if loaded:  # the device run grows; keep it deepest first at the tail
                _to_tail(dev, keys[n_dev : n_dev + loaded][::-1], keys[:n_dev][::-1])
        on_device_now = n_dev + loaded
        usable = min(on_device_now, usable_max)
        # pages for the rest of the prompt (its tail page included); without them the request is not inserted
        need = -(-length // block) - usable
        if _dev_room(dev, dev_cap, need, on_device_now) >= need:
            _to_tail(dev, keys[on_device_now:][::-1], keys[:on_device_now][::-1])
            fresh = keys[n_path:]
            if fresh:  # write_through: the new blocks get host copies
                _host_room(node, host_cap, len(fresh), n_path)
                node.pending = fresh
            _to_tail(host, fresh[::-1], keys[:n_path][::-1])
        d, h, s = attribute_hits(usable, n_dev, on_host)
        dev_hits += d
        host_hits += h
        sto_hits += s
        tokens += length
        if log is not None:
            log.append((d, h, s))
    out.hit_blocks = {"device": dev_hits, "host": host_hits, "storage": sto_hits}
    out.input_tokens = tokens
    out.backed_up_blocks = backed
    out.storage_saved_blocks = saved
    return out
