"""``kvtier plan``: size the tiers for a workload at cluster scale, without tensors.

The policy core itself (:class:`~kvtier.core.CacheCore`: LRU per tier,
write policies, L3 prefetch) runs over page ids on executors that move no
bytes, one core per node, all nodes sharing one L3 of ``storage_tb x nodes``
(an LRU set of keys). Keys are the trace's own block hashes (Mooncake ``hash_ids``
are prefix hashes of 512-token blocks), so planning works on 512-token blocks:
the trace's own granularity, and no hashing. A block is ``512 / page_size``
pages of the spec.

Reported: hit ratio per tier (tokens served / input tokens) next to the
infinite-cache bound, bytes per second each link must carry at the trace's
arrival rate (vs PCIe and network bandwidth), and whether loading a hit beats
recomputing it (given a prefill FLOP rate; assumptions are in the report).

Requests go to nodes by a routing policy decided from the trace alone
(:mod:`~kvtier.app.plan.routing`: ``kv_aware``, ``affinity``, ``round_robin``),
arrive at the trace's timestamps and queue on their node
(:mod:`~kvtier.app.plan.timing`: queueing delay, TTFT, per-node load).
Configurations where a bigger tier could serve fewer hits are refused
(:func:`check_plannable`).

One policy, one replay: :mod:`~kvtier.app.plan.replay_cache` drives the core
itself in every configuration (there is no separate model of it to drift).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from kvtier.config import CacheConfig, ConfigError
from kvtier.app.plan.config import (GB, TB, Capacity, PlanConfig, PlanReport, ReplayCounts, TokenCosts, block_bytes, capacity, plan_model,
                                    planning_model, planning_spec, slots_per_block, window_groups)
from kvtier.app.plan.profile import Profile
from kvtier.app.plan.replay_cache import NodeShape, replay_cache
from kvtier.app.plan.routing import ROUTING_POLICIES, route
from kvtier.app.plan.timing import Costs, NominalCosts, ProfiledCosts, simulate
from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["PlanConfig", "PlanReport", "ReplayCounts", "capacity", "check_plannable", "compare_routing", "distinct_blocks",
           "infinite_cache_hit_ratio", "min_host_tb", "plan_costs", "planning_spec", "replay", "round_up", "route", "run_plan", "sweep",
           "sweep_host"]


def infinite_cache_hit_ratio(requests: list[TraceRequest], block: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """Tokens an unbounded cache would serve / input tokens (last token always computed)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        full = r.input_length // block
        usable = (r.input_length - 1) // block
        ids = r.hash_ids
        i = 0
        while i < usable and ids[i] in seen:
            i += 1
        hit += i * block
        total += r.input_length
        seen.update(ids[:full])
    return hit / total if total else 0.0


def replay(requests: list[TraceRequest], cfg: PlanConfig = PlanConfig(), cache_cfg: CacheConfig = CacheConfig(), *,
           per_request: bool = False, moves: bool = False, nodes_of: list[int] | None = None) -> ReplayCounts:
    """Replay ``requests`` through the policy core, one core per node (no size checks: see :func:`run_plan`).
    ``nodes_of``: the node of each request (default: :func:`route` by ``cfg.routing``)."""
    cap = capacity(cfg, block_bytes(cfg))
    return replay_cache(requests, NodeShape.of_plan(cfg), cache_cfg, cap, route(requests, cfg) if nodes_of is None else nodes_of,
                        cfg.nodes, per_request=per_request, moves=moves)


def round_up(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits, never below it: a size printed as the fix must be accepted."""
    if x <= 0:
        return 0.0
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def _longest_blocks(requests: list[TraceRequest]) -> int:
    """Blocks of the longest request, its partial tail included."""
    return max((r.input_length // MOONCAKE_BLOCK_TOKENS + 1 for r in requests), default=0)


def distinct_blocks(requests: list[TraceRequest]) -> int:
    """Distinct full blocks of the trace: what an L3 must hold never to evict."""
    return len({h for r in requests for h in r.hash_ids[: r.input_length // MOONCAKE_BLOCK_TOKENS]})


def check_plannable(requests: list[TraceRequest], cfg: PlanConfig) -> None:
    """Refuse (:class:`ConfigError`, one line) a configuration whose hit ratio could fall as a tier grows.

    Why these rules: the route is fixed by the trace (:mod:`kvtier.app.plan.routing`),
    so each node's cache sees one request sequence at every size.

    * The device holds the longest request: a request that does not fit is served
      but not cached, and a smaller device caching fewer requests can then serve
      more (seen on a chat trace: 0.607 at 0.5 GB, 0.568 at 1 GB).
    * The host holds a copy of every device page plus two of the longest requests:
      then it holds every cached block, and what a node serves is an LRU set of the
      host's size over its sequence, so a larger host never serves less (LRU's
      inclusion property), whatever the device. A smaller host skips backups and
      drops pages it could not copy (seen: 10 / 20 / 50 GB of host under a 40 GB
      device gave 0.0472 / 0.0487 / 0.0473).
    * The L3 is off, or holds every distinct block of the trace. A finite L3
      refreshes a block only when it is saved or read, and a larger host reads and
      re-saves it less, so its L3 copy ages out sooner (seen on the chat trace at 4 nodes:
      host 2.5 / 4 / 8 GB with a 40 GB L3 gave 0.5679 / 0.5678 / 0.5664).

    The argument is for write_through; under write_back and
    write_through_selective the same rules gave monotone sweeps of every tier on
    the generated chat trace (tested) and, with kv_aware routing, on the shipped
    trace, without a proof.
    """
    cost = block_bytes(cfg)
    cap = capacity(cfg, cost)
    per_block = slots_per_block(cfg)  # a hybrid model's block takes a slot per window group too
    longest = _longest_blocks(requests) * per_block
    refused = "hit ratios could fall as a tier grows, so kvtier plan refuses it"
    if cap.device < longest:
        raise ConfigError(
            f"device tier of {cap.device} blocks ({cfg.device_gb:g} GB) cannot hold the longest request ({longest} blocks): {refused}; "
            f"give --plan-device-gb {round_up(longest * cost / GB)} or more"
        )
    if cap.host < cap.device + 2 * longest:
        raise ConfigError(
            f"host tier of {cap.host} blocks ({cfg.host_tb:g} TB) is smaller than the device's {cap.device} blocks plus two of the "
            f"longest request (2 x {longest} blocks): {refused}; "
            f"give --plan-host-tb {round_up(min_host_tb(requests, cfg))} or more, or a smaller --plan-device-gb"
        )
    if cap.storage and cap.storage < per_block * sum(r.input_length // MOONCAKE_BLOCK_TOKENS for r in requests):  # else it holds all
        distinct = distinct_blocks(requests) * per_block
        if cap.storage < distinct:
            need = distinct * cost / TB / cfg.nodes
            raise ConfigError(
                f"L3 of {cap.storage} blocks ({cfg.storage_tb:g} TB x {cfg.nodes} nodes) is smaller than the trace's {distinct} distinct "
                f"blocks: a finite L3 ages out what the host keeps serving, so {refused}; give --plan-storage-tb 0 (no L3) "
                f"or {round_up(need)} or more"
            )


def plan_costs(cfg: PlanConfig, profile: Profile | None = None, path: str = "") -> Costs:
    """What a request costs in time: the nominal figures of ``cfg``, or ``profile``'s measured ones (a
    profile of another model than ``cfg.spec`` is refused)."""
    if profile is None:
        return NominalCosts(TokenCosts.of(cfg))
    profile.check_model(cfg.spec, plan_model(cfg.spec).fingerprint(), path)
    return ProfiledCosts(profile, MOONCAKE_BLOCK_TOKENS, planning_spec(cfg).page_bytes, path)


def run_plan(
    requests: list[TraceRequest],
    cfg: PlanConfig = PlanConfig(),
    cache_cfg: CacheConfig = CacheConfig(),
    *,
    nodes_of: list[int] | None = None,
    costs: Costs | None = None,
) -> PlanReport:
    """``nodes_of``: a route computed earlier for the same trace and routing (sweeps reuse one); ``costs``:
    what time a request takes (default: ``cfg``'s nominal figures, :func:`plan_costs`)."""
    check_plannable(requests, cfg)
    spec = planning_spec(cfg)
    block = MOONCAKE_BLOCK_TOKENS
    block_cost = block_bytes(cfg)
    cap = capacity(cfg, block_cost)
    t0 = time.perf_counter()
    if nodes_of is None:
        nodes_of = route(requests, cfg)
    costs = costs or plan_costs(cfg)
    # what each request's tiers moved besides its hits: only measured costs time it
    counts = replay(requests, cfg, cache_cfg, per_request=True, moves=isinstance(costs, ProfiledCosts), nodes_of=nodes_of)
    elapsed = time.perf_counter() - t0
    timing = simulate(requests, nodes_of, counts.per_request or [], cfg, costs, counts.moves)
    input_tokens = counts.input_tokens
    hits = {k: v * block for k, v in counts.hit_blocks.items()}
    duration = max((requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0, 1e-3) if requests else 1.0
    total_hits = sum(hits.values())
    bound = infinite_cache_hit_ratio(requests, block)
    groups = _group_report(cfg, cap, counts) if counts.groups else None
    extra = groups["moved_bytes"] if groups else {}
    per_node = {
        "host_to_device": ((hits["host"] + hits["storage"]) * spec.bytes_per_token + extra.get("loaded", 0) + extra.get("filled", 0))
        / duration / cfg.nodes,
        "device_to_host": (counts.backed_up_blocks * spec.page_bytes + extra.get("backed_up", 0)) / duration / cfg.nodes,
        "storage_to_host": (hits["storage"] * spec.bytes_per_token + extra.get("fetched", 0)) / duration / cfg.nodes,
        "host_to_storage": (counts.storage_saved_blocks * spec.page_bytes + extra.get("saved", 0)) / duration / cfg.nodes,
    }
    link = {
        "pcie_host_to_device": per_node["host_to_device"] / (cfg.pcie_gbps * GB),
        "pcie_device_to_host": per_node["device_to_host"] / (cfg.pcie_gbps * GB),
        "network_storage": (per_node["storage_to_host"] + per_node["host_to_storage"]) / (cfg.network_gbps * GB),
    }
    cost = TokenCosts.of(cfg)
    ratio = (lambda n: round(n / input_tokens, 4)) if input_tokens else (lambda n: 0.0)
    return PlanReport(
        requests=len(requests),
        input_tokens=input_tokens,
        trace_seconds=round(duration, 3),
        nodes=cfg.nodes,
        block_tokens=block,
        block_bytes=round(block_cost),
        capacity_blocks={"device": cap.device, "host": cap.host, "storage_shared": cap.storage or 0},
        hit_ratio={k: ratio(v) for k, v in hits.items()} | {"total": ratio(total_hits)},
        infinite_cache_hit_ratio=round(bound, 4),
        fraction_of_bound=round(total_hits / input_tokens / bound, 4) if bound and input_tokens else 0.0,
        bytes_per_second_per_node={k: round(v / GB, 3) for k, v in per_node.items()} | {"unit": "GB/s"},  # type: ignore[dict-item]
        link_utilization={k: round(v, 4) for k, v in link.items()},
        load_vs_recompute={
            "recompute_us_per_token": round(cost.recompute_s * 1e6, 4),
            "load_from_host_us_per_token": round(cost.load_host_s * 1e6, 4),
            "load_from_storage_us_per_token": round(cost.load_storage_s * 1e6, 4),
            "host_hit_speedup": round(cost.recompute_s / cost.load_host_s, 2),
            "storage_hit_speedup": round(cost.recompute_s / cost.load_storage_s, 2),
        },
        replay_seconds=round(elapsed, 3),
        requests_per_second=round(len(requests) / elapsed, 1) if elapsed > 0 else 0.0,
        routing=cfg.routing if cfg.nodes > 1 else "single node",
        latency={"queue_delay_s": timing.queue_delay_s, "ttft_s": timing.ttft_s},
        per_node=timing.per_node,
        load_balance=timing.imbalance,
        warnings=timing.warnings,
        groups=groups,
        cost_model=costs.describe(),
    )


def _group_report(cfg: PlanConfig, cap: Capacity, counts: ReplayCounts) -> dict:
    """A hybrid model, per KV group: what one of its objects costs, how many each tier holds, what moved
    (summed over nodes); and the blocks a tier holds against a full-attention model of the same size."""
    model = planning_model(cfg)
    spec = planning_spec(cfg)
    shared = window_groups(cfg)
    # with window groups sharing the pool, a tier's slots hold full pages and window pages alike
    out: dict = {"full": {"kind": "full", "bytes_per_block": spec.page_bytes, "layers": len(model.group("full").layers),
                          "device_blocks": cap.device, "host_blocks": cap.host, "slots_shared_with": shared,
                          "blocks_held_at_most": dict(zip(("device", "host"), counts.peaks.get("full", [0, 0])))}}
    moved_bytes: dict[str, int] = {}
    for g in model.groups:
        if g.kind == "full":
            continue
        nbytes = g.attention.page_bytes if g.attention is not None else g.state_bytes
        moved = counts.groups.get(g.name, {})
        peak = dict(zip(("device", "host"), counts.peaks.get(g.name, [0, 0])))
        out[g.name] = {"kind": g.kind, "layers": len(g.layers), "bytes_per_object": nbytes, "window_tokens": g.window or None,
                       "shares_slots": g.name in shared, "objects_held_at_most": peak, **moved}
        for k in ("loaded", "filled", "backed_up", "saved", "fetched"):  # (objects filled beside device pages move too)
            moved_bytes[k] = moved_bytes.get(k, 0) + moved.get(k, 0) * nbytes
        if g.name in shared:  # its pages take the tier's slots, as many as the tier keeps
            continue
        share = 1.0 if g.kind == "sliding_window" else 1 / cfg.state_every
        budget = {"device": int(cap.device * share), "host": int(cap.host * share)}
        out[g.name]["objects_reserved_per_node"] = budget
        over = [t for t in budget if peak[t] > budget[t]]
        if over:
            out[g.name]["warning"] = (f"a node held up to {', '.join(f'{peak[t]} {t}' for t in over)} objects, over the "
                                      f"{', '.join(str(budget[t]) for t in over)} its block size reserves: snapshots at "
                                      f"depths that branch out share their pages; raise --plan-state-every or the tier")
    twin = spec.with_(num_layers=model.num_layers)  # every layer full attention, the full layers' buffers
    twin_cap = capacity(cfg, twin.page_bytes)
    out["full_attention_twin"] = {"bytes_per_block": twin.page_bytes, "device_blocks": twin_cap.device, "host_blocks": twin_cap.host}
    out["moved_bytes"] = moved_bytes
    return out


#: the capacity fields a sweep may vary
SWEEPABLE = {"host_tb": "host", "device_gb": "device", "storage_tb": "storage"}


def sweep(
    requests: list[TraceRequest], cfg: PlanConfig, field: str, values: list[float], cache_cfg: CacheConfig = CacheConfig(),
    costs: Costs | None = None,
) -> list[dict]:
    """Hit ratios at each size of one tier (``field``: host_tb, device_gb or storage_tb), on one route.
    Every size is checked first (:func:`check_plannable`), so a refused size fails the sweep before it runs."""
    if field not in SWEEPABLE:
        raise ConfigError(f"sweep over {field!r}: choose one of {', '.join(SWEEPABLE)}")
    configs = [replace(cfg, **{field: v}) for v in values]
    for c in configs:
        check_plannable(requests, c)
    nodes_of = route(requests, cfg)
    rows = []
    for v, c in zip(values, configs):
        r = run_plan(requests, c, cache_cfg, nodes_of=nodes_of, costs=costs)
        rows.append(
            {
                field: v,
                **{f"hit_{k}": x for k, x in r.hit_ratio.items()},
                "fraction_of_bound": r.fraction_of_bound,
                "ttft_p50_s": r.latency["ttft_s"]["p50"],
            }
        )
    return rows


def sweep_host(requests: list[TraceRequest], cfg: PlanConfig, host_tbs: list[float], cache_cfg: CacheConfig = CacheConfig()) -> list[dict]:
    return sweep(requests, cfg, "host_tb", host_tbs, cache_cfg)


def compare_routing(requests: list[TraceRequest], cfg: PlanConfig, cache_cfg: CacheConfig = CacheConfig(),
                    costs: Costs | None = None) -> list[dict]:
    """The same cluster under every routing policy: hit ratio, queueing, TTFT and load balance, one row each."""
    rows = []
    for policy in ROUTING_POLICIES:
        r = run_plan(requests, replace(cfg, routing=policy), cache_cfg, costs=costs)
        rows.append(
            {
                "routing": policy,
                "hit_total": r.hit_ratio["total"],
                "hit_device": r.hit_ratio["device"],
                "queue_delay_p50_s": r.latency["queue_delay_s"]["p50"],
                "queue_delay_p99_s": r.latency["queue_delay_s"]["p99"],
                "ttft_p50_s": r.latency["ttft_s"]["p50"],
                "ttft_p90_s": r.latency["ttft_s"]["p90"],
                "ttft_p99_s": r.latency["ttft_s"]["p99"],
                **r.load_balance,
                "requests_per_second": r.requests_per_second,
                "prompt_tokens_per_node": [n["prompt_tokens"] for n in r.per_node],
            }
        )
    return rows


def min_host_tb(requests: list[TraceRequest], cfg: PlanConfig) -> float:
    """The smallest host per node (TB) :func:`check_plannable` accepts for this trace and device."""
    cost = block_bytes(cfg)
    need = capacity(cfg, cost).device + 2 * _longest_blocks(requests) * slots_per_block(cfg)
    return need * cost / TB
