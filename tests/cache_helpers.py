"""A tiny engine stand-in that drives HierarchicalCache exactly as an engine would, with real bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from kvtier import DevicePool, HostPool
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig


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


def expected_page(dev: DevicePool, tokens: list[int], page_index: int) -> bytes:
    parts = [page_payload(dev.spec, tokens, page_index, layer, b.name, b.page_bytes) for layer in range(dev.spec.num_layers) for b in dev.spec.buffers]
    return torch.cat(parts).numpy().tobytes()


@dataclass
class Served:
    device_hit: int
    #: pages loaded from host, the ones a prefetch just brought from L3 included
    host_hit: int
    computed: int
    pages: list[int]
    #: of ``host_hit``, pages that came from L3
    storage_hit: int = 0


def serve(cache: HierarchicalCache, tokens: list[int], check_bytes: bool = True, *, prefetch: bool = False, policy: str | None = None) -> Served:
    """begin -> compute the rest -> verify every page's bytes -> commit (kvtier's request protocol)."""
    spec = cache.spec
    req = cache.begin(tokens, prefetch=prefetch, prefetch_policy=policy)
    have = req.num_cached
    full = len(tokens) // spec.page_size
    tail = 1 if len(tokens) % spec.page_size else 0
    new = req.alloc(full - have + tail)
    assert new.ok, "test pools are sized so a single request fits"
    for i, page in enumerate(new.pages[: full - have]):
        write_page(cache.device, page, tokens, have + i)
    for layer in range(spec.num_layers):
        req.wait_layer(layer)
    pages = req.cached_pages + new.pages[: full - have]
    if check_bytes:
        for i, page in enumerate(pages):
            assert cache.device.page_bytes(page) == expected_page(cache.device, tokens, i), f"page {i} (device page {page}) has wrong bytes"
    ins = req.commit(pages + new.pages[full - have :])
    return Served(req.device_hit, req.host_hit + req.storage_hit, full - have, ins.device_pages, req.storage_hit)


def make_cache(spec, dev_pages: int, host_pages: int, layout: str = "layer_first", **config) -> HierarchicalCache:
    return HierarchicalCache(DevicePool(spec, dev_pages), HostPool(spec, host_pages, layout), CacheConfig(**config))


def make_tiered_cache(spec, dev_pages: int, host_pages: int, url: str, layout: str = "page_first", model: str = "m", storage_cfg: dict | None = None, **config) -> HierarchicalCache:
    """A device+host+L3 cache over a real backend URL."""
    from kvtier.build import open_storage_tier
    from kvtier.config import StorageConfig
    from kvtier.hashing import Namespace

    dev, host = DevicePool(spec, dev_pages), HostPool(spec, host_pages, layout)
    ns = Namespace(model, spec.fingerprint())
    scfg = StorageConfig(url=url, **(storage_cfg or {}))
    tier = open_storage_tier(scfg, host, ns)
    return HierarchicalCache(dev, host, CacheConfig(**config), namespace=ns, storage=tier, storage_config=scfg)


def serve_tiered(cache: HierarchicalCache, tokens: list[int], policy: str | None = None) -> tuple[int, int, int, int]:
    """Like :func:`serve`, with an L3 prefetch first. Returns (device, host, storage, computed) pages."""
    s = serve(cache, tokens, prefetch=True, policy=policy)
    return s.device_hit, s.host_hit - s.storage_hit, s.storage_hit, s.computed
