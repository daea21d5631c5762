"""``MODEL``'s bytes through a cache (support.hybrid_models): each page and group object written as a
function of its key, read back and compared where the executor is (this process, or the worker)."""

from __future__ import annotations

import torch
import xxhash

from kvtier import DevicePool, HostPool
from kvtier.alloc import PageAllocator
from kvtier.cache import HierarchicalCache
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core import CacheCore
from kvtier.hashing import Namespace
from kvtier.spec import KVSpec
from support.hybrid_models import FULL, MODEL, P
from support.hybrid_rules import read_places
from support.pools import fill_pool

TOKENS = list(range(500, 500 + 6 * P))


def payload(key: object, nbytes: int) -> torch.Tensor:
    seed = xxhash.xxh64_intdigest(repr(key).encode()) & 0x7FFFFFFF
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def expected(spec: KVSpec, key: object) -> bytes:
    parts = [payload((key, layer, b.name), b.page_bytes) for layer in range(spec.num_layers) for b in spec.buffers]
    return torch.cat(parts).numpy().tobytes()


# ---- next to the bytes (this process, or the worker): the executor's pools ---------------------------
def _pool(executor, group: str) -> DevicePool:
    return executor.engine.device if group == "full" else executor.groups[group].device


def _write(executor, group: str, slot: int, key: object) -> None:
    pool = _pool(executor, group)
    for layer in range(pool.spec.num_layers):
        for b in pool.spec.buffers:
            pool.rows(b.name, layer)[slot].view(torch.uint8).copy_(payload((key, layer, b.name), b.page_bytes))


def _bytes(executor, group: str, slot: int) -> bytes:
    return _pool(executor, group).page_bytes(slot)


def _garbage(executor) -> None:
    for group in ["full", *executor.groups]:
        fill_pool(_pool(executor, group), 0xEE)


def build(mode: str, root=None, dev: int = 8, host: int = 16):
    """The hybrid cache, write_through to device/host and (``root``) to a file store."""
    storage = StorageConfig(url=f"file://{root}", write_policy="write_through", min_prefetch_pages=1) if root else StorageConfig()
    ns = Namespace("hy", MODEL.fingerprint())
    config = CacheConfig(write_policy="write_through")
    others = [g for g in MODEL.groups if g.kind != "full"]
    if mode == "one process":
        from kvtier.build import open_storage_tier

        host_pool = HostPool(FULL, host)
        pools = {g.name: (DevicePool(g.object_spec(), dev), HostPool(g.object_spec(), host)) for g in others}
        return HierarchicalCache(DevicePool(FULL, dev), host_pool, config, namespace=ns, storage=open_storage_tier(storage, host_pool, ns),
                                 storage_config=storage, model=MODEL, group_pools=pools, state_every=2)
    from kvtier.executors.pipe import PipeExecutor, WorkerSpec

    port = PipeExecutor(WorkerSpec(FULL, dev, host, storage=storage, namespace=ns, model=MODEL,
                                   group_pages={g.name: (dev, host) for g in others}))
    return CacheCore(FULL, PageAllocator(dev, "device"), PageAllocator(host, "host"), port, config, storage, namespace=ns, model=MODEL,
                     group_pools={g.name: (PageAllocator(dev), PageAllocator(host)) for g in others}, state_every=2)


def compute(cache, tokens: list[int]):
    """A request that computes every page it does not have, its window pages and its snapshots."""
    req = cache.begin(tokens)
    full = len(req.keys)
    new = req.alloc(full - req.num_cached)
    for j, page in enumerate(new.pages):
        cache.port.run(_write, "full", page, ("full", req.keys[req.num_cached + j]))
    groups = {}
    for c in cache.components:
        places = req.handed_places(c.name)
        ids: list[int | None] = [None] * full
        for place, gid in zip(places, req.alloc_group(c.name, len(places))):
            cache.port.run(_write, c.name, gid, (c.name, req.keys[place]))
            ids[place] = gid
        groups[c.name] = ids
    req.commit(req.cached_pages + new.pages, groups)
    return req


def check_served(cache, req, pages: int) -> None:
    """The request's cached pages and the objects it was given hold their own bytes, and it was given
    exactly what its boundary reads."""
    assert req.wait() == pages
    for i, page in enumerate(req.cached_pages):
        assert cache.port.run(_bytes, "full", page) == expected(FULL, ("full", req.keys[i])), f"page {i}"
    for c in cache.components:
        needed = read_places(c.group, pages, P)
        assert sorted(req.groups[c.name]) == needed
        spec = c.group.object_spec()
        for place, gid in req.groups[c.name].items():
            assert cache.port.run(_bytes, c.name, gid) == expected(spec, (c.name, req.keys[place])), f"{c.name} object {place}"
