"""What ``kvtier plan`` takes (cluster shape, link speeds) and what a replay counts."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Literal

from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS
from kvtier.config import ConfigError, _help, check_number
from kvtier.errors import UnknownNameError
from kvtier.groups import HYBRID_PRESETS, ModelSpec, model_spec
from kvtier.spec import KVSpec

GB = 1e9
TB = 1e12
#: pages per L3 backend call in the replay (an L3 save evicts after each such batch)
L3_BATCH_PAGES = 8
#: the most engine nodes a plan replays (each is a policy core of its own)
MAX_PLAN_NODES = 4096
#: tier sizes are clamped here before anything is sized from them
MAX_BLOCKS = 1 << 40
#: the largest tier a node may be given, TB (an exabyte: any larger value is a typo)
MAX_TB = 1e6


@dataclass(frozen=True)
class PlanConfig:
    """Cluster shape and link speeds; sizes are per node."""

    spec: str = _help("model preset: a KVSpec preset, or a hybrid one (gpt-oss-120b, gemma-3-27b, qwen3-next-80b-a3b)", "deepseek-v3.2")
    nodes: int = _help("engine nodes; requests are routed to them", 1)
    device_gb: float = _help("KV cache memory on the GPUs of one node (L1), GB", 40.0)
    host_tb: float = _help("pinned host memory for KV per node (L2), TB", 1.0)
    storage_tb: float = _help("L3 capacity contributed per node (shared by all nodes), TB", 20.0)
    routing: Literal["kv_aware", "affinity", "round_robin"] = _help(
        "kv_aware: the node with the most cached prefix blocks minus kv_load_weight x its queued prefill blocks "
        "(see kvtier.app.plan.routing); affinity: by the first block's hash; round_robin", "kv_aware")
    kv_load_weight: float = _help("kv_aware: how many cached prefix blocks one block of queued prefill on a node costs", 1.0)
    kv_host_weight: float | None = _help("kv_aware: what a prefix block the router expects on host is worth against one on device "
                                         "(default: 1 - load time / prefill time of a block, from the link speeds)", None)
    kv_min_match: float = _help("kv_aware: a request whose best cached prefix covers less than this fraction of its blocks goes to "
                                "the least loaded node", 0.5)
    arrival_speedup: float = _help("replay the trace's arrivals this many times faster (load test: 2 = twice the request rate)", 1.0)
    pcie_gbps: float = _help("host<->device bandwidth per node and direction, GB/s (PCIe Gen5 x16 ~ 55)", 55.0)
    network_gbps: float = _help("storage network bandwidth per node, GB/s", 25.0)
    prefill_tflops: float = _help("effective prefill compute of one node, TFLOP/s (e.g. 8 GPUs x 400 at ~50% MFU)", 3200.0)
    flops_per_token: float = _help("prefill FLOPs per token (2 x active parameters; DeepSeek-V3.2: 37e9 active)", 74e9)
    state_every: int = _help("hybrid models: a state snapshot every this many blocks, and at each prompt's last block", 4)
    window_pool: Literal["shared", "own"] = _help(
        "hybrid models: where sliding-window pages live. shared: in the full pages' pool where a window page fits a slot "
        "(one budget per tier; window pages no request reads go first); own: a pool of their own, one window page per block", "shared")

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"PlanConfig.nodes must be >= 1; got {self.nodes}")
        if self.routing not in ("kv_aware", "affinity", "round_robin"):
            raise ConfigError(f"PlanConfig.routing must be kv_aware, affinity or round_robin; got {self.routing!r}")
        check_number(self, "nodes", at_least=1, at_most=MAX_PLAN_NODES, integer=True)
        for name in ("host_tb", "storage_tb"):
            check_number(self, name, at_least=0, at_most=MAX_TB)
        check_number(self, "kv_load_weight", at_least=0)
        check_number(self, "kv_min_match", at_least=0)
        check_number(self, "kv_host_weight", at_least=0)
        if self.kv_min_match > 1:
            raise ConfigError(f"PlanConfig.kv_min_match is a fraction of a request's blocks, 0..1; got {self.kv_min_match!r}")
        check_number(self, "device_gb", above=0, at_most=MAX_TB * 1000)
        for name in ("pcie_gbps", "network_gbps", "prefill_tflops", "flops_per_token", "arrival_speedup"):
            check_number(self, name, above=0)
        check_number(self, "state_every", at_least=1, integer=True)
        if self.window_pool not in ("shared", "own"):
            raise ConfigError(f"PlanConfig.window_pool must be shared or own; got {self.window_pool!r}")
        if self.window_pool == "own" and not any(g.kind == "sliding_window" for g in plan_model(self.spec).groups):
            raise ConfigError(f"PlanConfig.window_pool 'own' places sliding-window pages, and {self.spec!r} has no sliding-window "
                              "group: leave window_pool out (a model with one: " + ", ".join(
                                  n for n, m in HYBRID_PRESETS.items() if any(g.kind == "sliding_window" for g in m.groups)) + ")")


@dataclass(frozen=True)
class Capacity:
    """Tier sizes of one planning run, in blocks (one block = one trace block of every layer and buffer)."""

    device: int
    host: int
    #: the shared L3 of all nodes; None when there is no storage tier
    storage: int | None


def plan_model(name: str) -> ModelSpec:
    """The model a plan spec names: a KVSpec or hybrid preset, or an engine's model (``reference-dsa``,
    ``reference-hybrid``, ``vllm-tiny-llama``, ``vllm-tiny-gemma3``: what ``--calibrate`` measures)."""
    from kvtier.app.plan.engines import ENGINE_MODELS, engine_model

    model = engine_model(name)
    if model is not None:
        return model
    try:
        return model_spec(name)
    except UnknownNameError as e:
        raise UnknownNameError("model preset", name, [*e.valid, *ENGINE_MODELS]) from None


def planning_spec(cfg: PlanConfig) -> KVSpec:
    """The spec with one page per trace block (``512 / page_size`` pages of the real spec); a hybrid
    model's: its full-attention group's."""
    base = plan_model(cfg.spec).group("full").attention  # (an unknown name lists every preset, hybrid ones too)
    if MOONCAKE_BLOCK_TOKENS % base.page_size:
        raise ConfigError(f"spec page_size {base.page_size} must divide the trace block of {MOONCAKE_BLOCK_TOKENS} tokens")
    return base.with_(page_size=MOONCAKE_BLOCK_TOKENS)


def planning_model(cfg: PlanConfig) -> ModelSpec | None:
    """A hybrid model's groups with one page per trace block (None for a full-attention one)."""
    model = plan_model(cfg.spec)
    if not model.is_hybrid:
        return None
    groups = tuple(dataclasses.replace(g, attention=g.attention.with_(page_size=MOONCAKE_BLOCK_TOKENS)) if g.attention is not None else g
                   for g in model.groups)
    return ModelSpec(model.name, model.num_layers, groups)


def window_groups(cfg: PlanConfig) -> list[str]:
    """The sliding-window groups that share the full pages' pool (``window_pool`` shared): those whose
    page fits a full page's slot (gpt-oss-120b's: the same layers and heads). One budget per tier, and
    a window page goes before a full page of equal recency
    (:meth:`~kvtier.core.group_residency.GroupResidency._make_room`).

    A larger window page keeps a pool of its own, one page per block. Gemma 3 27B's is 5.2 full pages:
    split into slot-sized groups as vLLM's hybrid allocator does, six slots carry 52 layers in 60
    layers' room, and on the shipped trace that padding cost more than sharing won (1,500 requests,
    80 GB device, 4 TB host: 0.2095 of tokens hit, against 0.2166 with a pool of its own)."""
    model = planning_model(cfg)
    if model is None or cfg.window_pool != "shared":
        return []
    full = model.group("full").attention.page_bytes
    return [g.name for g in model.groups if g.kind == "sliding_window" and g.attention.page_bytes <= full]


def block_bytes(cfg: PlanConfig) -> float:
    """What one slot of a tier costs: a full-attention page, and for a hybrid model the pages of window
    groups with pools of their own (one per block) and the share of a state snapshot (one every
    ``state_every`` blocks) the tier keeps beside it. Tiers are sized in such slots; window groups
    that share the full pages' pool (:func:`window_groups`) take slots of it, as many as a tier keeps."""
    spec = planning_spec(cfg)
    model = planning_model(cfg)
    shared = window_groups(cfg)
    cost = float(spec.page_bytes)
    for g in model.groups if model is not None else ():
        if g.kind == "sliding_window" and g.name not in shared:
            cost += g.attention.page_bytes
        elif g.kind == "state":
            cost += g.state_bytes / cfg.state_every
    return cost


def slots_per_block(cfg: PlanConfig) -> int:
    """The most slots one cached block takes: its full page and a page of each window group sharing the pool."""
    return 1 + len(window_groups(cfg))


def group_capacity(cfg: PlanConfig, cap: Capacity) -> dict[str, Capacity]:
    """Object ids per tier of each other group with a pool of its own: one per slot, so its objects never
    compete for their pool and live exactly as long as their pages -- the regime in which a bigger
    tier never serves fewer hits (tests/test_plan_hybrid.py sweeps it). The bytes are what
    :func:`block_bytes` reserves: a window page per block, a snapshot per ``state_every`` blocks (the
    planner's engine keeps snapshots at that cadence only)."""
    model = planning_model(cfg)
    shared = window_groups(cfg)
    return {g.name: Capacity(cap.device, cap.host, cap.storage) for g in (model.groups if model is not None else ())
            if g.kind != "full" and g.name not in shared}


def capacity(cfg: PlanConfig, block_bytes: float) -> Capacity:
    """Tier sizes in blocks of ``block_bytes``: per node for device and host, the shared L3 for all nodes."""
    return Capacity(
        device=max(1, _blocks(cfg.device_gb * GB, block_bytes)),
        host=max(1, _blocks(cfg.host_tb * TB, block_bytes)),
        storage=_blocks(cfg.storage_tb * TB * cfg.nodes, block_bytes) if cfg.storage_tb > 0 else None,
    )


def _blocks(nbytes: float, block_bytes: int) -> int:
    """Whole blocks in ``nbytes``, at most ``MAX_BLOCKS`` (a size of 1e300 TB is "more than any trace
    needs", not an overflow). Pools are then sized from what the trace can use (replay_cache)."""
    return int(min(nbytes / block_bytes, MAX_BLOCKS))


@dataclass(frozen=True)
class TokenCosts:
    """Seconds per prompt token on one node: prefilling it, or loading its KV from host (PCIe) or
    from L3 (the slower of PCIe and the storage network). The planner's one cost model."""

    recompute_s: float
    load_host_s: float
    load_storage_s: float

    @classmethod
    def of(cls, cfg: PlanConfig) -> TokenCosts:
        bytes_per_token = planning_spec(cfg).bytes_per_token  # (a hybrid model's full pages; its window and snapshot are per hit)
        return cls(cfg.flops_per_token / (cfg.prefill_tflops * 1e12), bytes_per_token / (cfg.pcie_gbps * GB),
                   bytes_per_token / (min(cfg.pcie_gbps, cfg.network_gbps) * GB))


@dataclass
class ReplayCounts:
    """What one replay of a trace produced (summed over nodes); the report is derived from it."""

    hit_blocks: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    input_tokens: int = 0
    backed_up_blocks: int = 0
    storage_saved_blocks: int = 0
    #: (device, host, storage) blocks served per request, when asked for
    per_request: list[tuple[int, int, int]] | None = None
    #: when asked for: per request, (blocks backed up to host to make room for it, blocks of it backed up to
    #: host after it, blocks saved to L3 after it) -- what its tiers moved besides its hits
    moves: list[tuple[int, int, int]] | None = None
    #: a hybrid model: per other group, its objects moved and evicted, summed over nodes
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per other group, the most objects one node's device and host held at once
    peaks: dict[str, list[int]] = field(default_factory=dict)


def attribute_hits(usable: int, on_device: int, on_host: int) -> tuple[int, int, int]:
    """Split a request's ``usable`` leading blocks by the tier that served them.

    The prefix is the device run, then the host run, then what came from L3, so a
    request that may use fewer blocks than it matched (its last token is always
    computed, or the device was short) loses them from the deepest tier first."""
    dev = min(on_device, usable)
    host = min(on_host, usable - dev)
    return dev, host, usable - dev - host


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
    #: the routing policy and what time costs under it (see kvtier.app.plan.timing)
    routing: str = "kv_aware"
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    per_node: list[dict] = field(default_factory=list)
    load_balance: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    routing_comparison: list[dict] = field(default_factory=list)
    #: a hybrid model: per group, what a block costs, what each tier holds and what moved
    groups: dict | None = None
    #: where the time figures come from: nominal link speeds and FLOP rate, or a measured profile
    cost_model: dict = field(default_factory=dict)
    #: the tenants the trace's requests were spread over (``--tenants``: none a hit for another's blocks)
    tenants: int = 1

    def as_dict(self) -> dict:
        return asdict(self)
