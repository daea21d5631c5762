"""``kvtier bench cache``: prefix bookkeeping (page keys + match + insert + locks) on a Mooncake trace.

Replays every request one at a time through :class:`HierarchicalCache` with
unmaterialized pools of ample capacity (bookkeeping only, no bytes), timing key
hashing and tree work separately. Then, in the same run, it times moving one
16k-token deepseek-v3.2 request's pages host->device (all 61 layers, direct
backend) and reports the bookkeeping of that request as a fraction of it.

``hit_ratio`` is tokens served from cache / input tokens (the convention the
trace's published figures use); ``page_hit_ratio`` counts full pages.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from kvtier.bench.timing import median_seconds
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec
from kvtier.workloads import load_mooncake_trace, trace_tokens


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
    bookkeeping_bytes_per_page: float
    request_16k_bookkeeping_ms: float
    request_16k_transfer_ms: float
    bookkeeping_over_transfer: float


def replay(cache: HierarchicalCache, requests, page_size: int) -> tuple[int, int, int, float, float]:
    """Match + lock + insert + unlock for each request. Returns (pages, hit pages, hit tokens, hash s, tree s)."""
    pages = hit_pages = hit_tokens = 0
    t_hash = t_tree = 0.0
    for req in requests:
        toks = trace_tokens(req)
        t0 = time.perf_counter()
        keys = cache.page_keys(toks)
        t1 = time.perf_counter()
        m = cache.match(keys)
        cache.lock(m.last_node)
        have = m.num_device_pages
        new = cache.alloc_device(len(keys) - have)
        ins = cache.insert(keys, m.device_pages + new.pages)
        cache.unlock(m.last_node)
        t2 = time.perf_counter()
        assert ins.new_pages == len(keys) - have
        t_hash += t1 - t0
        t_tree += t2 - t1
        pages += len(keys)
        hit_pages += have
        hit_tokens += have * page_size
    return pages, hit_pages, hit_tokens, t_hash, t_tree


def _bookkeeping_bytes_per_page(cache: HierarchicalCache) -> float:
    import sys

    nodes = cache.tree.nodes
    if not nodes:
        return 0.0
    sample = next(iter(nodes.values()))
    per_node = sys.getsizeof(sample) + sys.getsizeof(sample.key)
    # dict and LRU entries: measured from the containers' own sizes
    containers = sys.getsizeof(nodes) + sys.getsizeof(cache.tree.device_lru) + sys.getsizeof(cache.tree.host_lru)
    return per_node + containers / len(nodes)


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


def run_cache_bench(trace_path: str, limit: int | None = None, transfer: bool = True) -> CacheBenchResult:
    requests = load_mooncake_trace(trace_path, limit)
    spec = KVSpec.preset("deepseek-v3.2")
    total_pages = sum(r.input_length // spec.page_size for r in requests)
    dev = DevicePool(spec, total_pages + 1, materialize=False)
    host = HostPool(spec, 1, materialize=False)
    cache = HierarchicalCache(dev, host, CacheConfig(write_policy="write_back"))
    t0 = time.perf_counter()
    pages, hit_pages, hit_tokens, t_hash, t_tree = replay(cache, requests, spec.page_size)
    elapsed = time.perf_counter() - t0
    input_tokens = sum(r.input_length for r in requests)
    # one 16k-token request's bookkeeping, measured on a warm tree (its prefix cached)
    from kvtier.workloads.mooncake import TraceRequest

    r16 = TraceRequest(0, 16384, 1, tuple(range(10**9, 10**9 + 32)))
    replay(cache, [r16], spec.page_size)
    t_book = median_seconds(lambda _: replay(cache, [r16], spec.page_size), 5)
    t_xfer = _transfer_16k_ms() if transfer else float("nan")
    cache.close()
    return CacheBenchResult(
        trace=str(trace_path), requests=len(requests), pages=pages, distinct_pages=len(cache.tree),
        hit_ratio=round(hit_tokens / input_tokens, 4), page_hit_ratio=round(hit_pages / pages, 4),
        seconds=round(elapsed, 3), hash_seconds=round(t_hash, 3), tree_seconds=round(t_tree, 3),
        requests_per_s=round(len(requests) / elapsed, 1), pages_per_s=round(pages / elapsed), tree_pages_per_s=round(pages / t_tree),
        bookkeeping_bytes_per_page=round(_bookkeeping_bytes_per_page(cache), 1),
        request_16k_bookkeeping_ms=round(t_book * 1e3, 3), request_16k_transfer_ms=round(t_xfer, 3),
        bookkeeping_over_transfer=round(t_book * 1e3 / t_xfer, 4),
    )


def as_json(result: CacheBenchResult) -> dict:
    return asdict(result)
