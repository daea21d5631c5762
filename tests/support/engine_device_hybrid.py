"""The engine-device core (the engine owns every group's device blocks: vLLM's hybrid KV cache manager)
with ``MODEL`` (support.hybrid_models): built in this process or behind a pipe, the engine's writes
into its own ids, and the check of what a load wrote into them."""

from __future__ import annotations

from kvtier.alloc import PageAllocator
from kvtier.config import CacheConfig, StorageConfig
from kvtier.core.engine_device import EngineDeviceCore
from kvtier.executors.chain import ChainedExecutor
from kvtier.executors.pipe import PipeExecutor, WorkerSpec
from kvtier.hashing import Namespace
from support.hybrid_bytes import _bytes, _write, expected
from support.hybrid_models import FULL, MODEL, P
from support.hybrid_rules import read_places

OTHERS = [g for g in MODEL.groups if g.kind != "full"]
DEV, HOST = 24, 16


def build(mode: str, root=None, host: int = HOST, window_host: int = HOST):
    storage = StorageConfig(url=f"file://{root}", write_policy="write_through", min_prefetch_pages=1) if root else StorageConfig()
    ns = Namespace("hy", MODEL.fingerprint())
    spec = WorkerSpec(FULL, DEV, host, storage=storage, namespace=ns, model=MODEL, group_pages={g.name: (DEV, host) for g in OTHERS})
    # a copy into the engine follows the fetch that fills its host pages: a chain in front, as a vLLM worker runs them
    port = ChainedExecutor(spec.build() if mode == "one process" else PipeExecutor(spec))
    return EngineDeviceCore(FULL, PageAllocator(host, "host"), port, CacheConfig(preallocate_nodes=False), storage, namespace=ns,
                            model=MODEL, group_hosts={"swa": PageAllocator(window_host, "swa"), "ssm": PageAllocator(host, "ssm")},
                            state_every=2)


def on_worker(core, fn, *args):
    """Run ``fn(executor, *args)`` where the bytes are (this process, or the worker)."""
    return core.port.inner.run(fn, *args)


def keys_of(core, n: int, seed: int = 0):
    return core.page_keys(list(range(1000 + seed, 1000 + seed + n * P)))


def engine_writes(core, keys, blocks: list[int], groups: dict[str, list[int | None]]) -> None:
    """The engine computed ``keys`` into ``blocks`` and its group objects into their ids."""
    for key, b in zip(keys, blocks):
        on_worker(core, _write, "full", b, ("full", key))
    for name, ids in groups.items():
        for key, gid in zip(keys, ids):
            if gid is not None:
                on_worker(core, _write, name, gid, (name, key))


def computed(core, keys, base: int, window_from: int = 0):
    """Engine ids for a prompt of ``keys``: full blocks ``base..``, window blocks from page ``window_from``
    (vLLM freed the ones before), a snapshot slot every second page and at the last."""
    n = len(keys)
    blocks = list(range(base, base + n))
    groups = {"swa": [base + i if i >= window_from else None for i in range(n)],
              "ssm": [base + i if (i + 1) % 2 == 0 or i == n - 1 else None for i in range(n)]}
    engine_writes(core, keys, blocks, groups)
    return blocks, groups


def check_loaded(core, keys, load, first: int, blocks, groups) -> None:
    """The engine ids of pages ``first .. load.loaded`` hold their pages' bytes, and each group's ids hold
    exactly the objects the boundary reads (the others untouched: still garbage)."""
    d = load.loaded
    for i in range(first, d):
        assert on_worker(core, _bytes, "full", blocks[i]) == expected(FULL, ("full", keys[i])), f"page {i}"
    for c in core.components:
        spec = c.group.object_spec()
        needed = set(read_places(c.group, d, P))
        for i, gid in enumerate(groups[c.name]):
            if gid is None:
                continue
            got = on_worker(core, _bytes, c.name, gid)
            if i in needed and i >= first:
                assert got == expected(spec, (c.name, keys[i])), f"{c.name} object {i}"
            else:
                assert got == bytes([0xEE]) * spec.page_bytes, f"{c.name} object {i} was written, and the boundary does not read it"
