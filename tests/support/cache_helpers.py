"""A tiny engine stand-in that drives the cache exactly as an engine would, with real bytes.

Two compositions of the same policy core (``MODES``): ``"one process"`` is a
:class:`HierarchicalCache` (core + local executor), ``"two processes"`` is a
:class:`CacheCore` whose executor -- pools, transfer engine, L3 tier -- lives
in a spawned process behind a :class:`PipeExecutor`, plans and completions
pickled across the pipe. Page bytes are written and read where the executor
is (:func:`on_worker`), so every scenario compares bytes bit-exact in both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvtier import DevicePool, HostPool
from kvtier.alloc import PageAllocator
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import CacheCore
from kvtier.core.request import CacheRequest
from kvtier.executors.pipe import PipeExecutor, WorkerSpec
from kvtier.hashing import Namespace

MODES = ("one process", "two processes")


def page_payload(spec, tokens: list[int], page_index: int, layer: int, buffer: str, row_bytes: int) -> torch.Tensor:
    """Deterministic bytes for one page: a function of the page's prefix (as real KV is)."""
    prefix = tokens[: (page_index + 1) * spec.page_size]
    seed = xxhash.xxh64_intdigest(repr((list(prefix), layer, buffer)).encode()) & 0x7FFFFFFF  # same in every process
    return torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def write_page(dev: DevicePool, page: int, tokens: list[int], page_index: int) -> None:
    for layer in range(dev.spec.num_layers):
        for b in dev.spec.buffers:
            row = dev.rows(b.name, layer)[page].view(torch.uint8)
            row.copy_(page_payload(dev.spec, tokens, page_index, layer, b.name, b.page_bytes))


def expected_page(has_spec, tokens: list[int], page_index: int) -> bytes:
    """The bytes page ``page_index`` of ``tokens`` must hold (``has_spec``: a KVSpec, a pool or a cache)."""
    spec = getattr(has_spec, "spec", has_spec)
    parts = [page_payload(spec, tokens, page_index, layer, b.name, b.page_bytes) for layer in range(spec.num_layers) for b in spec.buffers]
    return torch.cat(parts).numpy().tobytes()


def tokens(start: int, n: int) -> list[int]:
    """``n`` token ids from ``start``."""
    return list(range(start, start + n))


# ---- where the bytes are: run next to the cache's executor (this process or the worker) ----
def on_worker(cache, fn, *args):
    return cache.port.run(fn, *args)


def _write_pages(executor, pages: list[int], tokens: list[int], first: int) -> None:
    for i, page in enumerate(pages):
        write_page(executor.engine.device, page, tokens, first + i)


def _device_bytes(executor, pages: list[int]) -> list[bytes]:
    return [executor.engine.device.page_bytes(p) for p in pages]


def _fill_device(executor, value: int) -> None:
    for layers in executor.engine.device.buffers.values():
        for t in layers:
            t.view(-1).view(torch.uint8).fill_(value)


def _indexer_nonzero(executor, pages: list[int]) -> bool:
    dev = executor.engine.device
    return all(bool(dev.buffer("indexer", layer)[p].any()) for p in pages for layer in range(dev.spec.num_layers))


def write_pages(cache, pages: list[int], tokens: list[int], first: int = 0) -> None:
    """Compute pages ``first...`` of ``tokens`` into device ``pages``, where the device pool is."""
    if pages:
        on_worker(cache, _write_pages, list(pages), list(tokens), first)


def device_bytes(cache, pages: list[int]) -> list[bytes]:
    return on_worker(cache, _device_bytes, list(pages))


def fill_device(cache, value: int) -> None:
    on_worker(cache, _fill_device, value)


def indexer_nonzero(cache, pages: list[int]) -> bool:
    return on_worker(cache, _indexer_nonzero, list(pages))


@dataclass
class Served:
    device_hit: int
    #: pages loaded from host, the ones a prefetch just brought from L3 included
    host_hit: int
    computed: int
    pages: list[int]
    #: of ``host_hit``, pages that came from L3
    storage_hit: int = 0


def serve(cache: CacheCore, tokens: list[int], check_bytes: bool = True, *, prefetch: bool = False, policy: str | None = None,
          on_begin: Callable[[CacheRequest], None] | None = None, tenant: object = None) -> Served:
    """begin -> compute the rest -> verify every page's bytes -> commit (kvtier's request protocol).
    ``on_begin(request)``: called once the request began (its prefetch resolved), before anything is computed.
    ``tenant``: whose request it is."""
    spec = cache.spec
    req = cache.begin(tokens, prefetch=prefetch, prefetch_policy=policy, tenant=tenant)
    if on_begin is not None:
        on_begin(req)
    have = req.num_cached
    full = len(tokens) // spec.page_size
    tail = 1 if len(tokens) % spec.page_size else 0
    new = req.alloc(full - have + tail)
    assert new.ok, "test pools are sized so a single request fits"
    write_pages(cache, new.pages[: full - have], tokens, have)
    for layer in range(spec.num_layers):
        req.wait_layer(layer)
    pages = req.cached_pages + new.pages[: full - have]
    if check_bytes:
        for i, got in enumerate(device_bytes(cache, pages)):
            assert got == expected_page(spec, tokens, i), f"page {i} (device page {pages[i]}) has wrong bytes"
    ins = req.commit(pages + new.pages[full - have :])
    return Served(req.device_hit, req.host_hit + req.storage_hit, full - have, ins.device_pages, req.storage_hit)


def split_cache(spec, dev_pages: int, host_pages: int, layout: str, config: CacheConfig, storage: StorageConfig = StorageConfig(),
                namespace: Namespace | None = None) -> CacheCore:
    """The core here, the executor (pools, transfer engine, L3 tier) in a spawned process."""
    port = PipeExecutor(WorkerSpec(spec, dev_pages, host_pages, layout, storage=storage, namespace=namespace))
    return CacheCore(
        spec, PageAllocator(dev_pages, "device pool"), PageAllocator(host_pages, "host pool"), port, config, storage, namespace=namespace
    )


def make_cache(spec, dev_pages: int, host_pages: int, layout: str = "layer_first", mode: str = "one process", **config) -> CacheCore:
    if mode == "two processes":
        return split_cache(spec, dev_pages, host_pages, layout, CacheConfig(**config))
    return HierarchicalCache(DevicePool(spec, dev_pages), HostPool(spec, host_pages, layout), CacheConfig(**config))


def make_tiered_cache(
    spec,
    dev_pages: int,
    host_pages: int,
    url: str,
    layout: str = "page_first",
    model: str = "m",
    storage_cfg: dict | None = None,
    mode: str = "one process",
    **config,
) -> CacheCore:
    """A device+host+L3 cache over a real backend URL."""
    from kvtier.build import open_storage_tier

    ns = Namespace(model, spec.fingerprint())
    scfg = StorageConfig(url=url, **(storage_cfg or {}))
    if mode == "two processes":
        return split_cache(spec, dev_pages, host_pages, layout, CacheConfig(**config), scfg, ns)
    dev, host = DevicePool(spec, dev_pages), HostPool(spec, host_pages, layout)
    tier = open_storage_tier(scfg, host, ns)
    return HierarchicalCache(dev, host, CacheConfig(**config), namespace=ns, storage=tier, storage_config=scfg)


def serve_tiered(cache: CacheCore, tokens: list[int], policy: str | None = None) -> tuple[int, int, int, int]:
    """Like :func:`serve`, with an L3 prefetch first. Returns (device, host, storage, computed) pages."""
    s = serve(cache, tokens, prefetch=True, policy=policy)
    return s.device_hit, s.host_hit - s.storage_hit, s.storage_hit, s.computed
