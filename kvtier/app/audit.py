"""``kvtier audit timing``: the prompt-cache timing audit of Gu et al. (*Auditing Prompt Caching in Language Model
APIs*, ICML 2025) on ``kvtier run``'s engine, through each tier.

A shared prefix cache is a side channel: a prompt that hits comes back faster, so whoever can time a request can
learn whether someone sent it before. kvtier puts a request's tenant in the root of its page keys, so another
tenant's prompt is never a hit (``tests/test_tenants.py``); this audit checks the same promise the way an attacker
would see it, by time alone, in each tier the victim's pages can sit in:

1. tenant A (the victim) sends a prompt; its pages are pushed down to the tier under audit (``device``: they stay
   there; ``host``: out of device memory; ``service``: the node service's region is the host tier; ``file`` /
   ``redis``: out of device and host memory, in L3 only);
2. tenant B (the attacker) sends the same prompt: the *probe*;
3. tenant B sends a fresh prompt of the same length nobody sent: the *miss*;
4. tenant A sends its prompt again: the *control*, a hit from that tier.

Each round runs a new victim prompt, the three requests in each of their six orders in turn (so a drift of the
machine's speed falls on all three alike, and each follows each of the others, and the victim, equally often: a
request's time depends on the one before it, and a hit leaves less work behind than a miss), and pushes the pages
down again after each. Two two-sample Kolmogorov-Smirnov tests on the times to first token (Gu et al.'s;
``scipy.stats.ks_2samp``):

* **pass**: the probes and the misses are not told apart, p >= ``alpha`` (0.01), and no probe hit a token;
* **control**: the same test tells A's hits from the misses, p < ``control_alpha`` (0.001) -- else the audit could
  not have seen a hit in that tier, and its verdict is *void*.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvtier.app.audit_rounds import KINDS, round_order
from kvtier.app.engine import ReferenceEngine
from kvtier.app.model import ModelConfig, ReferenceModel
from kvtier.build import build_cache
from kvtier.config import CacheConfig, StorageConfig, TierConfig
from kvtier.errors import ConfigError

#: every tier the audit can put the victim's pages in, in the order it runs them
TIERS = ("device", "host", "service", "file", "redis")


@dataclass(frozen=True)
class KsResult:
    """A two-sample Kolmogorov-Smirnov test: the statistic (the largest gap of the two empirical distributions) and its p-value."""

    statistic: float
    pvalue: float


@dataclass
class TierAudit:
    """One tier's audit: the samples per kind, their medians (ms), the hits each kind got, both tests and the verdict."""

    tier: str
    samples: int
    median_ms: dict[str, float]
    #: tokens each kind's requests hit in all (the probes' must be 0: another tenant's prefix is never a hit)
    hit_tokens: dict[str, int]
    probe_vs_miss: KsResult
    control_vs_miss: KsResult
    #: "pass" (probes look like misses, and the control saw the hits), "fail" (probes told apart, or a probe hit), "void"
    verdict: str


@dataclass
class TimingAudit:
    engine: str
    model: dict
    prompt_tokens: int
    samples: int
    alpha: float
    control_alpha: float
    tiers: list[TierAudit] = field(default_factory=list)
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    machine: str = field(default_factory=lambda: f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cpus, "
                                                   f"torch threads {torch.get_num_threads()}")

    @property
    def passed(self) -> bool:
        return all(t.verdict == "pass" for t in self.tiers)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def ks_test(a: list[float], b: list[float]) -> KsResult:
    from scipy.stats import ks_2samp

    r = ks_2samp(a, b)
    return KsResult(float(r.statistic), float(r.pvalue))


def verdict(hit_tokens: dict[str, int], probe: KsResult, control: KsResult, alpha: float, control_alpha: float) -> str:
    if control.pvalue >= control_alpha or hit_tokens["control"] == 0:
        return "void"
    return "pass" if hit_tokens["probe"] == 0 and probe.pvalue >= alpha else "fail"


@contextlib.contextmanager
def tier_cache(tier: str, spec, workdir: Path, *, device_pages: int, host_pages: int) -> Iterator[tuple[object, Callable[[], None]]]:
    """A cache whose victim pages are pushed down to ``tier`` by the returned function; the servers it needs (a node
    service, a redis-server) started under ``workdir`` and stopped after."""
    from kvtier.app.devservers import NodeServiceProcess, RedisServer

    if tier not in TIERS:
        raise ConfigError(f"unknown tier {tier!r} for the timing audit; choose from {', '.join(TIERS)}")
    with contextlib.ExitStack() as stack:
        tiers, storage = TierConfig(device_pages=device_pages, host_pages=host_pages), StorageConfig()
        if tier == "service":
            svc = NodeServiceProcess(workdir / "service", host_gb=max(4 * host_pages * spec.page_bytes / 1e9, 0.01)).start()
            stack.callback(svc.stop)
            tiers = TierConfig(device_pages=device_pages, host_pages=host_pages, service=svc.socket, service_required=True)
        elif tier == "file":
            storage = StorageConfig(url=f"file://{workdir / 'l3'}", write_policy="write_through")
        elif tier == "redis":
            server = RedisServer(workdir / "redis").start()
            stack.callback(server.stop)
            storage = StorageConfig(url=server.url, write_policy="write_through")
        cache = build_cache(spec, tiers, CacheConfig(), storage)
        stack.callback(cache.close)

        def push_down() -> None:
            cache.wait_idle()
            if tier != "device":
                cache.evict_device(cache.device.num_pages)
            if tier in ("file", "redis"):
                cache.evict_host(cache.host.num_pages)

        yield cache, push_down


def audit_tier(tier: str, model: ReferenceModel, samples: int, prompt_tokens: int, workdir: Path, *, alpha: float = 0.01,
               control_alpha: float = 0.001, on_round: Callable[[], None] = lambda: None) -> TierAudit:
    """``samples`` rounds of victim, probe, miss and control through ``tier`` (see the module's docstring)."""
    cfg = model.cfg
    pages = -(-prompt_tokens // cfg.page_size)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    hits = dict.fromkeys(KINDS, 0)
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=g).tolist()

    with tier_cache(tier, cfg.kv_spec(), workdir, device_pages=max(4 * pages, 16), host_pages=max(16 * pages, 64)) as (cache, push_down):
        engine = ReferenceEngine(model, cache)
        for i in range(samples):
            victim, fresh = prompt(), prompt()
            engine.prefill(victim, tenant="a")
            push_down()
            requests = {"probe": (victim, "b"), "miss": (fresh, "b"), "control": (victim, "a")}
            for kind in round_order(i):
                tokens, tenant = requests[kind]
                r = engine.prefill(tokens, tenant=tenant)
                times[kind].append(r.ttft_s * 1e3)
                hits[kind] += r.hit_tokens
                push_down()
            on_round()
    return tier_result(tier, samples, times, hits, alpha, control_alpha)


def tier_result(tier: str, samples: int, times: dict[str, list[float]], hits: dict[str, int], alpha: float,
                control_alpha: float) -> TierAudit:
    """A tier's rounds tested: each kind's median, both KS tests and the verdict."""
    probe, control = ks_test(times["probe"], times["miss"]), ks_test(times["control"], times["miss"])
    return TierAudit(tier, samples, {k: round(statistics.median(v), 3) for k, v in times.items()}, hits, probe, control,
                     verdict(hits, probe, control, alpha, control_alpha))


def run_timing_audit(tiers: tuple[str, ...] | list[str] = TIERS, samples: int = 250, prompt_tokens: int = 128, alpha: float = 0.01,
                     control_alpha: float = 0.001, model_cfg: ModelConfig = ModelConfig(),
                     progress: Callable[[str], Callable[[], None]] | None = None, engine: str = "run",
                     vllm_model: str = "tiny-llama") -> TimingAudit:
    """The audit through each of ``tiers`` on ``kvtier run``'s engine (its reference model of ``model_cfg``), or on vLLM's
    (``engine="vllm"``: :mod:`kvtier.app.audit_vllm`, ``vllm_model``)."""
    tiers = list(tiers)
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise ConfigError(f"--tiers {','.join(tiers)}: choose one or more of {', '.join(TIERS)}")
    if samples < 8:
        raise ConfigError(f"--samples {samples}: a two-sample test needs at least 8 a side (Gu et al. use 250)")
    if engine == "vllm":
        from kvtier.app.audit_vllm import BLOCK
        from kvtier.integrations.vllm.session import MODELS

        if vllm_model not in MODELS:
            raise ConfigError(f"--vllm-model {vllm_model!r}: choose one of {', '.join(MODELS)}")
        if prompt_tokens <= BLOCK:
            raise ConfigError(f"--prompt-tokens {prompt_tokens}: a prompt needs more than one block ({BLOCK} tokens) to have a "
                              "prefix that can hit")
    elif prompt_tokens <= model_cfg.page_size:
        raise ConfigError(f"--prompt-tokens {prompt_tokens}: a prompt needs more than one page ({model_cfg.page_size} tokens) to "
                          "have a prefix that can hit")
    if not (0 < alpha < 1 and 0 < control_alpha < 1):
        raise ConfigError(f"--alpha {alpha:g} and --control-alpha {control_alpha:g} must be between 0 and 1")
    if engine == "vllm":
        return _audit_vllm(tiers, samples, prompt_tokens, alpha, control_alpha, vllm_model, progress)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (one torch thread, as the benches: a request's time is its own work, not the threads' contention)
    try:
        model = ReferenceModel(model_cfg)
        return _audit(tiers, model, samples, prompt_tokens, alpha, control_alpha, progress)
    finally:
        torch.set_num_threads(threads)


def _audit(tiers: list[str], model: ReferenceModel, samples: int, prompt_tokens: int, alpha: float, control_alpha: float,
           progress: Callable[[str], Callable[[], None]] | None) -> TimingAudit:
    model_cfg = model.cfg
    audit = TimingAudit("kvtier run's reference engine", asdict(model_cfg), prompt_tokens, samples, alpha, control_alpha)
    with tempfile.TemporaryDirectory(prefix="kvtier-audit-") as tmp:
        for tier in tiers:
            tick = progress(tier) if progress is not None else (lambda: None)
            audit.tiers.append(audit_tier(tier, model, samples, prompt_tokens, Path(tmp) / tier, alpha=alpha,
                                          control_alpha=control_alpha, on_round=tick))
    return audit


def _audit_vllm(tiers: list[str], samples: int, prompt_tokens: int, alpha: float, control_alpha: float, model: str,
                progress: Callable[[str], Callable[[], None]] | None) -> TimingAudit:
    from kvtier.app.audit_vllm import audit_vllm_tier

    audit = TimingAudit(f"vLLM's CPU engine with kvtier's connector ({model}, float32)", {"model": model}, prompt_tokens, samples,
                        alpha, control_alpha)
    with tempfile.TemporaryDirectory(prefix="kvtier-audit-vllm-") as tmp:
        for tier in tiers:
            tick = progress(tier) if progress is not None else (lambda: None)
            got = audit_vllm_tier(tier, samples, prompt_tokens, Path(tmp) / tier, model=model)
            for _ in range(samples):
                tick()
            audit.tiers.append(tier_result(tier, samples, got["times"], got["hits"], alpha, control_alpha))
    return audit
