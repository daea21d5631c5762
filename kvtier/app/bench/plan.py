"""``kvtier bench plan``: how fast ``kvtier plan`` replays a Mooncake trace through the policy core.

``configurations``: the core's replay (``kvtier.app.plan.replay``: one
:class:`~kvtier.core.CacheCore` per node on accounting executors, the
requests routed first) in each configuration that takes a different path
through the policy -- the default (write_through, 1 TB host), a host smaller
than the device plus two requests (backups skipped, pages dropped), write_back,
write_through_selective, and 16 nodes -- requests per second, median of ``reps``.

``routing``: ``kvtier plan`` end to end (route, replay, queueing model) for each
routing policy at 1 and 16 nodes, requests per second (median of ``reps``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kvtier.app.bench.timing import median_seconds
from kvtier.config import CacheConfig
from kvtier.app.plan import PlanConfig, replay, run_plan
from kvtier.app.plan.routing import ROUTING_POLICIES
from kvtier.app.workloads.mooncake import load_mooncake_trace

#: one configuration per path through the policy; the sizes are the plan defaults unless named
CONFIGURATIONS: dict[str, tuple[dict, dict]] = {
    "default": ({}, {}),
    "host 0.001 TB (< device + 2 requests)": ({"host_tb": 0.001}, {}),
    "write_back": ({}, {"write_policy": "write_back"}),
    "write_through_selective": ({}, {"write_policy": "write_through_selective"}),
    "16 nodes": ({"nodes": 16}, {}),
}


@dataclass(frozen=True)
class PlanBenchResult:
    trace: str
    requests: int
    #: one row per configuration: the core's replay, requests/s, and the blocks it served per tier
    configurations: list[dict]
    #: the slowest configuration's requests/s
    slowest_requests_per_s: float
    #: one row per routing policy and node count: kvtier plan's requests/s end to end
    routing: list[dict]


def routing_speed(requests, cfg: PlanConfig, reps: int, node_counts: tuple[int, ...] = (1, 16)) -> list[dict]:
    """``run_plan`` end to end per routing policy and node count."""
    rows = []
    for nodes in node_counts:
        for policy in ROUTING_POLICIES:
            c = replace(cfg, nodes=nodes, routing=policy)
            t = median_seconds(lambda _, c=c: run_plan(requests, c), reps)
            rows.append({"routing": policy, "nodes": nodes, "requests_per_s": round(len(requests) / t, 1)})
    return rows


def configuration_speed(requests, cfg: PlanConfig, reps: int) -> list[dict]:
    rows = []
    for name, (plan_fields, cache_fields) in CONFIGURATIONS.items():
        c, cc = replace(cfg, **plan_fields), CacheConfig(**cache_fields)
        counts = []
        t = median_seconds(lambda _, counts=counts, c=c, cc=cc: counts.append(replay(requests, c, cc)), reps)
        rows.append({"configuration": name, "requests_per_s": round(len(requests) / t, 1), "hit_blocks": counts[-1].hit_blocks})
    return rows


def run_plan_bench(trace: str, limit: int | None = None, cfg: PlanConfig = PlanConfig(), reps: int = 5) -> PlanBenchResult:
    requests = load_mooncake_trace(trace, limit)
    configs = configuration_speed(requests, cfg, reps)
    return PlanBenchResult(trace=trace, requests=len(requests), configurations=configs,
                           slowest_requests_per_s=min(r["requests_per_s"] for r in configs), routing=routing_speed(requests, cfg, reps))


def as_json(result: PlanBenchResult) -> dict:
    return asdict(result)
