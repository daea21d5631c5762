"""Time: requests arrive at the trace's timestamps and queue on their node; what that costs.

Each node serves its requests one prefill at a time, in arrival order. A request's
service time is the larger of computing its uncached tokens
(``tokens * flops_per_token / prefill_tflops``) and loading its cached ones
(host hits over PCIe, L3 hits over the slower of PCIe and the storage network):
the load runs layer by layer under the compute. TTFT is the queueing delay plus
that service time (decode and the network to the client are not modelled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.app.plan.config import PlanConfig, TokenCosts
from kvtier.app.plan.routing import arrival_seconds
from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

#: a node taking more than this many times its fair share of prompt tokens gets a warning
IMBALANCE_WARNING = 2.0


@dataclass
class Timing:
    #: seconds, keys mean/p50/p90/p99
    queue_delay_s: dict[str, float]
    ttft_s: dict[str, float]
    #: one row per node: requests, prompt_tokens, busy_fraction
    per_node: list[dict]
    #: the busiest node's requests and prompt tokens over the mean node's
    imbalance: dict[str, float]
    warnings: list[str]


def _spread(values: np.ndarray) -> dict[str, float]:
    if not values.size:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": round(float(values.mean()), 4), "p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4)}


def simulate(requests: Sequence[TraceRequest], nodes: Sequence[int], served: Sequence[tuple[int, int, int]], cfg: PlanConfig) -> Timing:
    """Queue every request on its node (``nodes[i]``) given the blocks each tier served it (``served[i]``)."""
    block = MOONCAKE_BLOCK_TOKENS
    cost = TokenCosts.of(cfg)
    rate = 1.0 / cost.recompute_s
    host_s_per_block = block * cost.load_host_s
    storage_s_per_block = block * cost.load_storage_s
    arrivals = arrival_seconds(requests, cfg)
    free_at = [0.0] * cfg.nodes
    busy = [0.0] * cfg.nodes
    count = [0] * cfg.nodes
    tokens = [0] * cfg.nodes
    delay = np.empty(len(requests))
    ttft = np.empty(len(requests))
    for i, (r, node, (d, h, s), now) in enumerate(zip(requests, nodes, served, arrivals)):
        compute = (r.input_length - (d + h + s) * block) / rate
        load = h * host_s_per_block + s * storage_s_per_block
        service = compute if compute > load else load
        start = free_at[node] if free_at[node] > now else now
        free_at[node] = start + service
        busy[node] += service
        count[node] += 1
        tokens[node] += r.input_length
        delay[i] = start - now
        ttft[i] = start - now + service
    span = max(arrivals[-1] if arrivals else 0.0, max(free_at, default=0.0), 1e-9)
    per_node = [{"node": j, "requests": count[j], "prompt_tokens": tokens[j], "busy_fraction": round(busy[j] / span, 4)}
                for j in range(cfg.nodes)]
    fair_requests = len(requests) / cfg.nodes if requests else 1.0
    fair_tokens = sum(tokens) / cfg.nodes if requests else 1.0
    imbalance = {"max_over_mean_requests": round(max(count) / fair_requests, 3) if requests else 0.0,
                 "max_over_mean_prompt_tokens": round(max(tokens) / fair_tokens, 3) if requests and fair_tokens else 0.0}
    warnings = []
    if cfg.nodes > 1 and imbalance["max_over_mean_prompt_tokens"] > IMBALANCE_WARNING:
        j = max(range(cfg.nodes), key=tokens.__getitem__)
        warnings.append(f"node {j} takes {imbalance['max_over_mean_prompt_tokens']:.1f}x its fair share of prompt tokens under "
                        f"routing {cfg.routing!r}; the other nodes idle while it queues"
                        + ("" if cfg.routing == "kv_aware" else " (try --plan-routing kv_aware)"))
    return Timing(_spread(delay), _spread(ttft), per_node, imbalance, warnings)
