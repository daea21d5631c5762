"""``kvtier bench sglang``: kvtier as SGLang's HiCache storage backend vs SGLang's own backends, same run.

Every side is driven the way SGLang's cache controller drives its storage
backend, through the controller's own methods on SGLang's own MHA host pool
(the clone's ``peers/sglang_harness.py``): a *set* round is ``_page_backup`` of
``pages`` host pages under fresh keys (one 128-page storage batch by default,
SGLang's ``STORAGE_BATCH_SIZE``), a *get* round is ``batch_exists`` plus
``_page_transfer`` of those pages into other host pages.

* ``file``: kvtier's ``file://`` store (zero-copy v1: ``batch_set_v1`` /
  ``batch_get_v1`` read and write the pool's pages in place, each page checked
  by its xxh3-128 checksum) against SGLang's ``HiCacheFile`` (the controller's
  generic path, ``batch_set`` / ``batch_get`` of flat data pages), each in its
  own directory under one temporary directory on the same disk.
* ``mooncake``: kvtier's ``mooncake://`` store against SGLang's
  ``MooncakeStore`` (zero-copy v1 both), one local ``mooncake_master`` and
  storage node for both, neither client contributing memory of its own.

The sides take turns within each round (who goes first alternates) after an
untimed warm-up; set rounds are cleared (untimed) before the next; the get
set is written once, untimed. Reported per backend and op: GB/s of each side's
best round, the ratio of the best times and the median of per-round ratios.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.app.bench.timing import interleaved_times


@dataclass(frozen=True)
class SGLangStorageCase:
    backend: str
    op: str
    pages: int
    page_bytes: int
    kvtier_gbps: float
    sglang_gbps: float
    ratio: float
    median_ratio: float
    sglang_class: str


@dataclass
class _Side:
    """One backend as SGLang's controller sees it: ``put(i)`` backs round ``i``'s pages up, ``get(i)``
    prefetches the get set, ``clear()`` empties what the put rounds wrote."""

    put: Callable[[int], None]
    get: Callable[[int], None]
    clear: Callable[[], None]
    write_get_set: Callable[[], None]


def _side(h, make_backend: Callable[[str], object], pool, src, dst, pages: int, zero_copy: bool, tag: str) -> _Side:
    page = pool.page_size
    put_backend, get_backend = make_backend("put"), make_backend("get")
    put_ctrl = h.controller(put_backend, pool, zero_copy=zero_copy)
    get_ctrl = h.controller(get_backend, pool, zero_copy=zero_copy)
    get_keys = h.page_keys(list(range(pages * page)), page, salt=f"{tag}-get")

    def put(i: int) -> None:
        keys = h.page_keys(list(range(pages * page)), page, salt=f"{tag}-{i}")
        done = h.backup(put_ctrl, keys, src)
        if done != pages * page:
            raise RuntimeError(f"{tag}: backup stored {done} of {pages * page} tokens")

    def get(_i: int) -> None:
        got = h.prefetch(get_ctrl, get_keys, dst)
        if got != pages:
            raise RuntimeError(f"{tag}: prefetch loaded {got} of {pages} pages")

    def write_get_set() -> None:
        if h.backup(get_ctrl, get_keys, src) != pages * page:
            raise RuntimeError(f"{tag}: could not write the get set")

    return _Side(put, get, put_backend.clear, write_get_set)


def _compare(name: str, sides: dict[str, _Side], pages: int, page_bytes: int, reps: int, sglang_class: str) -> list[SGLangStorageCase]:
    cases = []
    puts = interleaved_times({k: s.put for k, s in sides.items()}, reps, after=lambda k, _i: sides[k].clear())
    for s in sides.values():
        s.write_get_set()
    gets = interleaved_times({k: s.get for k, s in sides.items()}, reps)
    total = pages * page_bytes
    for op, t in (("set", puts), ("get", gets)):
        ours, theirs = t["kvtier"], t["sglang"]
        cases.append(SGLangStorageCase(
            backend=name, op=op, pages=pages, page_bytes=page_bytes,
            kvtier_gbps=round(total / min(ours) / 1e9, 3), sglang_gbps=round(total / min(theirs) / 1e9, 3),
            ratio=round(min(theirs) / min(ours), 3),
            median_ratio=round(statistics.median(b / a for a, b in zip(ours, theirs)), 3), sglang_class=sglang_class))
    return cases


def run_sglang_bench(backends: tuple[str, ...] = ("file", "mooncake"), pages: int = 128, reps: int = 10,
                     layers: int = 8, heads: int = 8, head_dim: int = 128, page_size: int = 16,
                     layout: str = "page_first") -> list[SGLangStorageCase]:
    from kvtier.app.bench.peers import peer_module

    h = peer_module("sglang_harness")
    from kvtier.app.devservers import MooncakeMaster

    unknown = set(backends) - {"file", "mooncake"}
    if unknown:
        from kvtier.errors import UnknownNameError

        raise UnknownNameError("sglang bench backend", sorted(unknown)[0], ("file", "mooncake"))
    tokens = pages * page_size
    pool = h.mha_pool(layout, layers=layers, heads=heads, head_dim=head_dim, page_size=page_size,
                      device_tokens=tokens, ratio=2.5)
    h.fill(pool, seed=0)
    src, dst = pool.alloc(tokens), pool.alloc(tokens)
    page_bytes = h.page_bytes(pool, 0).__len__()
    cases: list[SGLangStorageCase] = []
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-sglang-"))
    try:
        if "file" in backends:
            from sglang.srt.mem_cache.hicache_storage import HiCacheFile

            def kvtier_file(role: str):
                return h.attach(h.storage_config(f"file://{root / 'kvtier'}", model=f"bench-{role}"), pool)

            def sglang_file(role: str):
                import dataclasses

                cfg = h.storage_config("file:///unused", model=f"bench-{role}")
                return HiCacheFile(dataclasses.replace(cfg, extra_config={"file_storage_path": str(root / "sglang" / role)}))

            sides = {"kvtier": _side(h, kvtier_file, pool, src, dst, pages, True, "kvtier"),
                     "sglang": _side(h, sglang_file, pool, src, dst, pages, False, "sglang")}
            cases += _compare("file", sides, pages, page_bytes, reps, "HiCacheFile")
        if "mooncake" in backends:
            master = MooncakeMaster(node_segment=f"{max(512, 4 * pages * page_bytes >> 20)}MB").start()
            try:
                def kvtier_mc(role: str):
                    return h.attach(h.storage_config(master.url, model=f"bench-{role}"), pool)

                def sglang_mc(role: str):
                    return h.sglang_mooncake_store(h.storage_config("file:///unused", model=f"bench-{role}"), pool,
                                                   rpc_port=master.rpc_port, http_port=master.http_port)

                sides = {"kvtier": _side(h, kvtier_mc, pool, src, dst, pages, True, "kvtier"),
                         "sglang": _side(h, sglang_mc, pool, src, dst, pages, True, "sglang")}
                cases += _compare("mooncake", sides, pages, page_bytes, reps, "MooncakeStore")
            finally:
                master.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return cases


def as_json_rows(cases: list[SGLangStorageCase]) -> list[dict]:
    return [asdict(c) for c in cases]
