"""kvtier as SGLang's HiCache storage backend, driven by SGLang 0.5.23's own classes on CPU.

SGLang's code here (imported from its wheel, never installed): ``StorageBackendFactory`` (kvtier is
built on its ``dynamic`` path), ``HiCacheStorageConfig``, the MHA / MLA host pools and the DSA
indexer host pool, and the ``HiCacheController``'s storage methods (``_page_backup``,
``_page_transfer`` with ``_page_get_zero_copy`` / ``_page_set_zero_copy`` or the generic
flat-page functions). Replaced, because they need a GPU or a running server: the device KV
buffers (CPU tensors), the DSA device pool (a namespace of its buffers), pinned memory, and the
controller's ``__init__`` (threads, torch.distributed groups) -- see tests/support/sglang_helpers.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from support.sglang_helpers import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    StorageBackendFactory,
    _mamba_pool,
    attach,
    backup,
    controller,
    dsa_indexer_pool,
    fill,
    mha_pool,
    mla_pool,
    page_bytes,
    page_keys,
    prefetch,
    storage_config,
)
from kvtier.app.devservers import MooncakeMaster, RedisServer, wait_until
from kvtier.errors import ConfigError, PageAlignmentError
from kvtier.integrations.sglang.backend import KvtierStorage

P = 4  # tokens per page in every pool below


def same_pages(src, src_idx, dst, dst_idx) -> bool:
    return all(page_bytes(src, i) == page_bytes(dst, j) for i, j in zip(src_idx[::P].tolist(), dst_idx[::P].tolist()))


def store_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.fixture
def file_url(tmp_path) -> str:
    return f"file://{tmp_path / 'l3'}"


# ---- loading and options ------------------------------------------------------------------
def test_sglang_factory_builds_kvtier_on_the_dynamic_path(file_url):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    pool = mha_pool()
    backend = attach(storage_config(file_url), pool)
    assert isinstance(backend, KvtierStorage) and isinstance(backend, HiCacheStorage)
    assert backend.options.url == file_url


def test_unknown_extra_config_key_lists_the_valid_ones(file_url):
    cfg = storage_config(file_url, stroage_url="redis://x")  # a typo must not fall back to a default store
    with pytest.raises(ConfigError) as e:
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())
    msg = str(e.value)
    assert "stroage_url" in msg and "storage_url" in msg and "interface_v1" in msg
    with pytest.raises(ConfigError, match="io_threads"):
        StorageBackendFactory.create_backend("dynamic", storage_config(file_url, io_threads=0), mha_pool())


def test_the_keys_sglang_itself_puts_in_the_extra_config_are_accepted(tmp_path):
    """SGLang adds file_storage_path for --file-storage-path (UnifiedRadixCache), and the PD decode-offload
    path leaves the controller's prefetch keys in the JSON: each failed the attach with a ConfigError.
    Now they are accepted; file_storage_path is the file store's root (as SGLang means it) when
    storage_url is not given; a truly unknown key is still an error."""
    from kvtier.integrations.sglang import extra_config

    sglang_put = {"prefetch_threshold": 128, "prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.5,
                  "hicache_storage_pass_prefix_keys": True, "file_storage_path": str(tmp_path / "hicache")}
    cfg = storage_config("unused")
    cfg.extra_config = {k: v for k, v in extra_config("x").items() if k != "storage_url"} | sglang_put
    src = mha_pool()
    fill(src, seed=31)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, src)
    backend.register_mem_pool_host(src)
    keys = page_keys(list(range(8)), P)
    idx = src.alloc(8)
    assert backend.batch_set_v1(keys, idx) == [True, True]
    assert store_files(tmp_path / "hicache")  # the pages went where SGLang's --file-storage-path said
    cfg.extra_config = cfg.extra_config | {"prefetch_treshold": 1}
    with pytest.raises(ConfigError, match="prefetch_treshold"):
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())


# ---- bytes: every layout, both interfaces, through SGLang's controller --------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mha_pages_round_trip_bit_exact_through_the_controller(file_url, layout):
    src, dst = mha_pool(layout), mha_pool(layout)
    fill(src, seed=1)
    keys = page_keys(list(range(48)), P)
    src_idx = src.alloc(48)
    writer = attach(storage_config(file_url), src)
    assert backup(controller(writer, src), keys, src_idx) == 48
    # a second server (fresh backend, another pool, other host pages) gets every page back
    reader = attach(storage_config(file_url), dst)
    dst.alloc(20)
    dst_idx = dst.alloc(48)
    assert prefetch(controller(reader, dst), keys, dst_idx) == 12
    assert same_pages(src, src_idx, dst, dst_idx)
    # backing the same pages up again writes nothing new
    before = writer.get_stats().pages_written
    assert backup(controller(writer, src), keys, src_idx) == 48
    stats = writer.get_stats()
    assert stats.pages_written == before and stats.pages_already_stored == 12


def test_flat_page_interface_and_zero_copy_store_the_same_object(file_url):
    """SGLang's generic path (``get``/``set`` of flat data pages, interface_v1 off) and the zero-copy
    path read each other's pages."""
    a, b, c = mha_pool("layer_first"), mha_pool("layer_first"), mha_pool("layer_first")
    fill(a, seed=2)
    keys = page_keys(list(range(24)), P)
    ia = a.alloc(24)
    assert backup(controller(attach(storage_config(file_url), a), a, zero_copy=False), keys, ia) == 24
    ib = b.alloc(24)
    assert prefetch(controller(attach(storage_config(file_url), b), b, zero_copy=True), keys, ib) == 6
    assert same_pages(a, ia, b, ib)
    keys2 = page_keys(list(range(100, 124)), P)
    assert backup(controller(attach(storage_config(file_url), a), a, zero_copy=True), keys2, ia) == 24
    ic = c.alloc(24)
    assert prefetch(controller(attach(storage_config(file_url), c), c, zero_copy=False), keys2, ic) == 6
    assert same_pages(a, ia, c, ic)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_every_rank_reads_one_writer_writes(file_url, layout):
    src = mla_pool(layout)
    fill(src, seed=3)
    keys = page_keys(list(range(32)), P)
    idx = src.alloc(32)
    rank1 = attach(storage_config(file_url, mla=True, tp_rank=1, tp_size=2), src)
    assert not rank1.writer
    assert rank1.batch_set_v1(keys, idx) == [False] * 8  # not its shard to write; nothing stored yet
    assert rank1.batch_exists(keys) == 0
    rank0 = attach(storage_config(file_url, mla=True, tp_rank=0, tp_size=2), src)
    assert rank0.batch_set_v1(keys, idx) == [True] * 8
    for rank in (0, 1):  # MLA KV is replicated: every rank reads the writer's pages
        dst = mla_pool(layout)
        reader = attach(storage_config(file_url, mla=True, tp_rank=rank, tp_size=2), dst)
        didx = dst.alloc(32)
        assert prefetch(controller(reader, dst), keys, didx) == 8
        assert same_pages(src, idx, dst, didx)


def test_mha_ranks_and_models_never_share_pages(file_url):
    """MHA shards differ per TP rank: the namespace carries the rank, the model and the pool's geometry."""
    src = mha_pool()
    fill(src, seed=4)
    keys = page_keys(list(range(16)), P)
    idx = src.alloc(16)
    attach(storage_config(file_url, tp_rank=0, tp_size=2), src).batch_set_v1(keys, idx)
    assert attach(storage_config(file_url, tp_rank=0, tp_size=2), mha_pool()).batch_exists(keys) == 4
    assert attach(storage_config(file_url, tp_rank=1, tp_size=2), mha_pool()).batch_exists(keys) == 0
    assert attach(storage_config(file_url, tp_rank=0, tp_size=2, model="other"), mha_pool()).batch_exists(keys) == 0
    assert attach(storage_config(file_url, tp_rank=0, tp_size=2), mha_pool(head_dim=16)).batch_exists(keys) == 0
    assert attach(storage_config(file_url, tp_rank=0, tp_size=2), mha_pool("layer_first")).batch_exists(keys) == 0


# ---- the DSA indexer travels with its page ------------------------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_dsa_indexer_round_trips_with_its_page(file_url, layout):
    """SGLang #17085 (indexer pages not saved) and #30057 (an L3 hit without its indexer) are absent:
    the indexer comes back bit-exact with its latent page, through SGLang's own prefetch path."""
    src = mla_pool(layout)
    src_ix = dsa_indexer_pool(src)
    fill(src, seed=5)
    fill(src_ix, seed=6)
    keys = page_keys(list(range(40)), P)
    idx = src.alloc(40)
    writer = attach(storage_config(file_url, mla=True), src, (PoolName.INDEXER, src_ix))
    assert backup(controller(writer, src), keys, idx, sidecars=[PoolName.INDEXER]) == 40
    dst = mla_pool(layout)
    dst_ix = dsa_indexer_pool(dst)
    reader = attach(storage_config(file_url, mla=True), dst, (PoolName.INDEXER, dst_ix))
    dst.alloc(8)
    didx = dst.alloc(40)
    assert prefetch(controller(reader, dst), keys, didx, sidecars=[PoolName.INDEXER]) == 10
    assert same_pages(src, idx, dst, didx)
    assert same_pages(src_ix, idx, dst_ix, didx)
    hit = reader.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)])
    assert hit.kv_hit_pages == 10 and hit.extra_pool_hit_pages == {PoolName.KV: 10, PoolName.INDEXER: 10}


def test_a_page_without_its_indexer_is_a_miss_not_a_hit(file_url):
    """A writer that saves latent pages but not their indexer (the #17085 path) leaves misses: no
    lookup -- v1 or v2 -- offers a page whose indexer object is not stored."""
    src = mla_pool()
    src_ix = dsa_indexer_pool(src)
    fill(src, seed=7)
    keys = page_keys(list(range(24)), P)
    idx = src.alloc(24)
    forgetful = attach(storage_config(file_url, mla=True), src)  # no indexer pool registered
    assert forgetful.batch_set_v1(keys, idx) == [True] * 6
    assert forgetful.batch_exists(keys) == 6  # a server without DSA sees its own pages
    dsa_server = attach(storage_config(file_url, mla=True), mla_pool(), (PoolName.INDEXER, dsa_indexer_pool(mla_pool())))
    assert dsa_server.batch_exists(keys) == 0
    assert dsa_server.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)]).kv_hit_pages == 0
    # indexer pages saved for the first 4 pages only: the hit stops there
    full = attach(storage_config(file_url, mla=True), src, (PoolName.INDEXER, src_ix))
    full.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=idx[: 4 * P], keys=keys[:4])])
    assert dsa_server.batch_exists(keys) == 4
    assert dsa_server.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)]).kv_hit_pages == 4


# ---- the originating failure: partial pages ----------------------------------------------
def test_partial_page_is_refused_before_any_byte_moves_and_kvtier_only_hands_whole_pages(file_url, tmp_path):
    pool = mla_pool()
    ix = dsa_indexer_pool(pool)
    fill(pool, seed=8)
    fill(ix, seed=9)
    six = torch.arange(6)  # a page and a half
    with pytest.raises(ValueError, match="page-aligned indices for DSA"):
        ix._get_indexer_page_indices(six, six)  # SGLang's own DSA host pool on the same input
    backend = attach(storage_config(file_url, mla=True), pool, (PoolName.INDEXER, ix))
    keys = page_keys(list(range(8)), P)
    calls = [lambda: backend.batch_set_v1(keys[:2], six), lambda: backend.batch_get_v1(keys[:2], six),
             lambda: backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=six, keys=keys[:2])]),
             lambda: backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=six, keys=keys[:2])])]
    for call in calls:
        with pytest.raises(PageAlignmentError) as e:
            call()
        msg = str(e.value)
        assert "6 token slots" in msg and "page_size 4" in msg and "SGLang host pool" in msg
    with pytest.raises(PageAlignmentError, match="not on a page boundary"):
        backend.batch_set_v1(keys[:1], torch.arange(2, 6))
    with pytest.raises(PageAlignmentError, match="2 keys were given"):
        backend.batch_set_v1(keys[:2], torch.arange(4))
    with pytest.raises(PageAlignmentError, match="flat data page"):
        backend.set(keys[0], torch.zeros(7, dtype=torch.bfloat16))
    assert store_files(tmp_path / "l3") == []  # nothing was written
    # every page kvtier hands SGLang's pools is a whole one: SGLang's own check accepts each transfer
    seen = []
    for p in (pool, ix):
        real = p.get_data_page
        p.get_data_page = lambda index, flat=True, real=real: (seen.append(int(index)), real(index, flat))[1]
    backend = attach(storage_config(file_url, mla=True), pool, (PoolName.INDEXER, ix))
    idx = pool.alloc(32)
    keys = page_keys(list(range(32)), P)
    backup(controller(backend, pool), keys, idx, sidecars=[PoolName.INDEXER])
    prefetch(controller(backend, pool), keys, idx, sidecars=[PoolName.INDEXER])
    assert seen and all(i % P == 0 for i in seen)
    ix._get_indexer_page_indices(idx, idx)  # the slots kvtier moved pass SGLang's DSA check


# ---- faults ------------------------------------------------------------------------------
def test_corrupt_object_is_a_miss_deleted_and_repaired(file_url, tmp_path):
    src, dst = mha_pool(), mha_pool()
    fill(src, seed=10)
    keys = page_keys(list(range(16)), P)
    idx = src.alloc(16)
    writer = attach(storage_config(file_url), src)
    assert writer.batch_set_v1(keys, idx) == [True] * 4
    [target] = [f for f in store_files(tmp_path / "l3") if f.name == keys[2]]  # the third page's object
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF
    target.write_bytes(raw)
    reader = attach(storage_config(file_url), dst)
    didx = dst.alloc(16)
    assert reader.batch_get_v1(keys, didx) == [True, True, False, False]
    assert reader.get_stats().corrupt == 1
    assert not target.exists()  # deleted: the next save writes it again
    assert reader.batch_exists(keys) == 2
    assert writer.batch_set_v1(keys, idx) == [True] * 4
    assert reader.batch_get_v1(keys, didx) == [True] * 4
    assert same_pages(src, idx, dst, didx)


def test_stores_without_scattered_io_stage_and_check_before_copying():
    """A backend that moves whole objects (memory://) goes through a staged object, checked before any byte
    reaches SGLang's page: both interfaces round-trip bit-exact, and a corrupt object is a miss that leaves
    the caller's page untouched."""
    pool = mha_pool()
    fill(pool, seed=20)
    backend = attach(storage_config("memory://"), pool)
    assert not backend.backend.capabilities.scattered
    keys = page_keys(list(range(16)), P)
    idx = pool.alloc(16)
    raw = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731 (bf16 pages hold NaN bit patterns)
    flat = [pool.get_data_page(int(i), flat=True).clone() for i in idx[::P]]
    assert backend.batch_set(keys, flat)
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert [raw(g) for g in got] == [raw(f) for f in flat]
    didx = pool.alloc(16)
    assert backend.batch_get_v1(keys, didx) == [True] * 4 and same_pages(pool, idx, pool, didx)
    name = backend._kv.names([keys[2]])[0]
    obj = bytearray(backend.backend.data[name])
    obj[-1] ^= 0xFF
    backend.backend.data[name] = bytes(obj)
    target = pool.get_dummy_flat_data_page()
    assert backend.get(keys[2], target) is None
    assert raw(target) == bytes(len(raw(target))) and name not in backend.backend.data


def _store_down_then_back(backend, pool, keys, idx, stop, start):
    """While the store is down every call is a miss or a failed write within a bound, never an
    exception; once it is back (and the breaker's cooldown passed) pages are saved and hit again."""
    assert backend.batch_set_v1(keys, idx) == [True] * len(keys)
    stop()
    t0 = time.monotonic()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, idx) == [False] * len(keys)
    assert backend.batch_set_v1(keys, idx) == [False] * len(keys)
    assert backend.exists(keys[0]) is False
    assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert backend.batch_exists_v2(keys).kv_hit_pages == 0
    assert time.monotonic() - t0 < 30
    start()

    def saved_and_hit() -> bool:
        backend.batch_set_v1(keys, idx)
        return backend.batch_exists(keys) == len(keys) and all(backend.batch_get_v1(keys, idx))

    wait_until(saved_and_hit, timeout=30, what="hits after the store came back")


@pytest.mark.integration
def test_killed_redis_gives_misses_and_hits_resume(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        pool = mha_pool()
        fill(pool, seed=11)
        backend = attach(storage_config(server.url), pool)
        keys = page_keys(list(range(16)), P)
        _store_down_then_back(backend, pool, keys, pool.alloc(16), server.kill, server.start)
        assert backend.backend.stats.errors > 0
        assert backend.clear() is True and backend.batch_exists(keys) == 0
        backend.close()
    finally:
        server.stop()


@pytest.mark.integration
def test_killed_mooncake_master_gives_misses_and_hits_resume():
    master = MooncakeMaster().start()
    try:
        pool = mha_pool()
        fill(pool, seed=12)
        backend = attach(storage_config(master.url), pool)
        keys = page_keys(list(range(16)), P)
        idx = pool.alloc(16)
        # pages round-trip bit-exact through the store first (zero-copy: the pool is registered)
        dst = mha_pool()
        reader = attach(storage_config(master.url), dst)
        assert backend.batch_set_v1(keys, idx) == [True] * 4
        didx = dst.alloc(16)
        assert reader.batch_get_v1(keys, didx) == [True] * 4 and same_pages(pool, idx, dst, didx)
        reader.close()
        _store_down_then_back(backend, pool, keys, idx, master.kill, master.start)
        assert backend.clear() is True and backend.batch_exists(keys) == 0
        backend.close()
    finally:
        master.stop()


@pytest.mark.integration
def test_redis_cluster_round_trip_and_clear(tmp_path):
    from kvtier.app.devservers import start_redis_cluster

    servers = start_redis_cluster(tmp_path / "cluster")
    try:
        url = f"redis+cluster://127.0.0.1:{servers[0].port}?timeout=2"
        src, dst = mla_pool(), mla_pool()
        src_ix, dst_ix = dsa_indexer_pool(src), dsa_indexer_pool(dst)
        fill(src, seed=16)
        fill(src_ix, seed=17)
        keys = page_keys(list(range(64)), P)  # 16 pages: keys spread over the three nodes
        idx = src.alloc(64)
        writer = attach(storage_config(url, mla=True), src, (PoolName.INDEXER, src_ix))
        assert backup(controller(writer, src), keys, idx, sidecars=[PoolName.INDEXER]) == 64
        reader = attach(storage_config(url, mla=True), dst, (PoolName.INDEXER, dst_ix))
        didx = dst.alloc(64)
        assert prefetch(controller(reader, dst), keys, didx, sidecars=[PoolName.INDEXER]) == 16
        assert same_pages(src, idx, dst, didx) and same_pages(src_ix, idx, dst_ix, didx)
        assert reader.clear() is True and reader.batch_exists(keys) == 0
        writer.close()
        reader.close()
    finally:
        for s in servers:
            s.stop()


def test_trailing_pages_pool_needs_only_its_window(file_url):
    """A TRAILING_PAGES pool (SGLang's SWA / Mamba state) restores a prefix when the last len(keys)
    pages of it are stored; kvtier answers per prefix length, as SGLang's controller intersects them."""
    kv, swa = mha_pool(), mha_pool(heads=1)
    fill(kv, seed=18)
    fill(swa, seed=19)
    keys = page_keys(list(range(24)), P)
    idx = kv.alloc(24)
    backend = attach(storage_config(file_url), kv, (PoolName.SWA, swa))
    assert backend.batch_set_v1(keys, idx) == [True] * 6
    # the SWA state only for pages 1..3: windows of two end at page 3 (prefix 3) or page 4 (prefix 4)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=idx[P: 4 * P], keys=keys[1:4])]) == {"swa": [True] * 3}
    window = PoolTransfer(name=PoolName.SWA, keys=keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = backend.batch_exists_v2(keys, [window])
    assert hit.restorable_prefix_pages == [3, 4] and hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages["swa"] == 4
    blocks = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(ConfigError, match="block_groups"):
        backend.batch_exists_v2(keys, [blocks])


# ---- operator surface ----------------------------------------------------------------------
def test_clear_deletes_this_namespace_only(file_url, tmp_path):
    a, b = mha_pool(), mha_pool()
    fill(a, seed=13)
    keys = page_keys(list(range(16)), P)
    idx = a.alloc(16)
    mine = attach(storage_config(file_url, model="mine"), a)
    other = attach(storage_config(file_url, model="other"), b)
    mine.batch_set_v1(keys, idx)
    other.batch_set_v1(keys, idx)
    assert mine.clear() is True
    assert mine.batch_exists(keys) == 0 and other.batch_exists(keys) == 4


def test_stats_follow_sglang_metrics_shape(file_url):
    pool = mha_pool()
    fill(pool, seed=14)
    keys = page_keys(list(range(16)), P)
    idx = pool.alloc(16)
    backend = attach(storage_config(file_url), pool)
    backend.batch_set_v1(keys, idx)
    backend.batch_get_v1(keys + page_keys(list(range(900, 904)), P), pool.alloc(20))
    s = backend.get_stats()
    assert s.backup_pgs == [4] and s.prefetch_pgs == [4] and len(s.prefetch_bandwidth) == 1
    assert (s.pages_written, s.pages_read, s.misses) == (4, 4, 1)
    again = backend.get_stats()
    assert again.backup_pgs == [] and again.pages_written == 4  # lists drained, counters kept


def test_sglangs_own_storage_metrics_collector_takes_get_stats(file_url):
    """With --enable-metrics, SGLang hands get_stats() to its StorageMetricsCollector, which asserts
    isinstance(..., its StorageMetrics): before, every scheduler step raised AssertionError. SGLang's
    real observability module here (not a stand-in), its real prometheus histograms."""
    import prometheus_client
    from sglang.srt.observability import metrics_collector

    pool = mha_pool()
    fill(pool, seed=15)
    backend = attach(storage_config(file_url), pool)
    keys = page_keys(list(range(16)), P)
    assert backend.batch_set_v1(keys, pool.alloc(16)) == [True] * 4
    stats = backend.get_stats()
    assert isinstance(stats, metrics_collector.StorageMetrics) and stats.backup_pgs == [4]
    registry = prometheus_client.CollectorRegistry()

    class Collector(metrics_collector.StorageMetricsCollector):  # its metrics in a registry of the test's own
        _counter_cls = staticmethod(lambda **kw: prometheus_client.Counter(registry=registry, **kw))
        _gauge_cls = staticmethod(lambda **kw: prometheus_client.Gauge(registry=registry, **kw))
        _histogram_cls = staticmethod(lambda **kw: prometheus_client.Histogram(registry=registry, **kw))

    Collector(labels={"model_name": "m"}).log_storage_metrics(stats)  # SGLang's own code: no AssertionError
    assert registry.get_sample_value("sglang:backup_pgs_count", {"model_name": "m"}) == 1
    assert registry.get_sample_value("sglang:backup_pgs_sum", {"model_name": "m"}) == 4


def test_sglang_host_pool_in_a_spawned_process_reads_what_this_one_wrote(file_url, tmp_path):
    """Two processes (two servers on one store): the second sees the first's pages bit-exact."""
    import subprocess
    import sys
    import textwrap

    src = mha_pool()
    fill(src, seed=15)
    keys = page_keys(list(range(16)), P)
    idx = src.alloc(16)
    attach(storage_config(file_url), src).batch_set_v1(keys, idx)
    expected = b"".join(page_bytes(src, i) for i in idx[::P].tolist())
    (tmp_path / "expected.bin").write_bytes(expected)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from support.sglang_helpers import attach, mha_pool, page_bytes, page_keys, prefetch, controller, storage_config
        dst = mha_pool()
        backend = attach(storage_config({file_url!r}), dst)
        keys = page_keys(list(range(16)), 4)
        idx = dst.alloc(16)
        assert prefetch(controller(backend, dst), keys, idx) == 4
        got = b"".join(page_bytes(dst, i) for i in idx[::4].tolist())
        assert got == open({str(tmp_path / 'expected.bin')!r}, "rb").read()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_bench_sglang_prints_both_sides_as_json():
    """``kvtier bench sglang``: every row measured in this run, kvtier and SGLang's HiCacheFile on the same
    pages (the bench raises if a side failed to move every page)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "bench", "sglang", "--json", "--backends", "file",
                          "--pages", "8", "--reps", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [(r["backend"], r["op"]) for r in rows] == [("file", "set"), ("file", "get")]
    for r in rows:
        assert r["kvtier_gbps"] > 0 and r["sglang_gbps"] > 0 and r["sglang_class"] == "HiCacheFile"
        # (both GB/s are rounded to 3 decimals: on a loaded machine a slow side's 0.013 may be 0.0125, so the
        # ratio of the printed figures is off by up to the rounding's share of each)
        rounding = 0.0005 / r["kvtier_gbps"] + 0.0005 / r["sglang_gbps"]
        assert r["ratio"] == pytest.approx(r["kvtier_gbps"] / r["sglang_gbps"], rel=0.02 + rounding)
    bad = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "bench", "sglang", "--layout", "sideways"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "sideways" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# ---- hardening, second round ----------------------------------------------------------------
def test_v1_host_indices_that_are_not_flat_integers_are_typed_errors_before_any_byte_moves(file_url, tmp_path):
    """Floats and 2-D indices were cast to int64 and flattened, so a get overwrote another page (the
    round-one "floats move pages" fault on SGLang's v1 path); ``None`` was an untyped TypeError."""
    from kvtier.errors import IndexTypeError

    src = mha_pool()
    fill(src, seed=21)
    backend = attach(storage_config(file_url), src)
    keys = page_keys(list(range(8)), P)
    idx = src.alloc(2 * P)
    assert backend.batch_set_v1(keys, idx) == [True, True]
    dst = mha_pool()
    fill(dst, seed=22)
    backend = attach(storage_config(file_url), dst)
    before = [bytes(t.view(torch.uint8).numpy()) for t in dst.kv_buffer]
    bad = {"float": idx.to(torch.float32) + 0.5, "2-D": idx.view(2, P), "None": None, "strings": ["0", "1"]}
    for name, host_indices in bad.items():
        for call in (backend.batch_get_v1, backend.batch_set_v1):
            with pytest.raises(IndexTypeError):
                call(keys, host_indices)
        with pytest.raises(IndexTypeError if host_indices is not None else PageAlignmentError):  # v2: "no host_indices"
            backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=host_indices, keys=keys)])
    after = [bytes(t.view(torch.uint8).numpy()) for t in dst.kv_buffer]
    assert after == before, "a refused call moved bytes"


def test_a_key_that_is_not_utf8_is_a_miss_and_the_store_stays_up(file_url):
    """A lone surrogate in a key was counted as a store fault and opened the breaker, so every
    other key missed for a while."""
    src = mha_pool()
    fill(src, seed=23)
    backend = attach(storage_config(file_url), src)
    keys = page_keys(list(range(12)), P)
    idx = src.alloc(3 * P)
    bad = "\ud800-lone-surrogate"
    assert backend.batch_set_v1([keys[0], bad, keys[2]], idx) == [True, False, False]  # it and the keys after it miss
    assert backend.batch_set_v1([keys[1], keys[2]], idx[P:]) == [True, True]
    assert backend.batch_exists([bad]) == 0 and backend.batch_get_v1([bad], idx[:P]) == [False]
    assert backend.get(bad) is None and backend.set(bad, src.get_dummy_flat_data_page()) is False
    assert backend.breaker.available and backend.backend.stats.errors == 0 and backend.invalid_keys >= 4
    dst = mha_pool()
    backend = attach(storage_config(file_url), dst)
    got = dst.alloc(3 * P)
    assert backend.batch_exists(keys) == 3 and backend.batch_get_v1(keys, got) == [True] * 3  # every other key still hits
    assert same_pages(src, idx, dst, got)


def test_mamba_state_pool_whose_pages_are_copies_round_trips_bit_exact(file_url):
    """SGLang's MambaPoolHost hands out its pages as copies: kvtier's zero-copy view then read and wrote
    a temporary, so batch_set_v2 / batch_get_v2 returned True and moved nothing (silent data loss). Now
    such a pool is found at register time and moved by copy (read out whole, written back)."""
    kv_src, mamba_src = mha_pool(), _mamba_pool(seed=41)
    fill(kv_src, seed=40)
    backend = attach(storage_config(file_url), kv_src, (PoolName.MAMBA, mamba_src))
    assert not backend._pool(PoolName.MAMBA).pages.aliases and backend._pool(PoolName.KV).pages.aliases
    keys = page_keys(list(range(12)), P)
    slots = torch.tensor([3, 7, 11])  # state slots (page_size 1), one per key
    done = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=keys)])
    assert done[PoolName.MAMBA] == [True] * 3
    mamba_dst = _mamba_pool()
    backend = attach(storage_config(file_url), mha_pool(), (PoolName.MAMBA, mamba_dst))
    into = torch.tensor([0, 5, 16])
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=into, keys=keys)])
    assert got[PoolName.MAMBA] == [True] * 3
    for s, d in zip(slots.tolist(), into.tolist()):
        assert torch.equal(mamba_dst.get_data_page(d), mamba_src.get_data_page(s)), f"state slot {s} -> {d} differs"
    untouched = [i for i in range(mamba_dst.size) if i not in into.tolist()]
    assert all(not mamba_dst.get_data_page(i).any() for i in untouched)  # nothing written elsewhere


def test_mamba_state_is_written_by_every_rank_under_mla(file_url):
    """Mamba state is per rank even in an MLA model, so every rank writes its own shard; only the MLA
    KV pool is left to SGLang's one storage writer (before, non-writer ranks never wrote the state)."""
    for rank in (0, 1):
        pool, state = mla_pool(), _mamba_pool(seed=50 + rank)
        fill(pool, seed=52)
        cfg = storage_config(file_url, tp_rank=rank, tp_size=2, mla=True)
        assert cfg.is_storage_writer == (rank == 0)  # SGLang's own rule: one MLA writer
        backend = attach(cfg, pool, (PoolName.MAMBA, state))
        keys = page_keys(list(range(4)), P)
        done = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys)])
        assert done[PoolName.MAMBA] == [True], rank
        back = _mamba_pool()
        reader = attach(cfg, mla_pool(), (PoolName.MAMBA, back))
        assert reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([4]), keys=keys)])[PoolName.MAMBA] == [True]
        assert torch.equal(back.get_data_page(4), state.get_data_page(2))  # each rank reads its own rank's state


def test_prefetches_never_wait_behind_a_burst_of_backups(file_url):
    """SGLang's backup thread writes a burst while its prefetch thread reads: the reads used to queue in
    the same I/O pool behind every write chunk. The store here is the real file backend with each write
    call slowed to 0.2 s (a store that is slow to write, fast to read)."""
    import threading

    src = mha_pool()
    fill(src, seed=61)
    backend = attach(storage_config(file_url, batch_pages=1, io_threads=2), src)
    stored = page_keys(list(range(1000, 1008)), P)
    assert backend.batch_set_v1(stored, src.alloc(8)) == [True] * 2  # what the prefetch will read
    real_set = backend.backend.set_scattered

    def slow_set(*args):
        time.sleep(0.2)
        return real_set(*args)

    backend.backend.set_scattered = slow_set
    burst = page_keys(list(range(64)), P)  # 16 pages: 16 one-page write chunks, 2 at a time: ~1.6 s
    writer = threading.Thread(target=backend.batch_set_v1, args=(burst, src.alloc(64)))
    writer.start()
    time.sleep(0.1)  # the burst is queued
    t0 = time.monotonic()
    got = backend.batch_get_v1(stored, mha_pool().alloc(8))
    read_s = time.monotonic() - t0
    writer.join(30)
    assert got == [True, True]
    assert read_s < 0.5, f"a 2-page prefetch took {read_s:.2f} s behind the backups"
