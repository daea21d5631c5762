"""A trace slice through ``kvtier run``'s engine on real tiers, at its arrival times: what the planner is checked against.

The engine (:class:`~kvtier.app.engine.ReferenceEngine` or :class:`~kvtier.app.engine.HybridEngine`)
serves one request at a time, in arrival order, on a cache of real pools (device and host on the
CPU, a file L3). A request that arrives while another runs waits; TTFT is from its arrival to its
first token. After each request the engine drains the tiers (``wait_idle``: its backups and L3
saves) before it takes the next, so every request sees the cache the planner's replay sees -- the
reason their per-tier hit counts agree exactly (``tests/test_plan_validate.py``) -- and the time
that takes is the engine's, as the planner's :class:`~kvtier.app.plan.timing.ProfiledCosts` books it
(timed per request: :attr:`MeasuredRun.drain_s`).
"""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from kvtier.app.plan.engine_slice import EngineSlice
from kvtier.app.plan.engines import Engine
from kvtier.config import CacheConfig, StorageConfig, TierConfig


@dataclass
class MeasuredRun:
    """What a real engine did with a slice: per request, pages served per tier and seconds from arrival to
    first token (and of that, waiting, where the engine tells: empty for vLLM); the bytes each link moved."""

    engine: str
    served: list[tuple[int, int, int]]
    ttft_s: list[float]
    queue_s: list[float]
    bytes_moved: dict[str, int]
    wall_s: float
    #: engine-specific facts (vLLM: its device blocks, block size)
    extra: dict = field(default_factory=dict)
    #: per request, the engine's own seconds from its start to the first token, where the engine tells (kvtier run's)
    service_s: list[float] = field(default_factory=list)
    #: per request, what held the engine after its first token before it could take the next (its commit, then its
    #: backups and L3 saves drained), where the engine tells (kvtier run's)
    drain_s: list[float] = field(default_factory=list)


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block (calibration and validation run alike)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_run_engine(eng: Engine, tiers: TierConfig, cache_cfg: CacheConfig, storage: StorageConfig):
    """``kvtier run``'s engine and its cache, and a recompute twin of the engine (a
    :class:`~kvtier.core.NullCache` of ``warm_pages`` pages) to warm the model up on without touching the
    cache: (engine, cache, warm-up engine). The cache is the caller's to close."""
    from kvtier.app.engine import HybridEngine, ReferenceEngine
    from kvtier.app.model import ModelConfig, ReferenceModel
    from kvtier.app.model.hybrid import FULL, HybridConfig, HybridReferenceModel
    from kvtier.build import build_cache, build_hybrid_cache
    from kvtier.core import NullCache
    from kvtier.pools import DevicePool

    if eng.hybrid:
        hcfg = HybridConfig()
        model = HybridReferenceModel(hcfg)
        cache = build_hybrid_cache(hcfg.model_spec(), tiers, cache_cfg, storage, state_every=hcfg.state_every)
        pools = {FULL: cache.device, **{n: dev for n, (dev, _h) in cache.group_pools.items()}}
        warm_pools = {n: DevicePool(dev.spec, WARM_PAGES) for n, (dev, _h) in cache.group_pools.items()}
        null = NullCache(DevicePool(cache.spec, WARM_PAGES), warm_pools)
        return HybridEngine(model, cache, pools), cache, HybridEngine(model, null, {FULL: null.device, **warm_pools})
    model = ReferenceModel(ModelConfig())
    cache = build_cache(ModelConfig().kv_spec(), tiers, cache_cfg, storage)
    return ReferenceEngine(model, cache), cache, ReferenceEngine(model, NullCache(DevicePool(cache.spec, WARM_PAGES)))


#: pages of the warm-up engine's own pool (its prompt: two pages)
WARM_PAGES = 4


def run_storage(url: str | None) -> tuple[StorageConfig, tempfile.TemporaryDirectory | None]:
    """The L3 of a real run: ``url``, or a fresh file store in a temporary directory (returned, to clean up).
    Prefetch waits for every page, as the planner's replay does."""
    tmp = None
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-validate-")
        url = f"file://{tmp.name}"
    return StorageConfig(url=url, prefetch_policy="wait_complete"), tmp


def replay_on_run_engine(eng: Engine, work: EngineSlice, tiers: TierConfig, cache_cfg: CacheConfig, storage_url: str | None = None,
                         threads: int = 1, progress=None) -> MeasuredRun:
    """Serve ``work`` on ``eng`` (``run`` or ``run-hybrid``) with ``tiers``, at its arrival times."""
    storage, tmp = run_storage(storage_url)
    engine, cache, warm = build_run_engine(eng, tiers, replace(cache_cfg, preallocate_nodes=False), storage)
    ps = eng.page_tokens
    served, ttft, queue, service, drain = [], [], [], [], []
    try:
        with torch_threads(threads):
            warm.prefill(work.prompts[0][: 2 * ps])  # first-call costs, on the recompute twin: the cache sees nothing
            t0 = time.perf_counter()
            for i, (prompt, arrival) in enumerate(zip(work.prompts, work.arrivals_s)):
                now = time.perf_counter() - t0
                if now < arrival:
                    time.sleep(arrival - now)
                cache.wait_idle()  # (drained after the previous request already: the cache the planner sees)
                start = time.perf_counter() - t0
                r = engine.prefill(prompt)
                cache.wait_idle()  # its commit, backups and L3 saves, timed as the calibration times them
                drain.append(max(0.0, time.perf_counter() - t0 - start - r.ttft_s))
                served.append((r.device_hit_tokens // ps, r.host_hit_tokens // ps, r.storage_hit_tokens // ps))
                queue.append(max(0.0, start - arrival))
                ttft.append(queue[-1] + r.ttft_s)
                service.append(r.ttft_s)
                if progress is not None:
                    progress(i + 1)
            cache.wait_idle()
            wall = time.perf_counter() - t0
            moved = _moved(cache)
            cache.check_integrity(idle=True)
    finally:
        cache.close()
        if tmp is not None:
            tmp.cleanup()
    return MeasuredRun(eng.name, served, ttft, queue, moved, wall, service_s=service, drain_s=drain)


def _moved(cache) -> dict[str, int]:
    st = cache.stats
    return {"host_to_device": st.loaded_bytes, "device_to_host": st.backed_up_bytes, "host_to_storage": st.storage_saved_bytes,
            "storage_to_host": st.storage_prefetched_bytes}
