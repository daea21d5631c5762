"""Which node serves each request: ``round_robin``, ``affinity`` or ``kv_aware``.

The route is decided from the trace alone, before any replay, the way a
production router decides: SGLang's cache-aware router keeps its own radix tree
of what it sent to each worker, Dynamo's KV router and llm-d's prefix-cache
scorer score each worker's prefix overlap against its load. ``kv_aware`` here::

    score(node) = device_blocks(node) + host_weight * host_blocks(node) - load_weight * queued_blocks(node)

* ``device_blocks + host_blocks``: the request's leading full blocks (at most the
  blocks it can use: its last token is always computed) found in the router's
  index of the blocks it routed to that node, split by where the router
  estimates they live: on device while fewer blocks than the device holds were
  sent to that node since (its LRU keeps them), else on host. The shared L3
  serves every node alike, so it cancels out.
* ``host_weight`` (``PlanConfig.kv_host_weight``; default ``1 - 1 / host_hit_speedup``
  from the link speeds, 0.94 for DeepSeek-V3.2 at the defaults): a host block
  saves its prefill but costs its load over PCIe.
* ``queued_blocks``: prefill work the router estimates is still queued on the
  node when the request arrives, in 512-token blocks: ``(free_at - now) * rate``,
  where the router books each request it routes at ``(prompt - prefix) tokens /
  rate`` and ``rate = prefill_tflops / flops_per_token``.
* ``load_weight`` (``PlanConfig.kv_load_weight``, default 1): a queued block of
  prefill delays this request as much as recomputing one of its own blocks
  would, so 1 trades prefill saved against waiting one for one.

Ties go to the node with the least queued work, then to the one sent the fewest
prompt tokens so far, then the lowest index.

A request whose best prefix covers less than ``kv_min_match`` (default 0.5) of
its blocks goes to the least loaded node instead (least queued, then fewest
prompt tokens sent), as SGLang's router does below its ``cache_threshold``:
otherwise a prefix every request shares (a system prompt) would pull each new
conversation to the first node that saw it, while queues are short.

Why the route reads no cache state: a router sees what it sent, not where each
block lives now, and a route fixed by the trace (and the device size, through
the tier estimate) lets a sweep over host or storage capacity replay the same
per-node request streams. Each node's cache then sees the same sequence at
every size, so the sweep compares sizes, not routings (see
:func:`kvtier.app.plan.check_plannable` for the monotonicity this gives; device
sweeps are tested monotone on the shipped and a generated trace).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.app.plan.config import PlanConfig, TokenCosts, block_bytes, capacity
from kvtier.radix import leading_present
from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

ROUTING_POLICIES = ("round_robin", "affinity", "kv_aware")


def route(requests: Sequence[TraceRequest], cfg: PlanConfig) -> list[int]:
    """The node of every request, in trace order."""
    n = cfg.nodes
    if n == 1:
        return [0] * len(requests)
    if cfg.routing == "round_robin":
        return [i % n for i in range(len(requests))]
    if cfg.routing == "affinity":
        return [r.hash_ids[0] % n if r.hash_ids else i % n for i, r in enumerate(requests)]
    return _kv_aware(requests, cfg)


def _cached_value(ids, prefix: int, last_sent: dict[int, int], device_since: int, w_host: float) -> float:
    """``prefix`` leading blocks of ``ids`` on one node, the ones the router estimates on device (sent
    there no earlier than ``device_since``: a prefix run, as ancestors are sent with every descendant)
    at 1, the rest at ``w_host``."""
    if not prefix or last_sent[ids[prefix - 1]] >= device_since:  # the deepest is recent: all are
        return float(prefix)
    lo, hi = 0, prefix - 1  # binary search: the device run leads
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if last_sent[ids[mid - 1]] >= device_since:
            lo = mid
        else:
            hi = mid - 1
    return lo + w_host * (prefix - lo)


def prefill_tokens_per_second(cfg: PlanConfig) -> float:
    """Prompt tokens one node prefills per second (the planner's compute model)."""
    return 1.0 / TokenCosts.of(cfg).recompute_s


def arrival_seconds(requests: Sequence[TraceRequest], cfg: PlanConfig) -> list[float]:
    """Each request's arrival, seconds after the first, with the trace sped up ``cfg.arrival_speedup`` times."""
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    scale = 1.0 / (1000.0 * cfg.arrival_speedup)
    return [(r.timestamp_ms - t0) * scale for r in requests]


def host_weight(cfg: PlanConfig) -> float:
    """``kv_host_weight``, or what a host block is worth from the link speeds: the prefill it saves
    less the time its load takes, as a fraction of that prefill."""
    if cfg.kv_host_weight is not None:
        return cfg.kv_host_weight
    cost = TokenCosts.of(cfg)
    return max(0.0, 1.0 - cost.load_host_s / cost.recompute_s)


class KvAwareRouter:
    """The ``kv_aware`` router's state and its three steps per request (see the module docstring)."""

    def __init__(self, cfg: PlanConfig) -> None:
        n = self.nodes = cfg.nodes
        self.device_blocks = capacity(cfg, block_bytes(cfg)).device
        self.w_host = host_weight(cfg)
        self.rate = prefill_tokens_per_second(cfg)
        self.blocks_per_second = self.rate / MOONCAKE_BLOCK_TOKENS
        self.load_weight = cfg.kv_load_weight
        self.min_match = cfg.kv_min_match
        #: first block id -> bit mask of the nodes the router sent a request opening with it
        self.first: dict[int, int] = {}
        #: per node: block id -> the node's count of blocks sent when the router last sent it there
        self.last_sent: list[dict[int, int]] = [{} for _ in range(n)]
        self.sent_blocks = [0] * n
        #: prompt tokens sent to each node
        self.sent = [0] * n
        #: when each node's booked prefill ends (seconds), and the latest of them
        self.free_at = [0.0] * n
        self.last_free = 0.0
        self._idle = [0.0] * n

    def prefixes(self, ids: Sequence[int], usable: int) -> dict[int, int]:
        """Leading blocks of ``ids[:usable]`` per node, for the nodes holding at least one. A node's
        blocks are prefix-closed (every request sends all its blocks, and a block id names its
        whole prefix), so each holder of the first block needs one binary search."""
        if usable <= 0:
            return {}
        prefix: dict[int, int] = {}
        holders = self.first.get(ids[0], 0)
        while holders:
            low = holders & -holders
            holders ^= low
            j = low.bit_length() - 1
            prefix[j] = leading_present(self.last_sent[j], ids, usable)
        return prefix

    def choose(self, ids: Sequence[int], prefix: dict[int, int], now: float) -> int:
        """The node with the best score; the least loaded one when no prefix covers ``min_match``."""
        sent = self.sent
        if self.last_free > now:  # some node still has prefill queued
            queued = [f - now if f > now else 0.0 for f in self.free_at]
            least, _, best = min(zip(queued, sent, range(self.nodes)))
        else:  # every queue is empty: the least loaded node is the one sent the fewest tokens
            queued = self._idle
            least, best = 0.0, sent.index(min(sent))
        if not prefix or max(prefix.values()) < self.min_match * len(ids):
            return best
        per_block = self.load_weight * self.blocks_per_second
        values = {j: _cached_value(ids, p, self.last_sent[j], self.sent_blocks[j] - self.device_blocks, self.w_host)
                  for j, p in prefix.items()}
        best_key = (values.get(best, 0.0) - per_block * least, -least, -sent[best])  # the least loaded node's score
        for j, value in values.items():
            key = (value - per_block * queued[j], -queued[j], -sent[j])
            if key > best_key or (key == best_key and j < best):
                best, best_key = j, key
        return best

    def book(self, node: int, ids: Sequence[int], prompt_tokens: int, reused: int, now: float) -> None:
        """Record ``node`` got the request: its blocks in the index, its prefill on the node's queue."""
        if ids:
            self.first[ids[0]] = self.first.get(ids[0], 0) | 1 << node
        self.sent_blocks[node] += len(ids)
        self.last_sent[node].update(dict.fromkeys(ids, self.sent_blocks[node]))
        start = max(self.free_at[node], now)
        end = self.free_at[node] = start + (prompt_tokens - reused * MOONCAKE_BLOCK_TOKENS) / self.rate
        if end > self.last_free:
            self.last_free = end
        self.sent[node] += prompt_tokens


def _kv_aware(requests: Sequence[TraceRequest], cfg: PlanConfig) -> list[int]:
    block = MOONCAKE_BLOCK_TOKENS
    router = KvAwareRouter(cfg)
    out: list[int] = []
    for r, now in zip(requests, arrival_seconds(requests, cfg)):
        ids = r.hash_ids[: r.input_length // block]
        prefix = router.prefixes(ids, (r.input_length - 1) // block)
        node = router.choose(ids, prefix, now)
        router.book(node, ids, r.input_length, prefix.get(node, 0), now)
        out.append(node)
    return out
