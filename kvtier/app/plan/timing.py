"""Time: requests arrive at the trace's timestamps and queue on their node; what that costs.

Each node serves its requests one prefill at a time, in arrival order. What one request
costs comes from a cost model:

* :class:`NominalCosts` (no profile): computing its uncached tokens at
  ``flops_per_token / prefill_tflops`` each, loading its cached ones (host hits over PCIe, L3 hits
  over the slower of PCIe and the storage network) layer by layer under the compute: the larger
  of the two. Tier moves after the request run beside the next ones.
* :class:`ProfiledCosts` (``--profile``): what an engine was measured to cost on this machine
  (:mod:`~kvtier.app.plan.profile`): its prefill fit (overhead, per token, attention, per page), L3
  reads before the compute, host->device loads under it (or before it, as the engine does), backups
  that make room inside the request, and -- for an engine that settles its tiers before the next
  request -- its commit and the backups and L3 saves after it, which hold the node; a request
  that finds the node idle pays the measured cost of waking it (:class:`~kvtier.app.plan.profile.IdleFit`).

TTFT is the queueing delay plus the request's own service time (decode and the network to the
client are not modelled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.app.plan.config import PlanConfig, TokenCosts
from kvtier.app.plan.profile import Profile
from kvtier.app.plan.routing import arrival_seconds
from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

#: a node taking more than this many times its fair share of prompt tokens gets a warning
IMBALANCE_WARNING = 2.0


@dataclass(frozen=True)
class NominalCosts:
    """The planner's nominal figures (:class:`~kvtier.app.plan.config.TokenCosts`)."""

    cost: TokenCosts
    block: int = MOONCAKE_BLOCK_TOKENS

    def describe(self) -> dict:
        return {"source": "nominal", "note": "nominal link speeds and FLOP rate (--plan-pcie-gbps, --plan-network-gbps, "
                                              "--plan-prefill-tflops); give --profile for measured ones"}

    def request(self, prompt: int, served: tuple[int, int, int], moves: tuple[int, int, int] | None) -> tuple[float, float]:
        """(seconds to the first token once started, seconds the node stays busy after it)."""
        d, h, s = served
        block, cost = self.block, self.cost
        compute = (prompt - (d + h + s) * block) / (1.0 / cost.recompute_s)
        load = h * (block * cost.load_host_s) + s * (block * cost.load_storage_s)
        return (compute if compute > load else load), 0.0

    def wake(self, idle_s: float, service_s: float) -> float:
        """What a request of ``service_s`` that finds the node idle for ``idle_s`` pays beyond its own service:
        nothing, nominally."""
        return 0.0


@dataclass(frozen=True)
class ProfiledCosts:
    """An engine's measured costs (:class:`~kvtier.app.plan.profile.Profile`) for blocks of ``block``
    tokens holding ``block_bytes`` each."""

    profile: Profile
    block: int
    block_bytes: float
    path: str = ""

    def describe(self) -> dict:
        p = self.profile
        return {"source": "profile", "profile": self.path, "engine": p.engine, "model": p.model, "measured_at": p.measured_at}

    def request(self, prompt: int, served: tuple[int, int, int], moves: tuple[int, int, int] | None) -> tuple[float, float]:
        p = self.profile
        d, h, s = served
        nbytes = self.block_bytes
        compute = p.prefill.seconds(prompt, (d + h + s) * self.block)
        fetch = p.links["storage_get"].seconds(s * nbytes)
        load = p.links["host_to_device"].seconds((h + s) * nbytes)
        room, backed, saved = moves or (0, 0, 0)
        evict = p.links["device_to_host"].seconds(room * nbytes)
        service = (fetch + evict + (max(compute, load) if p.traits.load_overlaps_compute else compute + load)) * p.load_scale
        after = 0.0
        if p.traits.settle == "serial":  # its commit, then its backups and L3 saves drained
            after = p.after_request_overhead_s + p.after_request.seconds((backed + saved) * nbytes)
        return service, after

    def wake(self, idle_s: float, service_s: float) -> float:
        return self.profile.idle.seconds(idle_s, service_s)


Costs = NominalCosts | ProfiledCosts


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
    #: each request's TTFT and queueing delay, in trace order
    per_request_ttft_s: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)
    per_request_queue_s: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)
    #: each request's service (its TTFT less its queueing delay: its own cost, and the wake-up of an idle node), and the
    #: time the node stays busy after its first token
    per_request_service_s: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)
    per_request_after_s: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)


def spread(values: np.ndarray) -> dict[str, float]:
    if not values.size:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": round(float(values.mean()), 4), "p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4)}


def simulate(requests: Sequence[TraceRequest], nodes: Sequence[int], served: Sequence[tuple[int, int, int]], cfg: PlanConfig,
             costs: Costs | None = None, moves: Sequence[tuple[int, int, int]] | None = None) -> Timing:
    """Queue every request on its node (``nodes[i]``) given the blocks each tier served it (``served[i]``)
    and what its tiers moved besides (``moves[i]``, see :attr:`~kvtier.app.plan.config.ReplayCounts.moves`)."""
    costs = costs or NominalCosts(TokenCosts.of(cfg))
    request_cost, wake = costs.request, costs.wake
    arrivals = arrival_seconds(requests, cfg)
    free_at = [0.0] * cfg.nodes
    busy = [0.0] * cfg.nodes
    count = [0] * cfg.nodes
    tokens = [0] * cfg.nodes
    delay = np.empty(len(requests))
    ttft = np.empty(len(requests))
    own = np.empty(len(requests))
    held = np.empty(len(requests))
    no_moves = [None] * len(requests) if moves is None else moves
    for i, (r, node, hit, moved, now) in enumerate(zip(requests, nodes, served, no_moves, arrivals)):
        service, after = request_cost(r.input_length, hit, moved)
        if now > free_at[node]:  # the node is idle when it comes
            service += wake(now - free_at[node], service)
        start = free_at[node] if free_at[node] > now else now
        free_at[node] = start + service + after
        busy[node] += service + after
        count[node] += 1
        tokens[node] += r.input_length
        delay[i] = start - now
        ttft[i] = start - now + service
        own[i], held[i] = service, after
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
    return Timing(spread(delay), spread(ttft), per_node, imbalance, warnings, ttft, delay, own, held)
