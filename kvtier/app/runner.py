"""``kvtier run``: replay a workload through the reference model twice — with kvtier, and with
nothing cached (recompute) — in one invocation, and report hits, bytes moved, TTFT and
whether every request's logits agree.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

from kvtier.app.percentiles import percentiles
from kvtier.core.plans import Tier
from kvtier.build import build_cache, build_hybrid_cache
from kvtier.config import CacheConfig, ConfigError, StorageConfig, TierConfig, _help, check_number
from kvtier.app.engine import HybridEngine, ReferenceEngine, RequestResult
from kvtier.l3.base import redact_url
from kvtier.app.model import ModelConfig, ReferenceModel
from kvtier.app.model.hybrid import FULL, HybridConfig, HybridReferenceModel
from kvtier.core import NullCache
from kvtier.pools import DevicePool
from kvtier.app.workloads.synthetic import ChatWorkload

#: logits may differ by at most this much (absolute) for the check to pass; the
#: reference model is built so cached and recomputed runs are bit-identical (0.0)
LOGIT_TOLERANCE = 1e-5


@dataclass(frozen=True)
class WorkloadConfig:
    """What to replay."""

    kind: Literal["chat", "trace"] = _help("chat (built-in multi-turn generator) or trace (Mooncake format)", "chat")
    trace: str | None = _help("trace path (kind=trace); default: the one shipped in the package", None)
    limit: int = _help("trace: replay the first N requests", 24)
    scale: float = _help("trace: scale lengths by this factor for the small model", 0.05)
    sessions: int = _help("chat: concurrent sessions", 8)
    turns: int = _help("chat: turns per session", 4)
    system_prompts: int = _help("chat: distinct system prompts shared by sessions", 2)
    system_tokens: int = _help("chat: system prompt length", 512)
    user_tokens: int = _help("chat: mean user turn length", 96)
    reply_tokens: int = _help("chat: mean assistant reply length", 64)
    seed: int = _help("workload seed", 0)
    tenants: int = _help("requests of this many tenants, none of them a hit for another's pages (chat: session s is tenant "
                         "s mod N; trace: request i is tenant i mod N); 1: one tenant, the cache's own scope", 1)
    share_system_prompts: bool = _help("chat: declare the system prompts shareable across tenants (the cache's share_prefix): "
                                       "every tenant's sessions share their pages, and nothing after them", False)

    def __post_init__(self) -> None:
        if self.kind not in ("chat", "trace"):
            raise ConfigError(f"WorkloadConfig.kind must be chat or trace; got {self.kind!r}")
        for name in ("limit", "sessions", "turns", "system_prompts", "system_tokens", "user_tokens", "reply_tokens", "tenants"):
            check_number(self, name, at_least=1, integer=True)
        check_number(self, "seed", at_least=0, integer=True)
        check_number(self, "scale", above=0)
        if self.scale > 1:
            raise ConfigError(f"WorkloadConfig.scale shrinks trace lengths for the small model: it must be in (0, 1]; got {self.scale}")
        if self.share_system_prompts and self.kind != "chat":
            raise ConfigError("WorkloadConfig.share_system_prompts declares the chat workload's system prompts shareable; a trace has "
                              "none: drop it, or replay --workload-kind chat")

    def tenant_of(self, i: int) -> str | None:
        """Request ``i``'s tenant (None: one tenant, the cache's own scope). The chat workload's requests go turn by turn
        through its sessions, so a session keeps its tenant across its turns."""
        if self.tenants == 1:
            return None
        owner = i % self.sessions if self.kind == "chat" else i
        return f"tenant-{owner % self.tenants}"

    def chat(self, vocab: int) -> ChatWorkload:
        return ChatWorkload(self.sessions, self.turns, self.system_prompts, self.system_tokens, self.user_tokens, self.reply_tokens,
                            vocab, self.seed)

    def shared_prefixes(self, vocab: int) -> list[list[int]]:
        """The prefixes to declare shareable across tenants before the replay (``share_system_prompts``)."""
        return self.chat(vocab).system_texts() if self.share_system_prompts and self.kind == "chat" else []

    def requests(self, vocab: int) -> list[list[int]]:
        if self.kind == "chat":
            return self.chat(vocab).requests()
        from kvtier.app.workloads.mooncake import default_trace_path, load_mooncake_trace, trace_tokens

        reqs = load_mooncake_trace(self.trace or default_trace_path(), self.limit)
        # equal hash ids -> equal tokens; fold the large ids into the model's vocabulary
        return [((trace_tokens(r, self.scale) * 2654435761) % vocab).tolist() for r in reqs]


@dataclass(frozen=True)
class RunConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    #: ``dsa``: the MLA + DSA reference model; ``hybrid``: its hybrid variant (full, sliding-window and
    #: linear-attention state layers, :mod:`kvtier.app.model.hybrid`)
    model_kind: Literal["dsa", "hybrid"] = "dsa"
    hybrid: HybridConfig = field(default_factory=HybridConfig)

    def __post_init__(self) -> None:
        if self.model_kind not in ("dsa", "hybrid"):
            raise ConfigError(f"--model must be dsa or hybrid; got {self.model_kind!r}")


@dataclass
class RunReport:
    requests: int
    tokens: int
    hit_ratio: dict[str, float]
    tokens_loaded: int
    tokens_recomputed: int
    bytes_moved: dict[str, int]
    gbps: dict[str, float]
    ttft_s: dict[str, dict[str, float]]
    ttft_ratio_p50: float
    ttft_ratio_spread: dict[str, float]
    logits_equal: bool
    logits_bit_exact: bool
    max_abs_logit_diff: float
    logit_tolerance: float
    indexer_topk_equal: bool
    storage_url: str | None
    stats: dict[str, int]
    per_request: list[dict] = field(default_factory=list)
    model: str = "dsa"
    #: a hybrid model: per KV group, what it held and moved (see :func:`_group_report`)
    groups: dict | None = None
    #: the tenants the requests came from (none a hit for another's pages)
    tenants: int = 1
    #: prefixes declared shareable across tenants (``share_system_prompts``: the chat workload's system prompts)
    shared_prefixes: int = 0
    #: per tenant (a digest), with tenants accounted (a ``--cache-tenant-*`` bound): host pages held, bounds, lookups,
    #: hits, evictions, expiries, host copies refused at its cap (:meth:`~kvtier.core.base.CoreBase.tenant_usage`)
    tenant_usage: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _pcts(xs: list[float]) -> dict[str, float]:
    return {**{k: round(v, 5) for k, v in percentiles(xs).items()}, "mean": round(statistics.fmean(xs), 5)}


def _ratio_spread(ours: list[float], base: list[float]) -> dict[str, float]:
    """Quartiles of the per-request ratio kvtier TTFT / recompute TTFT (each pair ran back to back)."""
    ratios = sorted(o / b for o, b in zip(ours, base))
    if len(ratios) == 1:
        return {"p25": round(ratios[0], 4), "p50": round(ratios[0], 4), "p75": round(ratios[0], 4)}
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"p25": round(q[0], 4), "p50": round(q[1], 4), "p75": round(q[2], 4)}


def run_workload(cfg: RunConfig, progress: bool = True) -> RunReport:
    hybrid = cfg.model_kind == "hybrid"
    if hybrid:
        hcfg = replace(cfg.hybrid, base=cfg.model)
        model = HybridReferenceModel(hcfg)
        model_spec = hcfg.model_spec()
        spec = model_spec.group(FULL).attention
    else:
        model = ReferenceModel(cfg.model)
        spec = cfg.model.kv_spec()
    requests = cfg.workload.requests(cfg.model.vocab_size)
    tmp = None
    storage = cfg.storage
    if storage.url is None and cfg.tiers.service is None:  # (the node service keeps the tiers below the engine)
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-run-")
        storage = replace(storage, url=f"file://{tmp.name}")
    bar = None
    cache = None
    try:
        # first: a bad size fails before any work
        if hybrid:
            cache = build_hybrid_cache(model_spec, cfg.tiers, cfg.cache, storage, state_every=hcfg.state_every)
        else:
            cache = build_cache(spec, cfg.tiers, cfg.cache, storage)
        for prefix in cfg.workload.shared_prefixes(cfg.model.vocab_size):
            cache.share_prefix(prefix)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=2 * len(requests), desc="kvtier run", unit="req")
        base_pages = max(cfg.tiers.device_pages, max(-(-len(r) // spec.page_size) for r in requests) + 1)
        if hybrid:
            group_pools = {name: DevicePool(dev.spec, base_pages) for name, (dev, _host) in cache.group_pools.items()}
            null = NullCache(DevicePool(spec, base_pages), group_pools)
            baseline = HybridEngine(model, null, {FULL: null.device, **group_pools})
            engine = HybridEngine(model, cache, {FULL: cache.device, **{n: dev for n, (dev, _h) in cache.group_pools.items()}})
        else:
            baseline = ReferenceEngine(model, NullCache(DevicePool(spec, base_pages)))
            engine = ReferenceEngine(model, cache)
        baseline.prefill(requests[0][: spec.page_size * 2])  # warm-up, not measured
        # Interleaved, who goes first alternating per request, so load on the machine lands on both
        # sides alike. kvtier's background saves are drained (untimed) before each recompute request
        # so they never slow the baseline down; they still overlap kvtier's own next request.
        base: list[RequestResult] = []
        ours: list[RequestResult] = []
        for i, r in enumerate(requests):
            for side in (engine, baseline) if i % 2 == 0 else (baseline, engine):
                if side is baseline:
                    cache.wait_idle()
                    base.append(baseline.prefill(r))
                else:
                    ours.append(engine.prefill(r, tenant=cfg.workload.tenant_of(i)))
                if bar:
                    bar.update()
        cache.wait_idle()
        cache.check_integrity(idle=True)
        stats = cache.stats.snapshot()
        usage = [asdict(u) for u in cache.tenant_usage() if u.lookup_pages or u.host_pages]
        groups = _group_report(cache, hcfg) if hybrid else None
        busy = dict(cache.engine.busy_s)
        sbusy = dict(cache.storage.busy_s) if cache.storage else {}
    finally:
        if cache is not None:
            cache.close()
        if bar:
            bar.close()
        if tmp is not None:
            tmp.cleanup()
    report = _report(requests, base, ours, stats, busy, sbusy, storage.url if cfg.storage.url else None)
    report.model, report.groups, report.tenants = cfg.model_kind, groups, cfg.workload.tenants
    report.shared_prefixes = len(cfg.workload.shared_prefixes(cfg.model.vocab_size))
    report.tenant_usage = usage
    return report


def _group_report(cache, hcfg: HybridConfig) -> dict:
    """Per KV group of the hybrid model: what moved for the pages hits loaded (host and L3 hits), and
    the bytes moved per such page against a full-attention model of the same size. Every group counts
    a load as it completes: the full group its pages, the others the objects beside them, so a window's
    pages and the snapshots are among the full pages loaded; objects brought beside pages that stayed on
    device (``filled``: their bytes moved too) and those of failed loads are counted apart."""
    loaded_pages = cache.stats.loaded_pages
    full_bytes = cache.spec.page_bytes * loaded_pages
    out: dict = {FULL: {"pages_loaded": loaded_pages, "pages_load_failed": cache.stats.load_failed_pages, "bytes": full_bytes}}
    moved = full_bytes
    for c in cache.components:
        nbytes = c.group.object_spec().page_bytes * (c.loaded + c.filled)
        moved += nbytes
        what = "snapshots" if c.group.keeps == "state" else "pages"
        stats = c.stats()
        out[c.name] = {f"{what}_loaded": stats.pop("loaded"), f"{what}_from_l3": stats.pop("fetched"),
                       f"{what}_from_service": stats.pop("adopted"), "bytes": nbytes, **stats}
        if c.group.keeps != "state":
            out[c.name]["pages_skipped"] = loaded_pages - c.loaded  # pages of the hits outside every window
    twin = hcfg.full_attention_twin().page_bytes
    out["bytes_per_loaded_page"] = round(moved / loaded_pages) if loaded_pages else 0
    out["full_attention_twin_bytes_per_page"] = twin
    out["vs_full_attention_twin"] = round(moved / loaded_pages / twin, 4) if loaded_pages else None
    return out


def _report(requests, base, ours, stats, busy, sbusy, url) -> RunReport:
    tokens = sum(len(r) for r in requests)
    diffs = [float((a.logits - b.logits).abs().max()) for a, b in zip(base, ours)]
    bit_exact = all(torch.equal(a.logits, b.logits) for a, b in zip(base, ours))
    # top-k of the pages both runs computed (the cached run computes a suffix of the recompute run's pages)
    topk_equal = all(
        all(torch.equal(x, y) for x, y in zip(sa, sb))
        for a, b in zip(base, ours)
        for sa, sb in zip(a.selections[len(a.selections) - len(b.selections) :], b.selections)
    )
    dev = sum(r.device_hit_tokens for r in ours)
    host = sum(r.host_hit_tokens for r in ours)
    sto = sum(r.storage_hit_tokens for r in ours)
    moved = {
        "host_to_device": stats.loaded_bytes,
        "device_to_host": stats.backed_up_bytes,
        "host_to_storage": stats.storage_saved_bytes,
        "storage_to_host": stats.storage_prefetched_bytes,
    }
    secs = {
        "host_to_device": busy.get((Tier.HOST, Tier.DEVICE), 0.0),
        "device_to_host": busy.get((Tier.DEVICE, Tier.HOST), 0.0),
        "host_to_storage": sbusy.get("save", 0.0),
        "storage_to_host": sbusy.get("prefetch", 0.0),
    }
    t_base = [r.ttft_s for r in base]
    t_ours = [r.ttft_s for r in ours]
    return RunReport(
        requests=len(requests),
        tokens=tokens,
        hit_ratio={
            "device": round(dev / tokens, 4),
            "host": round(host / tokens, 4),
            "storage": round(sto / tokens, 4),
            "total": round((dev + host + sto) / tokens, 4),
        },
        tokens_loaded=host + sto,
        tokens_recomputed=sum(r.computed_tokens for r in ours),
        bytes_moved=moved,
        gbps={k: round(moved[k] / secs[k] / 1e9, 3) if secs[k] > 0 else 0.0 for k in moved},
        ttft_s={"kvtier": _pcts(t_ours), "recompute": _pcts(t_base)},
        ttft_ratio_p50=round(statistics.median(t_ours) / statistics.median(t_base), 4),
        ttft_ratio_spread=_ratio_spread(t_ours, t_base),
        logits_equal=max(diffs) <= LOGIT_TOLERANCE,
        logits_bit_exact=bit_exact,
        max_abs_logit_diff=max(diffs),
        logit_tolerance=LOGIT_TOLERANCE,
        indexer_topk_equal=topk_equal,
        storage_url=redact_url(url),
        stats=stats.as_dict(),
        per_request=[
            {
                "tokens": len(r),
                "device_hit": o.device_hit_tokens,
                "host_hit": o.host_hit_tokens,
                "storage_hit": o.storage_hit_tokens,
                "ttft_kvtier_s": round(o.ttft_s, 5),
                "ttft_recompute_s": round(b.ttft_s, 5),
            }
            for r, o, b in zip(requests, ours, base)
        ],
    )


def plot_report(report: RunReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.per_request
    xs = list(range(1, len(rows) + 1))
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    cum = {k: 0 for k in ("device", "host", "storage")}
    seen = 0
    series = {k: [] for k in cum}
    for r in rows:
        seen += r["tokens"]
        for k in cum:
            cum[k] += r[f"{k}_hit"]
            series[k].append(cum[k] / seen)
    a.stackplot(xs, *(series[k] for k in ("device", "host", "storage")), labels=["device", "host", "storage"])
    a.set_ylabel("cumulative prefix hit ratio")
    a.legend(loc="upper left")
    b.plot(xs, [r["ttft_recompute_s"] * 1e3 for r in rows], label="recompute")
    b.plot(xs, [r["ttft_kvtier_s"] * 1e3 for r in rows], label="kvtier")
    b.set_ylabel("TTFT (ms)")
    b.set_xlabel("request")
    b.legend(loc="upper left")
    fig.suptitle(f"kvtier run: {report.requests} requests, TTFT p50 ratio {report.ttft_ratio_p50}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
