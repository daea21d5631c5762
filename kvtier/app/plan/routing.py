"""Which node serves each request: ``round_robin``, ``affinity`` or ``kv_aware``.

The route is decided from the trace alone, before any replay, the way a
production router decides: SGLang's cache-aware router keeps its own radix tree
of what it sent to each worker, Dynamo's KV router and llm-d's prefix-cache
scorer score each worker's prefix overlap against its load. ``kv_aware`` here::

    score(node) = prefix_blocks(node) - load_weight * queued_blocks(node)

* ``prefix_blocks``: the request's leading full blocks (at most the blocks it can
  use: its last token is always computed) found in the router's index of the
  blocks it routed to that node. Every tier a node reaches serves such a block
  without prefill; the shared L3 serves every node alike, so it cancels out.
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

Why the route ignores tier sizes: a router sees what it sent, not where each
block lives now, and a route fixed by the trace lets a sweep over host, device
or storage capacity replay the same per-node request streams. Each node's
cache then sees the same sequence at every size, so the sweep compares sizes,
not routings (see :func:`kvtier.app.plan.check_plannable` for the monotonicity
this gives).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.app.plan.config import PlanConfig
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


def prefill_tokens_per_second(cfg: PlanConfig) -> float:
    """Prompt tokens one node prefills per second (the planner's compute model)."""
    return cfg.prefill_tflops * 1e12 / cfg.flops_per_token


def arrival_seconds(requests: Sequence[TraceRequest], cfg: PlanConfig) -> list[float]:
    """Each request's arrival, seconds after the first, with the trace sped up ``cfg.arrival_speedup`` times."""
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    scale = 1.0 / (1000.0 * cfg.arrival_speedup)
    return [(r.timestamp_ms - t0) * scale for r in requests]


def _kv_aware(requests: Sequence[TraceRequest], cfg: PlanConfig) -> list[int]:
    block = MOONCAKE_BLOCK_TOKENS
    n = cfg.nodes
    everyone = (1 << n) - 1
    rate = prefill_tokens_per_second(cfg)
    blocks_per_second = rate / block
    weight = cfg.kv_load_weight
    min_match = cfg.kv_min_match
    #: block id -> bit mask of the nodes the router sent it to
    index: dict[int, int] = {}
    get = index.get
    free_at = [0.0] * n
    sent = [0] * n
    out: list[int] = []
    for r, now in zip(requests, arrival_seconds(requests, cfg)):
        ids = r.hash_ids[: r.input_length // block]
        usable = (r.input_length - 1) // block
        # leading blocks per node: walk the request while some node still has every block so far
        prefix: dict[int, int] = {}  # node -> prefix blocks, for the nodes that hold at least one
        have = everyone
        k = 0
        for h in ids[:usable]:
            m = get(h, 0) & have
            if m != have:
                if k:
                    gone = have & ~m
                    while gone:
                        low = gone & -gone
                        prefix[low.bit_length() - 1] = k
                        gone ^= low
                have = m
                if not have:
                    break
            k += 1
        if k:
            while have:
                low = have & -have
                prefix[low.bit_length() - 1] = k
                have ^= low
        queued = [f - now if f > now else 0.0 for f in free_at]
        least, _, best = min(zip(queued, sent, range(n)))  # the least loaded node
        if prefix and max(prefix.values()) >= min_match * len(ids):
            # the best holder of a prefix, or the least loaded node (its score is -its queue)
            best_key = (prefix.get(best, 0) - weight * least * blocks_per_second, -least, -sent[best])
            for j, p in prefix.items():
                key = (p - weight * queued[j] * blocks_per_second, -queued[j], -sent[j])
                if key > best_key or (key == best_key and j < best):
                    best, best_key = j, key
        bit = 1 << best
        for h in ids[prefix.get(best, 0):]:  # the node's own prefix has its bit already
            index[h] = get(h, 0) | bit
        start = free_at[best] if free_at[best] > now else now
        free_at[best] = start + (r.input_length - prefix.get(best, 0) * block) / rate
        sent[best] += r.input_length
        out.append(best)
    return out
