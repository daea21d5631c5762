"""``kvtier plan``: size the tiers for a workload at cluster scale, without tensors.

The same :class:`HierarchicalCache` logic (LRU per tier, write policies, L3
prefetch) runs over pools that account pages but hold no bytes, one cache per
node, all nodes sharing one L3 of ``storage_tb x nodes`` (an in-process
``memory://`` LRU). Keys are the trace's own block hashes (Mooncake ``hash_ids``
are prefix hashes of 512-token blocks), so planning works on 512-token blocks:
the trace's own granularity, and no hashing. A block is ``512 / page_size``
pages of the spec.

Reported: hit ratio per tier (tokens served / input tokens) next to the
infinite-cache bound, bytes per second each link must carry at the trace's
arrival rate (vs PCIe and network bandwidth), and whether loading a hit beats
recomputing it (given a prefill FLOP rate; assumptions are in the report).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, ConfigError, StorageConfig, _help
from kvtier.hashing import Namespace, PageHash
from kvtier.l3.memory import MemoryBackend
from kvtier.l3.tier import StorageTier
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec
from kvtier.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class PlanConfig:
    """Cluster shape and link speeds; sizes are per node."""

    spec: str = _help("model preset (KVSpec)", "deepseek-v3.2")
    nodes: int = _help("engine nodes; requests are routed to them", 1)
    device_gb: float = _help("KV cache memory on the GPUs of one node (L1), GB", 40.0)
    host_tb: float = _help("pinned host memory for KV per node (L2), TB", 1.0)
    storage_tb: float = _help("L3 capacity contributed per node (shared by all nodes), TB", 20.0)
    routing: Literal["affinity", "round_robin"] = _help("route by the first block's hash (affinity) or round robin", "affinity")
    pcie_gbps: float = _help("host<->device bandwidth per node and direction, GB/s (PCIe Gen5 x16 ~ 55)", 55.0)
    network_gbps: float = _help("storage network bandwidth per node, GB/s", 25.0)
    prefill_tflops: float = _help("effective prefill compute of one node, TFLOP/s (e.g. 8 GPUs x 400 at ~50% MFU)", 3200.0)
    flops_per_token: float = _help("prefill FLOPs per token (2 x active parameters; DeepSeek-V3.2: 37e9 active)", 74e9)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"PlanConfig.nodes must be >= 1; got {self.nodes}")
        if self.routing not in ("affinity", "round_robin"):
            raise ConfigError(f"PlanConfig.routing must be affinity or round_robin; got {self.routing!r}")
        for name in ("device_gb", "host_tb", "storage_tb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"PlanConfig.{name} must be >= 0; got {getattr(self, name)}")


@dataclass
class PlanReport:
    requests: int
    input_tokens: int
    trace_seconds: float
    nodes: int
    block_tokens: int
    block_bytes: int
    capacity_blocks: dict[str, int]
    hit_ratio: dict[str, float]
    infinite_cache_hit_ratio: float
    fraction_of_bound: float
    bytes_per_second_per_node: dict[str, float]
    link_utilization: dict[str, float]
    load_vs_recompute: dict[str, float]
    replay_seconds: float
    requests_per_second: float
    sweep: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _block_key(h: int) -> PageHash:
    return PageHash(h.to_bytes(16, "little", signed=False))


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


class _Node:
    def __init__(self, spec: KVSpec, cfg: PlanConfig, block_bytes: int, storage: MemoryBackend, cache_cfg: CacheConfig):
        dev = DevicePool(spec, max(1, int(cfg.device_gb * GB // block_bytes)), materialize=False)
        host = HostPool(spec, max(1, int(cfg.host_tb * TB // block_bytes)), materialize=False)
        ns = Namespace(spec.name, spec.fingerprint())
        tier = StorageTier(storage, host, ns) if cfg.storage_tb > 0 else None
        self.cache = HierarchicalCache(dev, host, cache_cfg, namespace=ns, storage=tier, storage_config=StorageConfig(url="memory://"))


def run_plan(requests: list[TraceRequest], cfg: PlanConfig = PlanConfig(), cache_cfg: CacheConfig = CacheConfig()) -> PlanReport:
    base = KVSpec.preset(cfg.spec)
    block = MOONCAKE_BLOCK_TOKENS
    if block % base.page_size:
        raise ConfigError(f"spec page_size {base.page_size} must divide the trace block of {block} tokens")
    spec = base.with_(page_size=block)  # one planning page = one trace block = block/page_size spec pages
    block_bytes = spec.page_bytes
    storage = MemoryBackend(max_objects=int(cfg.storage_tb * TB * cfg.nodes // block_bytes))
    nodes = [_Node(spec, cfg, block_bytes, storage, cache_cfg) for _ in range(cfg.nodes)]
    hits = {"device": 0, "host": 0, "storage": 0}
    input_tokens = 0
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        node = nodes[(r.hash_ids[0] if cfg.routing == "affinity" and r.hash_ids else i) % cfg.nodes].cache
        keys = [_block_key(h) for h in r.hash_ids[: r.input_length // block]]
        usable_max = (r.input_length - 1) // block
        m = node.match(keys)
        node.lock(m.last_node)
        fetched = 0
        if m.num_storage_pages and m.num_device_pages + m.num_host_pages < usable_max:
            h = node.prefetch(m)
            fetched = node.resolve_prefetch(h, "wait_complete")
            if h is not None:
                m2 = node.match(keys, count=False)
                node.lock(m2.last_node)
                node.unlock(m.last_node)
                m = m2
        on_device = m.num_device_pages
        ld = node.load_back(m)
        usable = min(len(ld.device_pages), usable_max)
        total = -(-r.input_length // block)
        new = node.alloc_device(total - usable)
        if new.ok:
            pages = ld.device_pages[:usable] + new.pages
            full = len(keys)
            node.insert(keys, pages[:full])
            if total > full:
                node.free_device(pages[full:])
        node.unlock(m.last_node)
        dev_hit = min(on_device, usable)
        sto_hit = max(0, min(fetched, usable - dev_hit))
        hits["device"] += dev_hit * block
        hits["storage"] += sto_hit * block
        hits["host"] += (usable - dev_hit - sto_hit) * block
        input_tokens += r.input_length
    elapsed = time.perf_counter() - t0
    duration = max((requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0, 1e-3) if requests else 1.0
    stats = [n.cache.stats for n in nodes]
    total_hits = sum(hits.values())
    bound = infinite_cache_hit_ratio(requests, block)
    per_node = {
        "host_to_device": (hits["host"] + hits["storage"]) * spec.bytes_per_token / duration / cfg.nodes,
        "device_to_host": sum(s.backed_up_bytes for s in stats) / duration / cfg.nodes,
        "storage_to_host": hits["storage"] * spec.bytes_per_token / duration / cfg.nodes,
        "host_to_storage": sum(s.storage_saved_bytes for s in stats) / duration / cfg.nodes,
    }
    link = {
        "pcie_host_to_device": per_node["host_to_device"] / (cfg.pcie_gbps * GB),
        "pcie_device_to_host": per_node["device_to_host"] / (cfg.pcie_gbps * GB),
        "network_storage": (per_node["storage_to_host"] + per_node["host_to_storage"]) / (cfg.network_gbps * GB),
    }
    recompute_s = cfg.flops_per_token / (cfg.prefill_tflops * 1e12)
    load_host_s = spec.bytes_per_token / (cfg.pcie_gbps * GB)
    load_storage_s = spec.bytes_per_token / (min(cfg.pcie_gbps, cfg.network_gbps) * GB)
    for n in nodes:
        n.cache.close()
    return PlanReport(
        requests=len(requests), input_tokens=input_tokens, trace_seconds=round(duration, 3), nodes=cfg.nodes,
        block_tokens=block, block_bytes=block_bytes,
        capacity_blocks={"device": nodes[0].cache.device.num_pages, "host": nodes[0].cache.host.num_pages, "storage_shared": storage.max_objects or 0},
        hit_ratio={k: round(v / input_tokens, 4) for k, v in hits.items()} | {"total": round(total_hits / input_tokens, 4)},
        infinite_cache_hit_ratio=round(bound, 4), fraction_of_bound=round(total_hits / input_tokens / bound, 4) if bound else 0.0,
        bytes_per_second_per_node={k: round(v / GB, 3) for k, v in per_node.items()} | {"unit": "GB/s"},  # type: ignore[dict-item]
        link_utilization={k: round(v, 4) for k, v in link.items()},
        load_vs_recompute={
            "recompute_us_per_token": round(recompute_s * 1e6, 4),
            "load_from_host_us_per_token": round(load_host_s * 1e6, 4),
            "load_from_storage_us_per_token": round(load_storage_s * 1e6, 4),
            "host_hit_speedup": round(recompute_s / load_host_s, 2),
            "storage_hit_speedup": round(recompute_s / load_storage_s, 2),
        },
        replay_seconds=round(elapsed, 3), requests_per_second=round(len(requests) / elapsed, 1),
    )


def sweep_host(requests: list[TraceRequest], cfg: PlanConfig, host_tbs: list[float], cache_cfg: CacheConfig = CacheConfig()) -> list[dict]:
    from dataclasses import replace

    rows = []
    for tb in host_tbs:
        r = run_plan(requests, replace(cfg, host_tb=tb), cache_cfg)
        rows.append({"host_tb": tb, **{f"hit_{k}": v for k, v in r.hit_ratio.items()}, "fraction_of_bound": r.fraction_of_bound})
    return rows
