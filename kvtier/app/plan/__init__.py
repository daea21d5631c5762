"""``kvtier plan``: size the tiers for a workload at cluster scale, without tensors.

The policy core itself (:class:`~kvtier.core.policy.CacheCore`: LRU per tier,
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

Two replays of the same policy: :mod:`~kvtier.app.plan.replay_cache` drives
the core itself (every configuration); :mod:`~kvtier.app.plan.replay_lru`
is its exact model as ordered dicts (~15x faster), used where
:func:`~kvtier.app.plan.replay_lru.lru_model_gap` finds no gap. The report names
the one that ran (``replay_engine``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from kvtier.config import CacheConfig, ConfigError
from kvtier.app.plan.config import GB, TB, Capacity, PlanConfig, PlanReport, ReplayCounts
from kvtier.app.plan.replay_cache import replay_cache
from kvtier.app.plan.replay_lru import lru_model_gap, replay_lru
from kvtier.spec import KVSpec
from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["PlanConfig", "PlanReport", "ReplayCounts", "capacity", "fast_model_gap", "infinite_cache_hit_ratio", "planning_spec", "replay", "run_plan", "sweep_host"]


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


def planning_spec(cfg: PlanConfig) -> KVSpec:
    """The spec with one page per trace block (``512 / page_size`` pages of the real spec)."""
    base = KVSpec.preset(cfg.spec)
    if MOONCAKE_BLOCK_TOKENS % base.page_size:
        raise ConfigError(f"spec page_size {base.page_size} must divide the trace block of {MOONCAKE_BLOCK_TOKENS} tokens")
    return base.with_(page_size=MOONCAKE_BLOCK_TOKENS)


def capacity(cfg: PlanConfig, block_bytes: int) -> Capacity:
    return Capacity(
        device=max(1, int(cfg.device_gb * GB // block_bytes)),
        host=max(1, int(cfg.host_tb * TB // block_bytes)),
        storage=int(cfg.storage_tb * TB * cfg.nodes // block_bytes) if cfg.storage_tb > 0 else None,
    )


def fast_model_gap(requests: list[TraceRequest], cfg: PlanConfig, cache_cfg: CacheConfig) -> str | None:
    """Why the fast LRU model would not be exact for this trace and configuration; None when it is."""
    longest = max((r.input_length // MOONCAKE_BLOCK_TOKENS + 1 for r in requests), default=0)  # blocks, tail included
    return lru_model_gap(cache_cfg, capacity(cfg, planning_spec(cfg).page_bytes), longest)


def replay(requests: list[TraceRequest], cfg: PlanConfig = PlanConfig(), cache_cfg: CacheConfig = CacheConfig(), *,
           engine: str | None = None, per_request: bool = False) -> ReplayCounts:
    """Replay ``requests`` through one engine: ``"lru"``, ``"cache"``, or (None) as ``cfg.replay`` and the model's gap say."""
    spec = planning_spec(cfg)
    cap = capacity(cfg, spec.page_bytes)
    if engine is None:
        engine = "lru" if cfg.replay == "auto" and fast_model_gap(requests, cfg, cache_cfg) is None else "cache"
    run = replay_lru if engine == "lru" else replay_cache
    return run(requests, cfg, cache_cfg, spec, cap, per_request=per_request)


def run_plan(requests: list[TraceRequest], cfg: PlanConfig = PlanConfig(), cache_cfg: CacheConfig = CacheConfig()) -> PlanReport:
    spec = planning_spec(cfg)
    block = MOONCAKE_BLOCK_TOKENS
    block_bytes = spec.page_bytes
    cap = capacity(cfg, block_bytes)
    t0 = time.perf_counter()
    counts = replay(requests, cfg, cache_cfg)
    elapsed = time.perf_counter() - t0
    input_tokens = counts.input_tokens
    hits = {k: v * block for k, v in counts.hit_blocks.items()}
    duration = max((requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0, 1e-3) if requests else 1.0
    total_hits = sum(hits.values())
    bound = infinite_cache_hit_ratio(requests, block)
    per_node = {
        "host_to_device": (hits["host"] + hits["storage"]) * spec.bytes_per_token / duration / cfg.nodes,
        "device_to_host": counts.backed_up_blocks * block_bytes / duration / cfg.nodes,
        "storage_to_host": hits["storage"] * spec.bytes_per_token / duration / cfg.nodes,
        "host_to_storage": counts.storage_saved_blocks * block_bytes / duration / cfg.nodes,
    }
    link = {
        "pcie_host_to_device": per_node["host_to_device"] / (cfg.pcie_gbps * GB),
        "pcie_device_to_host": per_node["device_to_host"] / (cfg.pcie_gbps * GB),
        "network_storage": (per_node["storage_to_host"] + per_node["host_to_storage"]) / (cfg.network_gbps * GB),
    }
    recompute_s = cfg.flops_per_token / (cfg.prefill_tflops * 1e12)
    load_host_s = spec.bytes_per_token / (cfg.pcie_gbps * GB)
    load_storage_s = spec.bytes_per_token / (min(cfg.pcie_gbps, cfg.network_gbps) * GB)
    ratio = (lambda n: round(n / input_tokens, 4)) if input_tokens else (lambda n: 0.0)
    return PlanReport(
        requests=len(requests), input_tokens=input_tokens, trace_seconds=round(duration, 3), nodes=cfg.nodes,
        block_tokens=block, block_bytes=block_bytes,
        capacity_blocks={"device": cap.device, "host": cap.host, "storage_shared": cap.storage or 0},
        hit_ratio={k: ratio(v) for k, v in hits.items()} | {"total": ratio(total_hits)},
        infinite_cache_hit_ratio=round(bound, 4),
        fraction_of_bound=round(total_hits / input_tokens / bound, 4) if bound and input_tokens else 0.0,
        bytes_per_second_per_node={k: round(v / GB, 3) for k, v in per_node.items()} | {"unit": "GB/s"},  # type: ignore[dict-item]
        link_utilization={k: round(v, 4) for k, v in link.items()},
        load_vs_recompute={
            "recompute_us_per_token": round(recompute_s * 1e6, 4),
            "load_from_host_us_per_token": round(load_host_s * 1e6, 4),
            "load_from_storage_us_per_token": round(load_storage_s * 1e6, 4),
            "host_hit_speedup": round(recompute_s / load_host_s, 2),
            "storage_hit_speedup": round(recompute_s / load_storage_s, 2),
        },
        replay_engine=counts.engine,
        replay_seconds=round(elapsed, 3), requests_per_second=round(len(requests) / elapsed, 1) if elapsed > 0 else 0.0,
    )


def sweep_host(requests: list[TraceRequest], cfg: PlanConfig, host_tbs: list[float], cache_cfg: CacheConfig = CacheConfig()) -> list[dict]:
    rows = []
    for tb in host_tbs:
        r = run_plan(requests, replace(cfg, host_tb=tb), cache_cfg)
        rows.append({"host_tb": tb, **{f"hit_{k}": v for k, v in r.hit_ratio.items()}, "fraction_of_bound": r.fraction_of_bound, "replay_engine": r.replay_engine})
    return rows
