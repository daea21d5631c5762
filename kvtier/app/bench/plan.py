"""``kvtier bench plan``: how fast ``kvtier plan`` replays a Mooncake trace, with both replays in one run.

The fast LRU model (:mod:`kvtier.app.plan.replay_lru`) and the policy-core
replay (:mod:`kvtier.app.plan.replay_cache`) run on the same trace and
configuration; the benchmark reports each one's requests per second (median of
``reps``), their ratio, and whether they served every request from the same
tiers (they must: the fast model is only used where it is exact).

``routing``: ``kvtier plan`` end to end (route, replay, queueing model) for each
routing policy at 1 and 16 nodes, requests per second (median of ``reps``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kvtier.app.bench.timing import median_seconds
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.app.plan import PlanConfig, fast_model_gap, replay, run_plan
from kvtier.app.plan.routing import ROUTING_POLICIES
from kvtier.app.workloads.mooncake import load_mooncake_trace


@dataclass(frozen=True)
class PlanBenchResult:
    trace: str
    requests: int
    lru_requests_per_s: float
    cache_requests_per_s: float
    lru_over_cache: float
    #: every request served from the same tiers by both replays
    identical: bool
    hit_blocks: dict[str, int]
    #: one row per routing policy and node count: kvtier plan's requests/s end to end
    routing: list[dict]


def routing_speed(requests, cfg: PlanConfig, reps: int, node_counts: tuple[int, ...] = (1, 16)) -> list[dict]:
    """``run_plan`` end to end per routing policy and node count."""
    rows = []
    for nodes in node_counts:
        for policy in ROUTING_POLICIES:
            c = replace(cfg, nodes=nodes, routing=policy)
            reports = []
            t = median_seconds(lambda _: reports.append(run_plan(requests, c)), reps)
            rows.append({"routing": policy, "nodes": nodes, "requests_per_s": round(len(requests) / t, 1),
                         "replay_engine": reports[-1].replay_engine})
    return rows


def run_plan_bench(trace: str, limit: int | None = None, cfg: PlanConfig = PlanConfig(), reps: int = 5) -> PlanBenchResult:
    requests = load_mooncake_trace(trace, limit)
    gap = fast_model_gap(requests, cfg, CacheConfig())
    if gap is not None:
        raise ConfigError(f"bench plan compares the fast model with the cache, but the model does not cover this configuration: {gap}")
    fast = replay(requests, cfg, engine="lru", per_request=True)
    ref = replay(requests, cfg, engine="cache", per_request=True)
    t_lru = median_seconds(lambda _: replay(requests, cfg, engine="lru"), reps)
    t_cache = median_seconds(lambda _: replay(requests, cfg, engine="cache"), max(1, reps // 2), warmup=0)
    return PlanBenchResult(
        trace=trace, requests=len(requests),
        lru_requests_per_s=round(len(requests) / t_lru, 1), cache_requests_per_s=round(len(requests) / t_cache, 1),
        lru_over_cache=round(t_cache / t_lru, 2),
        identical=fast.per_request == ref.per_request and fast.backed_up_blocks == ref.backed_up_blocks
        and fast.storage_saved_blocks == ref.storage_saved_blocks,
        hit_blocks=fast.hit_blocks,
        routing=routing_speed(requests, cfg, reps),
    )


def as_json(result: PlanBenchResult) -> dict:
    return asdict(result)
